"""DFLASH x PP with the user's target family, Kimi-K3, through real servers on CPU.

A tiny text-only ``KimiK3LinearForCausalLM`` (KDA + MLA + MoE, bf16, weights seeded per parameter
name; ``e2e_models.write_kimi_k3_target``) runs under the Triton interpreter (its KDA and MLA
kernels exist only in Triton; ``cpu_support/interpreter`` bypasses the interpreter's gaps), with
a tiny bf16 DFlash draft. Deployments, real ``launch_server`` processes and the real router:

* (a) ``A``: non-PD K3 DFLASH (stock, PP1);
* (b) ``P1 -> D``: PD, K3 DFLASH PP1 prefill (stock) -> K3 DFLASH decode;
* (c) ``P2 -> D``: PD, K3 DFLASH **PP2** prefill (K3 relays its captures natively,
  the final layer's at the final norm on the last stage) -> the same decode.

Asserted, as for the Llama deployments: greedy tokens (c) == (b) == (a); D's draft KV rows after
the transfer equal between (b) and (c) within the bf16 bound of :func:`draft_kv_tolerance`; the
acceptance statistics identical; with ``--disaggregation-enable-kv-checksum``, every transfer
verified (the MLA latent, the draft KV and the KDA state), and a request whose KDA state test
support flips after the transfer fails naming it, the next one served. Slow (about a second per token under the interpreter): few
prompts, few tokens, one start per deployment.
"""

from __future__ import annotations

import os
import re

import pytest
import requests
import torch

import cpu_servers
import e2e_models as models
from deployments import Deployment
from deployment_args import DECODE_ARGS, ROUTER_ARGS, prefill_args
from draft_kv_dumps import read_dumps
from kv_checksum_counts import (CHECKED_DECODE, CHECKSUM, INJECT_ENV, checksum_counts,
                                mismatch_lines)

pytestmark = pytest.mark.slow

MAX_NEW_TOKENS = 6
CHUNK = 16
PROMPTS = [
    "hello world, this is",  # 20 tokens: two chunks of 16
    "Numbers: 1 2 3",
    "hello world, this is",  # again: a radix hit on the prefill (mamba no_buffer strategy)
]
SPEC_FIELDS = ("spec_verify_ct", "spec_accept_length", "spec_num_proposed_drafts",
               "spec_num_correct_drafts", "spec_correct_drafts_histogram")
# cpu-servers.md section 3: MLA needs the Triton backend; the mamba cache without snapshots.
K3_ARGS = [
    "--trust-remote-code", "--load-format", "dummy", "--speculative-draft-load-format", "auto",
    "--attention-backend", "triton", "--mamba-radix-cache-strategy", "no_buffer",
    "--max-mamba-cache-size", "16", "--disable-overlap-schedule", "--max-total-tokens", "2048",
    "--max-running-requests", "4", "--chunked-prefill-size", str(CHUNK), "--sleep-on-idle",
]  # fmt: skip
K3_ENV = {"TRITON_INTERPRET": "1", "SGLANG_DFLASH_PP_TEST_SEEDED_WEIGHTS": "1"}


@pytest.fixture(scope="module")
def k3(e2e_root, stub_root):
    root = os.path.join(e2e_root, "kimi_k3")
    target = models.write_kimi_k3_target(os.path.join(root, "target"))
    draft = models.write_kimi_k3_draft(os.path.join(root, "draft"))
    dump = os.path.join(root, "decode_draft_kv")
    spec = ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", draft]
    dep = Deployment("kimi-k3")

    def launch(name, args, env=None, **kw):
        return dep.add(cpu_servers.launch_server(
            name, root, target, K3_ARGS + spec + args, stub_root=stub_root, spec=True,
            env={**K3_ENV, **(env or {})}, **kw))

    boot1, boot2 = cpu_servers.free_port(), cpu_servers.free_port()
    inject = os.path.join(root, "misplace")
    os.makedirs(root, exist_ok=True)
    open(inject, "w").close()
    try:
        launch("A", [])
        launch("P1", prefill_args(boot1) + [CHECKSUM], pd=True)
        launch("P2", prefill_args(boot2) + ["--pp-size", "2", CHECKSUM], pd=True, ranks=2)
        launch("D", DECODE_ARGS + [*CHECKED_DECODE], pd=True,
               env={"SGLANG_DFLASH_PP_TEST_DRAFT_KV_DUMP": dump, INJECT_ENV: inject})
        for name, (p, boot) in (("router-b", ("P1", boot1)), ("router-c", ("P2", boot2))):
            dep.add(cpu_servers.launch_pd_router(name, root, [(dep[p].base_url, boot)],
                                                 [dep["D"].base_url], ROUTER_ARGS))
        dep.wait()
        urls = {"a": dep["A"].base_url, "b": dep["router-b"].base_url,
                "c": dep["router-c"].base_url}
        outputs = {
            key: [cpu_servers.generate(url, p, MAX_NEW_TOKENS, rid=f"k3-{key}-{i}")
                  for i, p in enumerate(PROMPTS)]
            for key, url in urls.items()
        }
        # What the decode counted of the transfers above, before any test sends more.
        counts = checksum_counts(dep["D"])
        yield {"outputs": outputs, "dump": dump, "dep": dep, "inject": inject,
               "checksum_counts": counts}
    finally:
        dep.kill()


