"""The stack as in-tree patches, served: DFLASH PP2 PD prefill -> DFLASH decode -> router, on the
sglang tree ``export-patches`` generates, with the plugin **not loaded**.

The generator applies the whole series (PR 1 to PR 16) to a copy of the installed sglang 0.5.23;
the test fails, naming where the series stopped, if it does not reach PR 16. The servers get the
patched tree first on ``PYTHONPATH`` and ``SGLANG_PLUGINS`` naming only the test-only CPU support
plugin (``test/cpu_support``, which imports nothing of ``sglang_dflash_pp`` unless one of its
instruments for our own functions is switched on; the one here, ``kv_digest_trace``, is pointed
at the in-tree ``sglang.srt.disaggregation.kv_digest_verify``): an unset or empty
``SGLANG_PLUGINS`` would load every installed plugin, ours included. A test-only
``sitecustomize`` on the same path refuses any import of ``sglang_dflash_pp`` in every server
process (recording the attempt) and records where each process imported ``sglang`` from; the
test asserts every process ran guarded, imported sglang from the patched tree, and never tried
our package.

One deployment, the tiny fp32 Llama pair of ``test_llama_pd_dflash``: ``P`` DFLASH ``--pp-size
2`` (two stages of two layers; stage 0 owns feature 0, the last stage features 1 and 2 and the
draft) -> ``D`` DFLASH TP1 -> the PD router, both with ``--disaggregation-enable-kv-checksum``.
Asserted: greedy tokens equal the non-PD server's, and the decode's draft KV after the transfer
equals the plugin's PP2 deployment's for the same request (within the fp32 bound of
``draft_kv_dumps``; both compute the same sums). PR 16: every request was verified by the
in-tree composed digest on the decode (its ``record_outcome``, recorded by ``kv_digest_trace``;
stock would admit a PP2 prefill's requests unverified), nothing was admitted unverified, both
stages composed a digest, and one byte of a request's draft KV flipped on the decode (the
trace's test hook) fails that request naming the buffer; the next request is served. The reference
responses and dumps are the Llama module's (``llama_reference``) when it ran earlier in the
session; run alone, this module starts that reference itself (the non-PD server and the plugin's
PP2 prefill into a TP1 decode).

P TP1 PP2 -> D TP1 with the same draft KV heads on both sides is the stock transfer layout for the
draft band (the registration verdict says STOCK): the head-aware send of PRs 5 to 7 is not on
this path, but the series must still hold them.
"""

from __future__ import annotations

import glob
import os
import sys

import pytest

import cpu_servers
import e2e_models as models
import llama_reference
from deployment_args import DECODE_ARGS, prefill_args, server_args
from deployments import Deployment
from draft_kv_dumps import fp32_draft_kv_tolerance, read_dumps
from kv_digest_outcomes import CHECKSUM, ROUTER_ARGS, assert_corruption_detected, read_outcomes

pytestmark = pytest.mark.slow

LAST_PR = "16"
IN_TREE_VERIFY = "sglang.srt.disaggregation.kv_digest_verify"
MAX_NEW_TOKENS = 24
PROMPTS = [  # the sequential round of test_llama_pd_dflash, whose responses are the reference
    "hello world, this is",
    "The quick brown fox jumps over the lazy dog. " * 4,
    "hello world, this is",
    "Numbers: 1 2 3 4 5 6 7 8 9 10",
    "a",
]
CPU_SUPPORT_PLUGIN = "dflash_pp_cpu_support"  # its entry point (cpu_support/*.dist-info)
GUARD_ENV = "SGLANG_DFLASH_PP_TEST_NO_PLUGIN_DIR"

# Test-only: written as sitecustomize.py on the patched servers' PYTHONPATH.
GUARD = r'''
"""Test-only (test_patched_tree_pd_dflash): refuse and record any import of sglang_dflash_pp,
and record where sglang is imported from."""
import importlib.abc
import importlib.machinery
import os
import sys
import traceback

_dir = os.environ.get("SGLANG_DFLASH_PP_TEST_NO_PLUGIN_DIR")


class _Guard(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "sglang_dflash_pp" or name.startswith("sglang_dflash_pp."):
            with open(os.path.join(_dir, "imported-%d.txt" % os.getpid()), "a") as f:
                f.write(name + "\n" + "".join(traceback.format_stack()) + "\n")
            raise ImportError(name + " refused: the patched-tree servers run without the plugin")
        if name == "sglang":
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            with open(os.path.join(_dir, "sglang-%d.txt" % os.getpid()), "w") as f:
                f.write(getattr(spec, "origin", "") or "")
            return spec
        return None


if _dir:
    sys.meta_path.insert(0, _Guard())
    with open(os.path.join(_dir, "guarded-%d.txt" % os.getpid()), "w") as f:
        f.write(" ".join(sys.argv))
'''


