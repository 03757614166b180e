"""The KV checksum catches misplaced KV on real servers, names it, and the servers keep serving.

One PP2 DFLASH prefill (tiny fp32 Llama, 4 target and 2 draft KV heads) behind the real router
into a TP1 decode and a TP2 decode, ``--disaggregation-enable-kv-checksum`` on all three. The
layouts differ (the prefill's PP stages hold half the layers each; the TP2 decode holds half the
heads), so each request is compared through the sums each side takes of its own pools.

A clean request is verified. Then test support (``cpu_support/kv_misplacement.py``) misplaces one
request's KV at a time, on the prefill while sending or on the decode after receiving: two
same-sized source entries swapped, a layer paired with the wrong decode layer, one flipped bit of
target KV: each such request fails; each TP2 decode rank given the other's draft head, one flipped
bit of draft KV: the draft KV alone differs, which can change no token, so the request is served
and counted apart. Every time the decode logs a mismatch naming the component, layer, part and
heads, and the next clean request is served with the same tokens.

Then what a cluster meets that a CPU test did not: the sums' frame from the prefill's last stage
a few bytes short, random, or missing; the sums failing to compute on the prefill's last stage;
the comparison raising on one TP rank of the decode. Each fails its request alone (on every TP
rank: the ranks agree before anything raises) and every server keeps serving.
``sglang:kv_checksum_reqs_total`` counts each outcome.
"""

from __future__ import annotations

import os
import re
import time

import pytest
import requests

import cpu_servers
import e2e_models as models
from deployment_args import DECODE_ARGS, ROUTER_ARGS, prefill_args, server_args
from deployments import Deployment
from kv_checksum_counts import (CHECKED_DECODE, CHECKSUM, INJECT_ENV, checksum_counts,
                                mismatch_lines)

pytestmark = pytest.mark.slow

PROMPT = "The quick brown fox jumps over the lazy dog. " * 2  # 90 tokens: two chunks
MAX_NEW_TOKENS = 8

# (what test support does, the decode it goes to, what the decode's mismatch must name). The
# prefill's last stage holds target layers 2 and 3, written by its rank 1 (PP rank 1).
CASES = [
    ("swap-source", "D1", [r"target KV layer 2 V head\(s\) \[0, 1, 2, 3\] written by "
                           r"prefill rank\(s\) \[1\]", r"target KV layer 3 V head\(s\)"]),
    ("swap-destination", "D1", [r"target KV layer 2 K head\(s\) \[0, 1, 2, 3\]",
                                r"target KV layer 3 K head\(s\)"]),
    ("flip-target", "D1", [r"target KV layer 0 K head\(s\) \[0\] written by prefill "
                           r"rank\(s\) \[0\]$"]),
]  # fmt: skip
# The draft KV alone differs: logged by name, served, counted draft_mismatch.
DRAFT_CASES = [
    ("wrong-head", "D2", [r"draft KV layer 0 K head\(s\) \[0\] written by prefill rank\(s\) "
                          r"\[1\]", r"draft KV layer 0 K head\(s\) \[1\]"]),
    ("flip-draft", "D1", [r"draft KV layer 0 K head\(s\) \[0\] written by prefill "
                          r"rank\(s\) \[1\]; served"]),
]  # fmt: skip
# A damaged frame or an exception: (what, the decode, what its log says of the request, the
# outcome counted: None where the transfer itself fails and nothing is compared).
FAULTS = [
    ("truncate-sums", "D1", r"KV checksum of req=truncate-sums-0 .* not compared: "
                            r"ValueError\('a KV checksum report of \d+ bytes'\)", "failed"),
    ("garbage-sums", "D1", r"KV checksum mismatch req=garbage-sums-0 .*target KV layer 2 K "
                           r"head\(s\) \[0, 1, 2, 3\] reported by no prefill rank", "failed"),
    ("drop-sums", "D2", r"KV checksum mismatch req=drop-sums-0 .*target KV layer 3 V "
                        r"head\(s\) \[\d, \d\] reported by no prefill rank", "failed"),
    ("raise-compare", "D2", r"KV checksum of req=raise-compare-0 .* not compared: "
                            r"RuntimeError\('raise-compare: a failure injected", "failed"),
    ("raise-sums", "D1", r"KV checksum sums could not be computed: RuntimeError", None),
]  # fmt: skip


@pytest.fixture(scope="module")
def deployment(e2e_root, stub_root):
    root = os.path.join(e2e_root, "kv_checksum")
    target = models.write_llama_target(os.path.join(root, "target"), kv_heads=4)
    draft = models.write_dflash_draft(os.path.join(root, "draft"))
    inject = os.path.join(root, "misplace")
    os.makedirs(root, exist_ok=True)
    open(inject, "w").close()
    dep = Deployment("kv_checksum")
    env = {INJECT_ENV: inject}
    launch = lambda name, args, **kw: dep.add(  # noqa: E731
        cpu_servers.launch_server(name, root, target, args, stub_root=stub_root, spec=True,
                                  pd=True, env=env, **kw))
    boot = cpu_servers.free_port()
    try:
        launch("P", server_args(draft, *prefill_args(boot), "--pp-size", "2", CHECKSUM), ranks=2)
        decode = server_args(draft, *DECODE_ARGS, *CHECKED_DECODE)
        launch("D1", decode)
        launch("D2", decode + ["--tp-size", "2"], ranks=2)
        for d in ("D1", "D2"):
            dep.add(cpu_servers.launch_pd_router(f"router-{d}", root, [(dep["P"].base_url, boot)],
                                                 [dep[d].base_url], ROUTER_ARGS))
        dep.wait()
        dep.inject_path = inject
        yield dep
    finally:
        dep.kill()