def test_k3_pp2_prefill_tokens_equal_pp1_prefill_and_non_pd(k3):
    a, b, c = ([r["output_ids"] for r in k3["outputs"][key]] for key in ("a", "b", "c"))
    assert all(len(ids) == MAX_NEW_TOKENS for ids in a)
    assert b == a and c == b
    assert k3["outputs"]["c"][0]["meta_info"]["prompt_tokens"] > CHUNK  # chunked on P2
    assert k3["outputs"]["c"][2]["meta_info"]["cached_tokens"] > 0


def test_k3_acceptance_statistics_equal(k3):
    for rb, rc in zip(k3["outputs"]["b"], k3["outputs"]["c"]):
        mb, mc = rb["meta_info"], rc["meta_info"]
        assert {f: mb[f] for f in SPEC_FIELDS} == {f: mc[f] for f in SPEC_FIELDS}
        assert mc["spec_verify_ct"] >= 1


def draft_kv_tolerance(reference: torch.Tensor) -> float:
    """The largest |difference| accepted between D's bf16 draft K (or V) after a PP1 and a PP2
    prefill of K3.

    PP1 rounds ``C = fc(concat)`` to bf16 once and normalises in bf16; PP2 sums the per-stage
    partials in fp32 and normalises in fp32 before the single cast to bf16 (``dflash_pp``).
    So the normalised context differs by at most one bf16 rounding of each path, 2 ulps,
    relative ``2 * 2^-8``. The K/V projection (fp32 accumulation over H terms of inputs with
    independent relative perturbations of that size) keeps it, and the per-head K RMSNorm at
    most doubles it; the stored value adds one more rounding on each side. Relative to the
    largest element: ``(2 * 2 * 2 + 2) * 2^-8``, about 0.039. A wrong head, token or layer
    gives an O(1) difference.
    """
    return (2 * 2 * 2 + 2) * 2.0**-8 * float(reference.abs().max())


def test_k3_decode_draft_kv_after_pp2_prefill_equals_pp1_prefill(k3):
    records = read_dumps(k3["dump"], "k3")
    for i in range(len(PROMPTS)):
        rb, rc = records[f"k3-b-{i}"], records[f"k3-c-{i}"]
        assert rb["input_ids"] == rc["input_ids"]
        for kind in ("k", "v"):
            ref, got = rb[kind].float(), rc[kind].float()
            assert ref.shape == got.shape and ref.shape[1] == len(rc["input_ids"])
            assert float(ref.abs().mean()) > 1e-2
            diff = float((got - ref).abs().max())
            assert diff <= draft_kv_tolerance(ref), (i, kind, diff)


def test_k3_every_transfer_is_verified(k3):
    """P1 -> D by upstream's digest (equal layouts), P2 -> D by the placement-keyed sums of
    the MLA latent, the draft KV and the KDA state."""
    transfers = len(k3["outputs"]["b"]) + len(k3["outputs"]["c"])
    assert k3["checksum_counts"] == {"verified": transfers}


def test_k3_flipped_state_fails_by_name_and_the_next_is_served(k3):
    dep, router = k3["dep"], k3["dep"]["router-c"].base_url
    before = checksum_counts(dep["D"])
    with open(k3["inject"], "w") as f:
        f.write("flip-state")
    try:
        body = {"text": PROMPTS[1], "rid": "k3-flip-state",
                "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0}}
        response = requests.post(router + "/generate", json=body, timeout=600)
    finally:
        open(k3["inject"], "w").close()
    assert response.status_code != 200, response.text[:500]
    new = mismatch_lines(dep["D"], "k3-flip-state")
    assert len(new) == 1 and re.search(
        r"recurrent state layer \d+ tensor \d+ channel\(s\) \[0\] written by prefill "
        r"rank\(s\) \[0\]$", new[0]), new
    after = checksum_counts(dep["D"])
    assert after == {**before, "failed": before.get("failed", 0) + 1}, (before, after)
    again = cpu_servers.generate(router, PROMPTS[1], MAX_NEW_TOKENS, rid="k3-after-flip")
    assert again["output_ids"] == k3["outputs"]["c"][1]["output_ids"]
    assert checksum_counts(dep["D"]) == {**after, "verified": after["verified"] + 1}
