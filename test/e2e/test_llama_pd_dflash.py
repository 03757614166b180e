"""DFLASH x PP through real servers: tiny fp32 Llama target, tiny fp32 DFlash draft, seeded.

Deployments, each real ``launch_server`` processes, the PD ones behind the real router:

* (a) ``A``: one non-PD DFLASH server (stock, PP1);
* (b) ``P1 -> D1``: PD, prefill DFLASH PP1 (stock), decode DFLASH;
* (c) ``P2 -> D1``: PD, prefill DFLASH **PP2** (partial projection, last-stage draft,
  Llama capture on every stage, layer-id pairing of the MHA transfer entries), the same decode;
* (d) ``P2 -> D2``: the same PP2 prefill into a decode at attention **TP2**. The draft has 2 KV
  heads and the target 4: P holds 2 draft heads per rank, each D2 rank 1, so the draft KV goes
  head by head while sglang slices the target heads;
* (e) ``P3 -> D1``: a **TP2 x PP2** prefill (four ranks; the draft at TP2 on the last stage, one
  draft head per rank) into the TP1 decode: the other direction of head mismatch (two prefill
  ranks writing disjoint heads of each decode token row).

The same prompts go through all three, one at a time and then all at once: a short prompt, one
longer than ``--chunked-prefill-size`` (the PP path runs chunked, several micro-batches in
flight), the short prompt again (a radix prefix hit on the prefill) and two more. Asserted:
greedy tokens (c) == (b) == (a); D's draft KV rows of every request after the transfer, read by
the test-only decode hook (``cpu_support/draft_kv_readout``), equal between (b) and (c) within
the fp32 bound derived in :func:`draft_kv_dumps.fp32_draft_kv_tolerance`, and (e)'s too; the
acceptance statistics the decode reports are identical between (b), (c) and (e); D2's two ranks' draft KV, side by
side, is byte-equal to D1's for the same prefill computation, and (d)'s and (e)'s tokens equal
(c)'s; and the ranks of the PP prefills entered the same sequence of collectives, group by group
(the startup deadlock the last stage's draft build had, and any other of its kind).
"""

from __future__ import annotations

import concurrent.futures
import glob
import json
import os

import pytest
import torch

import cpu_servers
import e2e_models as models
from deployments import Deployment
from deployment_args import CHUNK, DECODE_ARGS, ROUTER_ARGS, prefill_args, server_args
from draft_kv_dumps import fp32_draft_kv_tolerance, read_dumps
from kv_checksum_counts import CHECKED_DECODE, CHECKSUM, checksum_counts

pytestmark = pytest.mark.slow

MAX_NEW_TOKENS = 24
PROMPTS = [
    "hello world, this is",
    "The quick brown fox jumps over the lazy dog. " * 4,  # 180 tokens: three chunks of 64
    "hello world, this is",  # the same prompt again: a radix prefix hit on the prefill
    "Numbers: 1 2 3 4 5 6 7 8 9 10",
    "a",
]
SPEC_FIELDS = (
    "spec_verify_ct",
    "spec_accept_length",
    "spec_accept_rate",
    "spec_num_proposed_drafts",
    "spec_num_correct_drafts",
    "spec_correct_drafts_histogram",
)


@pytest.fixture(scope="module")
def llama(e2e_root, stub_root):
    root = os.path.join(e2e_root, "llama")
    return {
        "root": root,
        # 4 target KV heads, 2 draft KV heads: at TP2 a decode rank holds 2 and 1.
        "target": models.write_llama_target(os.path.join(root, "target"), kv_heads=4),
        "draft": models.write_dflash_draft(os.path.join(root, "draft")),
        "dump": os.path.join(root, "decode_draft_kv"),
        "collectives": {name: os.path.join(root, f"{name}_collectives") for name in ("P2", "P3")},
        "stub": stub_root,
    }