def post(url: str, rid: str):
    body = {"text": PROMPT, "rid": rid,
            "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0}}
    return requests.post(url + "/generate", json=body, timeout=300)


def injected(deployment, kind: str, router: str, rid: str):
    with open(deployment.inject_path, "w") as f:
        f.write(kind)
    try:
        return post(router, rid)
    finally:
        open(deployment.inject_path, "w").close()


@pytest.fixture(scope="module")
def reference(deployment):
    routers = {d: deployment[f"router-{d}"].base_url for d in ("D1", "D2")}
    out = {d: cpu_servers.generate(routers[d], PROMPT, MAX_NEW_TOKENS, rid=f"clean-{d}")
           for d in routers}
    assert out["D1"]["output_ids"] == out["D2"]["output_ids"]
    counts = {d: checksum_counts(deployment[d]) for d in routers}
    assert counts == {"D1": {"verified": 1}, "D2": {"verified": 1}}, counts
    return routers, {d: r["output_ids"] for d, r in out.items()}


def served_again(deployment, routers, reference, decode, kind):
    """The next clean request: the reference tokens, verified."""
    server = deployment[decode]
    before = checksum_counts(server)
    again = cpu_servers.generate(routers[decode], PROMPT, MAX_NEW_TOKENS, rid=f"{kind}-next")
    assert again["output_ids"] == reference[decode], kind
    after = checksum_counts(server)
    assert after == {**before, "verified": before.get("verified", 0) + 1}, kind


def test_misplaced_kv_fails_its_request_by_name_and_the_next_is_served(deployment, reference):
    routers, tokens = reference
    for kind, decode, named in CASES:
        server = deployment[decode]
        before = checksum_counts(server)
        response = injected(deployment, kind, routers[decode], f"{kind}-0")
        assert response.status_code != 200, (kind, response.text[:500])
        new = mismatch_lines(server, f"{kind}-0")
        assert new, kind
        for pattern in named:
            assert any(re.search(pattern, line) for line in new), (kind, pattern, new)
        after = checksum_counts(server)
        assert after == {**before, "failed": before.get("failed", 0) + 1}, (kind, before, after)
        served_again(deployment, routers, tokens, decode, kind)


def test_a_draft_kv_mismatch_is_served_and_counted_apart(deployment, reference):
    routers, tokens = reference
    for kind, decode, named in DRAFT_CASES:
        server = deployment[decode]
        before = checksum_counts(server)
        response = injected(deployment, kind, routers[decode], f"{kind}-0")
        assert response.status_code == 200, (kind, response.text[:500])
        # The target verifies every token: the same tokens, whatever the draft proposed.
        assert response.json()["output_ids"] == tokens[decode], kind
        new = mismatch_lines(server, f"{kind}-0")
        for pattern in named:
            assert any(re.search(pattern, line) for line in new), (kind, pattern, new)
        after = checksum_counts(server)
        assert after == {**before, "draft_mismatch": before.get("draft_mismatch", 0) + 1}, (
            kind, before, after)
        served_again(deployment, routers, tokens, decode, kind)


def test_a_damaged_frame_or_an_exception_fails_one_request(deployment, reference):
    routers, tokens = reference
    for kind, decode, logged, outcome in FAULTS:
        server = deployment[decode]
        before = checksum_counts(server)
        offsets = {name: os.path.getsize(s.log_path) for name, s in deployment.servers.items()}
        response = injected(deployment, kind, routers[decode], f"{kind}-0")
        assert response.status_code != 200, (kind, response.text[:500])
        logged_by = [(deployment[name], offsets[name]) for name in ("P", decode)]
        assert wait_for_log(logged_by, logged), (kind, logged)
        for name, s in deployment.servers.items():
            assert s.alive(), f"{name} died after {kind}"
        after = checksum_counts(server)
        expected = before if outcome is None else {
            **before, outcome: before.get(outcome, 0) + 1}
        assert after == expected, (kind, before, after)
        served_again(deployment, routers, tokens, decode, kind)


def wait_for_log(logs, pattern: str, timeout_s: float = 30.0) -> bool:
    """Whether ``pattern`` shows in the logs (server, offset) within ``timeout_s``: a line is
    written when the server gets to it, which may be after the client's answer."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = "".join(log_since(server, offset) for server, offset in logs)
        if re.search(pattern, text.replace("\n", " ")):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


def log_since(server, offset: int) -> str:
    with open(server.log_path, errors="replace") as f:
        f.seek(offset)
        return f.read()
