"""The KV checksum catches misplaced KV on real servers, names it, and the servers keep serving.

One PP2 DFLASH prefill (tiny fp32 Llama, 4 target and 2 draft KV heads) behind the real router
into a TP1 decode and a TP2 decode, ``--disaggregation-enable-kv-checksum`` on all three. The
layouts differ (the prefill's PP stages hold half the layers each; the TP2 decode holds half the
heads), so each request is compared through the sums each side takes of its own pools.

A clean request is verified. Then test support (``cpu_support/kv_misplacement.py``) misplaces one
request's KV at a time, on the prefill while sending or on the decode after receiving: two
same-sized source entries swapped, a layer paired with the wrong decode layer, each TP2 decode
rank given the other's draft head, one flipped bit of target or draft KV. Each such request
fails; the decode logs a mismatch naming the component, layer, part and heads; the next clean
request is served with the same tokens. ``sglang:kv_checksum_reqs_total`` counts them.
"""

from __future__ import annotations

import os
import re

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
    ("wrong-head", "D2", [r"draft KV layer 0 K head\(s\) \[0\] written by prefill rank\(s\) "
                          r"\[1\]", r"draft KV layer 0 K head\(s\) \[1\]"]),
    ("flip-target", "D1", [r"target KV layer 0 K head\(s\) \[0\] written by prefill "
                           r"rank\(s\) \[0\]$"]),
    ("flip-draft", "D1", [r"draft KV layer 0 K head\(s\) \[0\] written by prefill "
                          r"rank\(s\) \[1\]$"]),
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


def test_misplaced_kv_fails_its_request_by_name_and_the_next_is_served(deployment):
    routers = {d: deployment[f"router-{d}"].base_url for d in ("D1", "D2")}
    reference = {d: cpu_servers.generate(routers[d], PROMPT, MAX_NEW_TOKENS, rid=f"clean-{d}")
                 for d in routers}
    assert reference["D1"]["output_ids"] == reference["D2"]["output_ids"]
    counts = {d: checksum_counts(deployment[d]) for d in routers}
    assert counts == {"D1": {"verified": 1}, "D2": {"verified": 1}}, counts
    for kind, decode, named in CASES:
        server = deployment[decode]
        before = checksum_counts(server)
        with open(deployment.inject_path, "w") as f:
            f.write(kind)
        try:
            response = post(routers[decode], f"{kind}-0")
        finally:
            open(deployment.inject_path, "w").close()
        assert response.status_code != 200, (kind, response.text[:500])
        new = mismatch_lines(server, f"{kind}-0")
        assert new, kind
        for pattern in named:
            assert any(re.search(pattern, line) for line in new), (kind, pattern, new)
        after = checksum_counts(server)
        assert after == {**before, "failed": before.get("failed", 0) + 1}, (kind, before, after)
        again = cpu_servers.generate(routers[decode], PROMPT, MAX_NEW_TOKENS, rid=f"{kind}-next")
        assert again["output_ids"] == reference[decode]["output_ids"], kind
        assert checksum_counts(server) == {**after, "verified": after["verified"] + 1}, kind
