"""The KV checksum as every PD deployment of these tests runs it, and what its servers say of
it: ``sglang:kv_checksum_reqs_total`` by outcome on ``/metrics``, and the decode's mismatch
lines. Counted, never inferred from a missing line."""

from __future__ import annotations

import contextlib
import re

import requests

CHECKSUM = "--disaggregation-enable-kv-checksum"
CHECKED_DECODE = (CHECKSUM, "--enable-metrics")  # a decode that verifies and counts
# The control file of test support's misplacements (cpu_support/kv_misplacement.py).
INJECT_ENV = "SGLANG_DFLASH_PP_TEST_KV_MISPLACEMENT"


def checksum_counts(server) -> dict:
    """``sglang:kv_checksum_reqs_total`` by outcome, summed over the server's series."""
    text = requests.get(server.base_url + "/metrics", timeout=30).text
    counts = {}
    for line in text.splitlines():
        m = re.match(r'sglang:kv_checksum_reqs_total\{.*outcome="(\w+)".*\} ([0-9.e+]+)$', line)
        if m:
            counts[m.group(1)] = counts.get(m.group(1), 0) + int(float(m.group(2)))
    return counts


def mismatch_lines(server, rid: str) -> list:
    """The decode's mismatch lines of request ``rid``."""
    with open(server.log_path, errors="replace") as f:
        return [line.rstrip() for line in f if f"KV checksum mismatch req={rid} " in line]


@contextlib.contextmanager
def verified_exactly(server, requests: int):
    """Each of the block's ``requests`` through ``server`` verified once, nothing else counted."""
    before = checksum_counts(server)
    yield
    after = checksum_counts(server)
    assert after == {**before, "verified": before.get("verified", 0) + requests}, (before, after)