@pytest.fixture(scope="module")
def patched(exported_series, tmp_path_factory):
    """The series generated onto a copy of the installed sglang (once per session:
    ``test/patch_series.py``, shared with test_export_patches); it must reach PR 16."""
    report = exported_series.report
    done = [r.pr for r in report.prs]
    if LAST_PR not in done:
        pytest.fail(
            f"the generated series does not reach PR {LAST_PR}: it holds PRs "
            f"{', '.join(done) or 'none'} and {report.stop.message}"
        )
    tree = exported_series.tree  # <root>/python/sglang, at the series' HEAD
    root = str(tmp_path_factory.mktemp("patched_tree"))
    guard = os.path.join(root, "guard")
    os.makedirs(guard)
    with open(os.path.join(guard, "sitecustomize.py"), "w") as f:
        f.write(GUARD)
    records = os.path.join(root, "guard_records")
    os.makedirs(records)
    return {"tree": tree, "guard": guard, "records": records, "report": report}


def _models(e2e_root):
    if llama_reference.RECORDED:
        return llama_reference.RECORDED["target"], llama_reference.RECORDED["draft"]
    root = os.path.join(e2e_root, "patched_tree_models")
    return (models.write_llama_target(os.path.join(root, "target"), kv_heads=4),
            models.write_dflash_draft(os.path.join(root, "draft")))


def _sequential(base_url: str, tag: str) -> list:
    return [cpu_servers.generate(base_url, p, MAX_NEW_TOKENS, rid=f"{tag}-{i}")
            for i, p in enumerate(PROMPTS)]


@pytest.fixture(scope="module")
def reference(e2e_root, stub_root):
    """The non-PD server's responses and the plugin PP2 deployment's decode draft KV dumps: the
    Llama module's when it ran, else served here (the plugin loaded as usual)."""
    if llama_reference.RECORDED:
        rec = llama_reference.RECORDED
        return {"a": rec["a"], "dump": rec["dump"], "prefix": "c"}
    target, draft = _models(e2e_root)
    root = os.path.join(e2e_root, "patched_tree_reference")
    os.makedirs(root, exist_ok=True)
    dump = os.path.join(root, "decode_draft_kv")
    dep = Deployment("patched-tree reference")
    launch = lambda name, args, **kw: dep.add(cpu_servers.launch_server(  # noqa: E731
        name, root, target, args, stub_root=stub_root, spec=True, **kw))
    boot = cpu_servers.free_port()
    try:
        launch("ref-A", server_args(draft))
        launch("ref-P2", server_args(draft, *prefill_args(boot), "--pp-size", "2"), pd=True,
               ranks=2)
        launch("ref-D1", server_args(draft, *DECODE_ARGS), pd=True,
               env={"SGLANG_DFLASH_PP_TEST_DRAFT_KV_DUMP": dump})
        dep.add(cpu_servers.launch_pd_router("ref-router", root, [(dep["ref-P2"].base_url, boot)],
                                             [dep["ref-D1"].base_url]))
        dep.wait()
        a = _sequential(dep["ref-A"].base_url, "a-seq")
        _sequential(dep["ref-router"].base_url, "c-seq")
    finally:
        dep.kill()
    return {"a": a, "dump": dump, "prefix": "c"}


@pytest.fixture(scope="module")
def served(patched, reference, e2e_root, stub_root):
    """The patched-tree deployment's responses (it is killed before the asserts)."""
    target, draft = _models(e2e_root)
    root = os.path.join(e2e_root, "patched_tree")
    os.makedirs(root, exist_ok=True)
    dump = os.path.join(root, "decode_draft_kv")
    digest = os.path.join(root, "kv_digest")  # the in-tree verifications (kv_digest_trace)
    os.makedirs(digest, exist_ok=True)
    path = os.pathsep.join([patched["guard"], os.path.dirname(patched["tree"]),
                            cpu_servers.CPU_SUPPORT, stub_root])
    env = {"PYTHONPATH": path, "SGLANG_PLUGINS": CPU_SUPPORT_PLUGIN,
           GUARD_ENV: patched["records"]}
    decode_env = {**env, "SGLANG_DFLASH_PP_TEST_DRAFT_KV_DUMP": dump,
                  "SGLANG_DFLASH_PP_TEST_KV_DIGEST_DIR": digest,
                  "SGLANG_DFLASH_PP_TEST_KV_DIGEST_MODULE": IN_TREE_VERIFY}
    dep = Deployment("patched tree, no plugin")
    launch = lambda name, args, **kw: dep.add(cpu_servers.launch_server(  # noqa: E731
        name, root, target, args, stub_root=stub_root, spec=True, **kw))
    boot = cpu_servers.free_port()
    try:
        launch("T-P2", server_args(draft, *prefill_args(boot), CHECKSUM, "--pp-size", "2"),
               pd=True, ranks=2, env=env)
        launch("T-D1", server_args(draft, *DECODE_ARGS, CHECKSUM), pd=True, env=decode_env)
        dep.add(cpu_servers.launch_pd_router("T-router", root, [(dep["T-P2"].base_url, boot)],
                                             [dep["T-D1"].base_url], ROUTER_ARGS))
        dep.wait()
        responses = _sequential(dep["T-router"].base_url, "t-seq")
        verified = read_outcomes(digest)  # before the corrupted request below
        try:  # its asserts are the test's (test_the_in_tree_digest_detects_a_flipped_byte)
            assert_corruption_detected(dep["T-router"].base_url, PROMPTS[0], MAX_NEW_TOKENS,
                                       "t-corrupt-draft", "draft", responses[0]["output_ids"],
                                       digest)  # fmt: skip
            corruption = None
        except AssertionError as e:
            corruption = e
        logs = {name: dep[name].log_text() for name in ("T-P2", "T-D1")}
    finally:
        dep.kill()
    return {"responses": responses, "dump": dump, "logs": logs, "verified": verified,
            "corruption": corruption}