@pytest.fixture(scope="module")
def deployments(llama):
    m, root = llama, llama["root"]
    dep = Deployment("llama")
    launch = lambda name, args, **kw: dep.add(  # noqa: E731
        cpu_servers.launch_server(name, root, m["target"], args, stub_root=m["stub"], spec=True, **kw)
    )
    boot1, boot2, boot3 = (cpu_servers.free_port() for _ in range(3))
    decode_env = {"SGLANG_DFLASH_PP_TEST_DRAFT_KV_DUMP": m["dump"]}
    try:
        launch("A", server_args(m["draft"]))
        launch("P1", server_args(m["draft"], *prefill_args(boot1), CHECKSUM), pd=True)
        launch("P2", server_args(m["draft"], *prefill_args(boot2), "--pp-size", "2", CHECKSUM),
               pd=True, ranks=2,
               env={"SGLANG_DFLASH_PP_TEST_COLLECTIVE_LOG": m["collectives"]["P2"]})
        launch("P3", server_args(m["draft"], *prefill_args(boot3), "--pp-size", "2",
                                 "--tp-size", "2", CHECKSUM), pd=True, ranks=4,
               env={"SGLANG_DFLASH_PP_TEST_COLLECTIVE_LOG": m["collectives"]["P3"]})
        decode = server_args(m["draft"], *DECODE_ARGS, *CHECKED_DECODE)
        launch("D1", decode, pd=True, env=decode_env)
        launch("D2", decode + ["--tp-size", "2"], pd=True, ranks=2, env=decode_env)
        routes = {"router-b": ("P1", boot1, "D1"), "router-c": ("P2", boot2, "D1"),
                  "router-d": ("P2", boot2, "D2"), "router-e": ("P3", boot3, "D1")}
        for name, (p, boot, d) in routes.items():
            dep.add(cpu_servers.launch_pd_router(name, root, [(dep[p].base_url, boot)],
                                                 [dep[d].base_url], ROUTER_ARGS))
        dep.wait()
        yield dep
    finally:
        dep.kill()


def _run_round(base_url: str, tag: str, parallel: bool) -> list:
    def one(i):
        return cpu_servers.generate(base_url, PROMPTS[i], MAX_NEW_TOKENS, rid=f"{tag}-{i}")

    if not parallel:
        return [one(i) for i in range(len(PROMPTS))]
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(one, range(len(PROMPTS))))


def _flush(server, timeout_s: float = 120.0) -> None:
    """Flush the prefill's radix cache. sglang refuses while the server still holds requests
    (a PD prefill keeps a finished request until its KV transfer is acknowledged): retry until
    it is idle."""
    import time

    import requests

    deadline = time.monotonic() + timeout_s
    while True:
        r = requests.post(server.base_url + "/flush_cache", timeout=60)
        if r.status_code == 200:
            return
        assert time.monotonic() < deadline, f"flush_cache kept failing: {r.status_code} {r.text}"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def outputs(deployments, llama):
    """Every deployment's responses: a sequential round, then the same prompts all at once.
    (d) runs its sequential round on P2 with a flushed cache, like (c)'s first round, so P2
    computes the same draft KV bytes for both decodes."""
    urls = {"a": deployments["A"].base_url, "b": deployments["router-b"].base_url,
            "c": deployments["router-c"].base_url, "e": deployments["router-e"].base_url}
    out = {}
    for key, url in urls.items():
        out[key] = {
            "sequential": _run_round(url, f"{key}-seq", parallel=False),
            "parallel": _run_round(url, f"{key}-par", parallel=True),
        }
    _flush(deployments["P2"])
    out["d"] = {"sequential": _run_round(deployments["router-d"].base_url, "d-seq", parallel=False)}
    return out


def test_pp2_prefill_tokens_equal_pp1_prefill_and_non_pd(outputs):
    for round_ in ("sequential", "parallel"):
        a, b, c, e = (
            [r["output_ids"] for r in outputs[k][round_]] for k in ("a", "b", "c", "e")
        )
        assert all(len(ids) == MAX_NEW_TOKENS for ids in a)
        assert b == a, round_
        assert c == b, round_
        assert e == b, round_
    # the long prompt was prefilled in chunks, and the repeated prompt hit the radix cache
    seq_c = outputs["c"]["sequential"]
    assert seq_c[1]["meta_info"]["prompt_tokens"] > 2 * CHUNK
    assert seq_c[2]["meta_info"]["cached_tokens"] > 0


def test_acceptance_statistics_equal_between_pp1_and_pp2_prefill(outputs):
    for round_ in ("sequential", "parallel"):
        for rb, rc, re in zip(*(outputs[k][round_] for k in ("b", "c", "e"))):
            mb, mc, me = rb["meta_info"], rc["meta_info"], re["meta_info"]
            assert {f: mb[f] for f in SPEC_FIELDS} == {f: mc[f] for f in SPEC_FIELDS}
            assert {f: mb[f] for f in SPEC_FIELDS} == {f: me[f] for f in SPEC_FIELDS}
            # a real DFLASH decode: one verify step per committed token after the first
            assert mc["spec_verify_ct"] >= 1 and mc["spec_num_proposed_drafts"] > 0


def _dumps(llama, prefix: str, tp_rank: int = 0) -> dict:
    return read_dumps(llama["dump"], prefix, tp_rank)


