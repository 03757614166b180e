"""The composed KV digest through real servers: the flag the PD deployments run with, the
decode ranks' verification records (``cpu_support/kv_digest_trace``), and the corruption check
the deployment modules share."""

from __future__ import annotations

import glob
import json
import os
import time
from typing import List

import requests

import cpu_servers

CHECKSUM = "--disaggregation-enable-kv-checksum"
# The router passes a failure through as it is: no retries (a retry would resend a corrupted or
# digest-less request and hide the outcome), no circuit breaker (a deliberately failed request
# would keep the decode out), no background health checks.
ROUTER_ARGS = ("--disable-retries", "--disable-circuit-breaker", "--disable-health-check")
DIGEST_TIMEOUT_S = 3.0  # SGLANG_DFLASH_KV_DIGEST_TIMEOUT_S on the test decodes
# On a prefill: the worker digests inside its transfers from the first byte (Mooncake's
# asynchronous batch API; the CPU servers' transfers are far below the default 16 MiB), so
# that path runs through real servers too; a prefill without it keeps the digest thread.
WINDOWS_ENV = {"SGLANG_DFLASH_KV_DIGEST_WINDOW_MIN_BYTES": "1"}
WINDOWS_STARTED = "KV checksum: the transfer worker digests inside its transfers"
BUFFER_WORDS = {"target": "target KV entry", "draft": "draft KV entry", "state": "state component"}


def read_outcomes(directory: str) -> List[dict]:
    rows = []
    for path in sorted(glob.glob(os.path.join(directory, "outcomes-*.jsonl"))):
        with open(path) as f:
            rows += [json.loads(line) for line in f if line.strip()]
    return rows


def assert_corruption_detected(url: str, prompt: str, max_new_tokens: int, rid: str, kind: str,
                               reference_ids: list, directory: str) -> None:
    """Send ``rid`` (the decode's test hook flips one byte of its ``kind`` buffer): the request
    fails naming the room, the buffer and its writers; the decode records the mismatch; the next
    request is served with ``reference_ids``."""
    body = {"text": prompt, "rid": rid,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}
    r = requests.post(url + "/generate", json=body, timeout=300)
    assert r.status_code != 200, r.text[:2000]
    text = r.text
    assert "KV checksum mismatch: room" in text, text[:2000]
    assert BUFFER_WORDS[kind] in text and "written by prefill pp rank" in text, text[:2000]
    deadline = time.monotonic() + 30
    while True:
        rows = [row for row in read_outcomes(directory) if row["rid"] == rid]
        if any(row["outcome"] == "mismatch" for row in rows) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    mismatched = [row for row in rows if row["outcome"] == "mismatch"]
    assert mismatched and all(BUFFER_WORDS[kind] in row["detail"] for row in mismatched), rows
    nxt = cpu_servers.generate(url, prompt, max_new_tokens, rid=rid.replace("corrupt", "after"))
    assert nxt["output_ids"] == reference_ids


def assert_missing_digest_fails(url: str, prompt: str, max_new_tokens: int, rid: str,
                                reference_ids: list, fault_dir: str) -> None:
    """Drop the next digest message a prefill rank sends (``cpu_support/fault_injection``): the
    request fails after the decode's bounded wait, naming the senders whose sums arrived; the
    trigger fired exactly once; the next request is served."""
    trigger = os.path.join(fault_dir, "drop-next-digest")
    before = set(glob.glob(os.path.join(fault_dir, "dropped-*.json")))
    open(trigger, "w").close()
    body = {"text": prompt, "rid": rid,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}
    t0 = time.monotonic()
    r = requests.post(url + "/generate", json=body, timeout=300)
    waited = time.monotonic() - t0
    assert r.status_code != 200, r.text[:2000]
    assert "sent their digest sums within" in r.text and "never delivered" in r.text, r.text[:2000]
    assert waited >= DIGEST_TIMEOUT_S, waited
    assert not os.path.exists(trigger)
    assert len(set(glob.glob(os.path.join(fault_dir, "dropped-*.json"))) - before) == 1
    nxt = cpu_servers.generate(url, prompt, max_new_tokens, rid=rid + "-next")
    assert nxt["output_ids"] == reference_ids