def test_the_servers_ran_the_patched_tree_without_the_plugin(patched, served):
    records = patched["records"]
    tried = sorted(glob.glob(os.path.join(records, "imported-*.txt")))
    assert not tried, "a server process imported sglang_dflash_pp:\n" + "".join(
        open(p).read()[:3000] for p in tried)
    guarded = glob.glob(os.path.join(records, "guarded-*.txt"))
    origins = {}
    for p in glob.glob(os.path.join(records, "sglang-*.txt")):
        with open(p) as f:
            origins[os.path.basename(p)] = f.read()
    # the launchers, the two PP ranks and the decode's scheduler at least
    assert len(guarded) >= 4 and len(origins) >= 4, (guarded, origins)
    tree = os.path.realpath(patched["tree"])
    assert all(os.path.realpath(o).startswith(tree + os.sep) for o in origins.values()), origins
    for name, text in served["logs"].items():
        assert "sglang-dflash-pp registered" not in text, name  # our plugin's register()
    # the in-tree PP worker served both stages: no draft on the first, the KV-write-only draft
    # on the last; the first stage captured its own feature (PR 11)
    log = served["logs"]["T-P2"]
    assert "DFLASH PP stage 0/2: features [0]; carry in: none" in log, log[-3000:]
    assert "DFLASH PP stage 1/2: features [1, 2]; carry in: yes" in log, log[-3000:]
    assert "hosts the KV-write-only draft" in log
    assert "LlamaForCausalLM captures the input of layers [1]" in log


def test_tokens_equal_the_non_pd_servers(served, reference):
    got = [r["output_ids"] for r in served["responses"]]
    want = [r["output_ids"] for r in reference["a"]]
    assert all(len(ids) == MAX_NEW_TOKENS for ids in got)
    assert got == want


def test_decode_draft_kv_equals_the_plugin_deployments(served, reference):
    ref = read_dumps(reference["dump"], reference["prefix"])
    got = read_dumps(served["dump"], "t")
    worst = 0.0
    for i in range(len(PROMPTS)):
        r, g = ref[f"{reference['prefix']}-seq-{i}"], got[f"t-seq-{i}"]
        n = served["responses"][i]["meta_info"]["prompt_tokens"]
        assert r["input_ids"] == g["input_ids"] and len(g["input_ids"]) == n
        for kind in ("k", "v"):
            a, b = r[kind].float(), g[kind].float()
            assert a.shape == b.shape == (2, n, 2, models.HEAD_DIM)
            assert float(a.abs().mean()) > 1e-2  # real KV, not an empty pool
            diff = float((b - a).abs().max())
            worst = max(worst, diff)
            assert diff <= fp32_draft_kv_tolerance(a), (i, kind, diff)
    print(f"patched tree vs plugin PP2: largest draft KV difference {worst:.3g}", file=sys.stderr)


def test_every_request_is_verified_by_the_in_tree_digest(served):
    """PR 16 on the patched tree: the decode verified each request of the deployment with the
    in-tree composed digest (both PP stages' sums met its own bytes); stock's check would have
    admitted them unverified (a PP stage's layout signature differs), and logged so."""
    rows = served["verified"]
    sent = [f"t-seq-{i}" for i in range(len(PROMPTS))]
    assert all(r["outcome"] == "verified" for r in rows), rows
    ours = [r for r in rows if r["rid"].startswith("t-")]
    assert sorted(r["rid"] for r in ours) == sorted(sent), rows  # each once, on the one rank
    assert all("from 2 senders" in r["detail"] for r in ours), rows  # both PP stages
    decode, prefill = served["logs"]["T-D1"], served["logs"]["T-P2"]
    assert "KV checksum: this decode verifies composed digests" in decode
    assert "admitted unverified" not in decode
    for stage in (0, 1):  # each stage composes its own sums; stock's range digest is off
        assert f"KV checksum: composed digest on prefill pp rank {stage}" in prefill, prefill[-3000:]


def test_the_in_tree_digest_detects_a_flipped_byte(served):
    """One byte of a request's draft KV flipped on the decode after the transfer: the in-tree
    digest fails that request naming the room, the draft KV entry and its writers; the next one
    is served with the same tokens (``kv_digest_outcomes.assert_corruption_detected``)."""
    assert served["corruption"] is None, served["corruption"]
