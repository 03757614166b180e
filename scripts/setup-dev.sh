#!/usr/bin/env bash
# Set up a development / CI environment from a clean clone on a fresh Debian machine:
# system libraries for the non-CUDA Mooncake engine, a virtualenv at .venv with the pinned
# sglang wheel, this project's tools and the test extra (pytest, the non-CUDA Mooncake build,
# the router), then the patch series applied to that sglang in place: `python -m
# sglang.launch_server` in .venv is the patched server every test serves.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi
if ! ldconfig -p | grep -q libibverbs.so.1 || ! ldconfig -p | grep -q libnuma.so.1; then
  $SUDO apt-get update -q
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q libibverbs1 libnuma1
fi

PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[test]"
# The patch series, applied in place to the wheel's sglang: the test session refuses to start
# on an sglang that does not carry this checkout's series.
.venv/bin/python -m sglang_dflash_pp.patch_series.install
.venv/bin/python -c "import sglang_dflash_pp, mooncake.engine; print('environment ready')"
