#!/usr/bin/env bash
# Set up a development / CI environment from a clean clone on a fresh Debian machine:
# system libraries for the non-CUDA Mooncake engine, then a virtualenv at .venv with the
# project and its test extra (sglang==0.5.23, pytest, hypothesis, mooncake non-CUDA build).
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
# No bytecode at install: pip would compile all of the ~36,000 installed modules on one core
# (about 2.5 min on CI's machine), and most of them (flashinfer, anthropic, modelscope, ...) nothing
# here imports. The imports below compile what the servers and the tests import, once; a module
# imported later is compiled by its first importer.
.venv/bin/python -m pip install -q --no-compile -e ".[test]"
.venv/bin/python - <<'PY'
import mooncake.engine, sglang.launch_server, sglang_router.launch_router  # noqa: F401
import sglang.srt.managers.scheduler, sglang.srt.managers.detokenizer_manager  # noqa: F401
import sglang.srt.entrypoints.http_server  # noqa: F401
from sglang.srt.plugins import load_plugins

load_plugins()  # every module a plugin hook names (sglang-dflash-pp's, as a server loads it)
import sglang_dflash_pp  # noqa: F401
print("environment ready")
PY
