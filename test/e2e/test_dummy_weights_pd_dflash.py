"""``--load-format dummy`` through real servers: a DFLASH PP2 prefill starts without any weights
and sends what a PP1 prefill sends.

Operators start a topology with dummy weights to benchmark it before the checkpoints arrive. The
draft directory here holds only ``config.json``: a PP2 first stage that read its ``fc`` column
blocks from the draft's safetensors would fail at startup, and one that made up its own blocks
would project the context with other weights than the last stage's dummy draft (and PP1's).
Deployments, real ``launch_server`` processes behind the real router, every server on stock
dummy weights (not the tests' seeded ones):

* (b) ``P1 -> D``: PD, DFLASH PP1 prefill (stock);
* (c) ``P2 -> D``: PD, DFLASH **PP2** prefill.

Asserted: the same greedy tokens, and D's draft KV of every request after the transfer equal
within the fp32 bound of :func:`draft_kv_dumps.fp32_draft_kv_tolerance`.
"""

from __future__ import annotations

import os

import pytest

import cpu_servers
import e2e_models as models
from deployment_args import CHUNK, DECODE_ARGS, prefill_args, server_args
from kv_checksum_counts import CHECKED_DECODE, CHECKSUM, checksum_counts
from deployments import Deployment
from draft_kv_dumps import fp32_draft_kv_tolerance, read_dumps

pytestmark = pytest.mark.slow

MAX_NEW_TOKENS = 8
PROMPTS = [
    "hello world, this is",
    "The quick brown fox jumps over the lazy dog. " * 4,  # three chunks of 64
    "a",
]
DUMMY = ("--load-format", "dummy")


@pytest.fixture(scope="module")
def dummy(e2e_root, stub_root):
    root = os.path.join(e2e_root, "dummy_weights")
    target = models.write_llama_target(os.path.join(root, "target"), kv_heads=4)
    draft = models.write_draft_config_only(os.path.join(root, "draft"))
    dump = os.path.join(root, "decode_draft_kv")
    dep = Deployment("dummy-weights")
    launch = lambda name, args, **kw: dep.add(  # noqa: E731
        cpu_servers.launch_server(name, root, target, args, stub_root=stub_root, spec=True, **kw)
    )
    boot1, boot2 = cpu_servers.free_port(), cpu_servers.free_port()
    try:
        launch("P1", server_args(draft, *prefill_args(boot1), *DUMMY, CHECKSUM), pd=True)
        launch("P2", server_args(draft, *prefill_args(boot2), *DUMMY, "--pp-size", "2",
                                 CHECKSUM), pd=True, ranks=2)
        launch("D", server_args(draft, *DECODE_ARGS, *DUMMY, *CHECKED_DECODE),
               pd=True,
               env={"SGLANG_DFLASH_PP_TEST_DRAFT_KV_DUMP": dump})
        for name, p, boot in (("router-b", "P1", boot1), ("router-c", "P2", boot2)):
            dep.add(cpu_servers.launch_pd_router(name, root, [(dep[p].base_url, boot)],
                                                 [dep["D"].base_url]))
        dep.wait()
        outputs = {
            key: [cpu_servers.generate(dep[f"router-{key}"].base_url, prompt, MAX_NEW_TOKENS,
                                       rid=f"{key}-{i}") for i, prompt in enumerate(PROMPTS)]
            for key in ("b", "c")
        }
        yield {"draft": draft, "dump": dump, "outputs": outputs, "dep": dep}
    finally:
        dep.kill()


def test_dummy_weight_pp2_prefill_gives_the_pp1_tokens(dummy):
    assert os.listdir(dummy["draft"]) == ["config.json"]
    b, c = dummy["outputs"]["b"], dummy["outputs"]["c"]
    assert all(len(r["output_ids"]) == MAX_NEW_TOKENS for r in b)
    assert [r["output_ids"] for r in c] == [r["output_ids"] for r in b]
    assert c[1]["meta_info"]["prompt_tokens"] > 2 * CHUNK  # the PP path ran chunked


def test_dummy_weight_pp2_prefill_sends_the_pp1_draft_kv(dummy):
    b, c = read_dumps(dummy["dump"], "b"), read_dumps(dummy["dump"], "c")
    for i in range(len(PROMPTS)):
        rb, rc = b[f"b-{i}"], c[f"c-{i}"]
        assert rb["input_ids"] == rc["input_ids"]
        for kind in ("k", "v"):
            ref, got = rb[kind].float(), rc[kind].float()
            assert ref.shape == got.shape and ref.shape[1] == len(rb["input_ids"])
            assert float(ref.abs().max()) > 0  # dummy values are about 1e-3, but not zero
            diff = float((got - ref).abs().max())
            assert diff <= fp32_draft_kv_tolerance(ref), (i, kind, diff)


def test_dummy_weight_transfers_are_verified(dummy):
    transfers = len(dummy["outputs"]["b"]) + len(dummy["outputs"]["c"])
    assert checksum_counts(dummy["dep"]["D"]) == {"verified": transfers}