@pytest.mark.parametrize("pp", ["c", "e"])
def test_decode_draft_kv_after_pp2_prefill_equals_pp1_prefill(llama, outputs, pp):
    b, c = _dumps(llama, "b"), _dumps(llama, pp)
    for round_, tag in (("sequential", "seq"), ("parallel", "par")):
        for i, prompt in enumerate(PROMPTS):
            rb, rc = b[f"b-{tag}-{i}"], c[f"{pp}-{tag}-{i}"]
            n_prompt = outputs["c"][round_][i]["meta_info"]["prompt_tokens"]
            assert rb["input_ids"] == rc["input_ids"] and len(rc["input_ids"]) == n_prompt
            for kind in ("k", "v"):
                ref, got = rb[kind].float(), rc[kind].float()
                assert ref.shape == got.shape == (2, n_prompt, 2, models.HEAD_DIM)
                assert float(ref.abs().mean()) > 1e-2  # real KV, not an empty pool
                diff = float((got - ref).abs().max())
                assert diff <= fp32_draft_kv_tolerance(ref), (round_, i, kind, diff)


def test_decode_at_tp2_receives_exactly_its_draft_heads(llama, outputs):
    """P2 holds both draft KV heads on its one rank; each D2 rank holds one. Side by side, the
    two ranks' draft KV must be D1's bytes for the same prefill computation: each head once, in
    its own rank, nothing shifted, nothing missing (byte equality, not a tolerance)."""
    assert [r["output_ids"] for r in outputs["d"]["sequential"]] == [
        r["output_ids"] for r in outputs["c"]["sequential"]
    ]
    c = _dumps(llama, "c")
    d0, d1 = _dumps(llama, "d", tp_rank=0), _dumps(llama, "d", tp_rank=1)
    for i in range(len(PROMPTS)):
        whole, halves = c[f"c-seq-{i}"], (d0[f"d-seq-{i}"], d1[f"d-seq-{i}"])
        for kind in ("k", "v"):
            assert all(h[kind].shape[2] == 1 for h in halves)
            side_by_side = torch.cat([h[kind] for h in halves], dim=2)
            assert torch.equal(side_by_side, whole[kind]), (i, kind)


def test_every_transfer_is_verified(deployments, outputs):
    """With the KV checksum on, every request's KV is compared on the decode: P1 -> D1 by
    upstream's digest (equal layouts), the PP2 and TP2 x PP2 prefills into D1 and the PP2
    prefill into the TP2 decode by the placement-keyed sums, counted by outcome."""
    d1 = sum(len(outputs[k][r]) for k in ("b", "c", "e") for r in ("sequential", "parallel"))
    assert checksum_counts(deployments["D1"]) == {"verified": d1} and d1 == 30
    assert checksum_counts(deployments["D2"]) == {"verified": len(PROMPTS)}


IN_FLIGHT = 64


@pytest.mark.parametrize("server, ranks", [("P2", 2), ("P3", 4)])
def test_pp_prefill_ranks_enter_the_same_collectives(llama, outputs, server, ranks):
    """Every collective of a group is entered by all of its members, in the same order. The
    last stage building its draft alone used to wait in a WORLD broadcast that the first stage
    never entered (it was in the WORLD all-reduce of KV-cache sizing): the server hung at startup.
    Startup is bounded (``STARTUP_TIMEOUT_S``); this also catches a divergence that happens not
    to hang. The servers keep running while the logs are read (a TP group's ranks exchange a
    broadcast every scheduler iteration, idle or not), so members may be a few collectives apart
    at the end: every collective up to the shortest log must match, and the shortest must hold
    all but the last ``IN_FLIGHT`` of the longest."""
    logs = {}
    for path in glob.glob(os.path.join(llama["collectives"][server], "rank*-*.jsonl")):
        rank = int(os.path.basename(path)[4:].split("-")[0])
        with open(path) as f:
            logs[rank] = [json.loads(line) for line in f]
    assert sorted(logs) == list(range(ranks)), sorted(logs)
    groups = {tuple(r["group"]) for recs in logs.values() for r in recs if r["group"]}
    assert tuple(range(ranks)) in groups  # the WORLD group of the PP stages was used
    for group in groups:
        seqs = {rank: [r["op"] for r in logs[rank] if tuple(r["group"] or ()) == group]
                for rank in group}
        shortest = min(len(seq) for seq in seqs.values())
        assert max(len(seq) for seq in seqs.values()) - shortest <= IN_FLIGHT, (group, seqs)
        common = {tuple(seq[:shortest]) for seq in seqs.values()}
        assert len(common) == 1, (group, {rank: seq[:shortest] for rank, seq in seqs.items()})
