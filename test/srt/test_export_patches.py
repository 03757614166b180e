"""``sglang-dflash-pp export-patches``: the change as an in-tree patch series on sglang 0.5.23.

The generator runs once per session on a copy of the installed wheel's ``sglang/`` package laid
out as sglang's repository (``<root>/python/sglang``; a scratch git repository is made at the
root; ``test/patch_series.py``, shared with the patched-tree e2e test) and the tests read what it
did:

* one commit per finished PR, in the stack's order, titled and described from
  ``docs/upstream/README.md``; every PR of the stack is finished (16 is the last);
* ``git format-patch`` of the commits is the series: applied to the base it gives the same tree;
* the report's line counts are git's;
* the unit tests that move with their PRs (``test/registered/...``, registered for sglang's CPU
  CI) pass on the patched tree, run by pytest without the plugin, every moved test collected;
* every prefix of the series imports the modules it touched, in a subprocess with the copy
  first on ``sys.path`` and no plugin (``verify``: a whitelist naming no plugin, an import hook
  refusing ours, ``load_plugins()`` called as a server does, then no hook and no module of ours);
* each finished bug-fix PR's ``docs/upstream/bugs/<bug>/repro.py`` prints the right answer on the
  patched tree, and the one spot a reproduction cannot show (``record_stream`` on a CPU tensor)
  is checked on the patched worker itself;
* an edit whose symbol or anchor is missing stops the export with the PR, the file and the
  symbol, and leaves the finished prefix committed; ``--check`` reports it without writing;
* no file of the generator (or of this repository) holds upstream text beyond its anchors.

The edit primitives are checked on small snippets of our own.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import pytest

from sglang_dflash_pp import cli  # noqa: E402
from sglang_dflash_pp.tools.export_patches import cst_edits as ce  # noqa: E402
from sglang_dflash_pp.tools.export_patches import generator, stack, verify  # noqa: E402
from sglang_dflash_pp.tools.export_patches.errors import AnchorError  # noqa: E402
from sglang_dflash_pp.tools.export_patches.git_repo import TRAILER  # noqa: E402
from sglang_dflash_pp.tools.export_patches.new_modules import NewModule  # noqa: E402
from sglang_dflash_pp.tools.export_patches.stack_doc import (  # noqa: E402
    default_stack_doc,
    read_stack,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
INSTALLED = importlib.util.find_spec("sglang").submodule_search_locations[0]
GENERATOR_DIR = os.path.join(REPO, "python", "sglang_dflash_pp", "tools", "export_patches")
DOC = os.path.join(REPO, "docs", "upstream", "export-patches.md")


def git(cwd, *args, env=None):
    return subprocess.run(
        ["git", *args], cwd=cwd, check=True, capture_output=True, text=True, env=env
    ).stdout


def finished_prefix():
    """The PRs the series must hold: the stack's leading run of finished PRs."""
    out = []
    for pr in read_stack(default_stack_doc()):
        if not stack.REGISTRY[pr].finished:
            break
        out.append(pr)
    return out


@pytest.fixture
def exported(exported_series):
    """The series on a copy of the installed sglang, generated once per session
    (``test/conftest.py``): ``root`` the scratch repository, ``tree`` its ``python/sglang``."""
    return exported_series


# -- the series ------------------------------------------------------------------------------


def test_one_commit_per_finished_pr_titled_and_described_from_the_stack(exported):
    rows = read_stack(default_stack_doc())
    expected = finished_prefix()
    assert expected[:4] == ["1", "2", "3b", "3"]  # what this generator finishes today
    commits = git(exported.tree, "rev-list", "--reverse", f"{exported.report.base}..HEAD").split()
    assert len(commits) == len(expected) == len(exported.report.prs)
    for sha, pr in zip(commits, expected):
        subject = git(exported.tree, "log", "-1", "--format=%s", sha).strip()
        body = git(exported.tree, "log", "-1", "--format=%b", sha)
        assert subject == rows[pr].title
        assert " ".join(rows[pr].description().split()[:8]) in " ".join(body.split())
        assert body.rstrip().endswith(TRAILER)
        for path, names in exported.report.prs[expected.index(pr)].tests.items():
            assert f"- new {path}\n" in body and all(f"    {n}\n" in body for n in names), body
    # every PR of the stack, in its order: PR 6 after PR 15, PR 16 last
    assert expected == list(rows) and len(expected) == 17 and expected[-3:] == ["15", "6", "16"]
    stop = exported.report.stop
    assert stop.kind == "end" and "every PR of the stack is in the series" in exported.log
    assert "series: PRs 1, 2, 3b, 3, 4, 5, 7, 8, 9, 10, 11, 12, 13, 14, 15, 6, 16 (17 patches" in (
        exported.log)
    assert len(exported.report.patches) == len(expected)
    for name, pr in zip(sorted(exported.report.patches), expected):
        with open(os.path.join(exported.out, name)) as f:
            text = f.read()
        subject = " ".join(re.search(r"^Subject: (.*(?:\n .*)*)", text, re.M).group(1).split())
        assert subject.endswith(rows[pr].title)
        assert "diff --git a/python/sglang/" in text  # sglang's repository layout
        for path in exported.report.prs[expected.index(pr)].tests:
            assert f"diff --git a/{path} b/{path}" in text  # tests move with their PR
    assert os.path.isfile(os.path.join(exported.out, "report.json"))


def test_the_patches_rebuild_the_patched_tree_from_the_base(exported, tmp_path):
    env = dict(os.environ, GIT_INDEX_FILE=str(tmp_path / "index"))
    git(exported.root, "read-tree", exported.report.base, env=env)
    patches = [os.path.join(exported.out, p) for p in sorted(exported.report.patches)]
    git(exported.root, "apply", "--cached", *patches, env=env)  # a/python/sglang/..., a/test/...
    rebuilt = git(exported.root, "write-tree", env=env)
    assert rebuilt == git(exported.tree, "rev-parse", "HEAD^{tree}")
    assert git(exported.tree, "status", "--porcelain", "--untracked-files=no") == ""


def test_the_report_counts_what_git_counts_and_each_pr_touches_its_files(exported):
    for r in exported.report.prs:
        numstat = git(exported.tree, "diff", "--numstat", f"{r.commit}^", r.commit)
        git_counts = {}
        for line in numstat.splitlines():
            a, d, path = line.split("\t")
            git_counts[path] = (int(a), int(d))
        assert {f.path: (f.added, f.removed) for f in r.files} == git_counts
        pr = stack.REGISTRY[r.pr]
        declared = {"python/sglang/" + e.file for e in pr.edits} | {
            "python/sglang/" + m.file for m in pr.new_modules
        } | {t.target for t in pr.tests}
        assert set(git_counts) == declared
        new = {"python/sglang/" + m.file for m in pr.new_modules} | {t.target for t in pr.tests}
        assert {f.path for f in r.files if f.new} == new
        assert {f.path for f in r.files if f.test} == set(r.tests) == {t.target for t in pr.tests}
        a, d, n = r.upstream
        assert f"= upstream code +{a} -{d} in {n} file(s)" in exported.log
        # a few lines of ours per upstream function: at most 50 per PR and file (PR 16 edits
        # 13 functions in 5 files; its `with` scopes re-indent the three sends they wrap)
        assert a + d > 0 and a <= (80 if r.pr == "16" else 50)
        assert all(f.added <= 50 for f in r.files if not f.new), r.files


def test_every_prefix_imports_its_touched_modules_without_the_plugin(exported):
    checks = verify.verify_prefixes(exported.tree, exported.report.prs, log=lambda s: None)
    assert [c.pr for c in checks] == finished_prefix()
    for c in checks:
        assert c.errors == {}, c.errors
        assert c.from_tree  # sglang came from the checkout of that commit (the tree or a worktree)
        assert c.hooks == [] and c.plugin_modules == []
        assert c.ok
    assert "sglang.srt.disaggregation.kv_write_fence" in checks[-1].modules
    assert checks[-1].pr == "16" and {  # PR 16's halves and the transfer engine it edits
        "sglang.srt.disaggregation.kv_digest_send", "sglang.srt.disaggregation.kv_digest_verify",
        "sglang.srt.distributed.device_communicators.mooncake_transfer_engine",
    } <= set(checks[-1].modules)
    assert git(exported.tree, "rev-parse", "HEAD").strip() == exported.report.prs[-1].commit


def test_the_moved_tests_pass_on_the_patched_tree_without_the_plugin(exported):
    """Every test the series moved in-tree, run by pytest over the scratch repository's
    ``test/registered`` with the patched ``python/`` first on the path, ``SGLANG_PLUGINS`` naming
    no plugin and an import hook refusing ours: each passes, pytest collects exactly the tests
    the generator reports moving (per file; parametrized cases counted once), none imported
    sglang_dflash_pp, and sglang's own CI collector accepts each file's registration."""
    from sglang.test.ci.ci_register import collect_tests

    moved = exported.report.moved_tests
    per_pr = {r.pr: sum(map(len, r.tests.values())) for r in exported.report.prs if r.tests}
    assert {"3b", "6", "9", "12"} <= set(per_pr), per_pr
    for path in moved:
        assert path.startswith("test/registered/unit/"), path
    run = verify.run_moved_tests(exported.root)
    assert run.returncode == 0, run.output
    assert run.from_tree and run.hooks == [] and run.plugin_modules == [], run.sglang_file
    assert {p: sorted(n) for p, n in run.by_file().items()} == {
        p: sorted(n) for p, n in moved.items()
    }
    assert run.passed == run.collected and len(run.collected) >= sum(map(len, moved.values()))
    print(f"moved tests: {sum(map(len, moved.values()))} tests in {len(moved)} files "
          f"({len(run.collected)} cases) passed on the patched tree; per PR {per_pr}",
          file=sys.stderr)
    registries = collect_tests([os.path.join(exported.root, p) for p in moved])
    assert [(r.suite, r.est_time > 0) for r in registries] == [("base-a-test-cpu", True)] * len(
        moved
    )
    # the registration sits right after the imports, as sglang's files place it
    for path in moved:
        with open(os.path.join(exported.root, path)) as f:
            text = f.read()
        assert re.search(r"^from sglang\.test\.ci\.ci_register import register_cpu_ci\n\n"
                         r"register_cpu_ci\(est_time=\d+, suite=\"base-a-test-cpu\"\)\n", text,
                         re.M), path
        assert "sglang_dflash_pp" not in text and "sys.path" not in text, path


SPOT_5 = r"""
from types import SimpleNamespace
import torch
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2
from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

worker = object.__new__(DFlashWorkerV2)  # a shell: only what runs before the spot
worker.device = "cpu"
batch = SimpleNamespace(
    sampling_info=None, forward_mode=ForwardMode.DECODE, is_extend_in_batch=False,
    spec_info=DFlashDraftInputV2.create_idle_input(device="cpu"), seq_lens=torch.tensor([5, 3]),
)
try:
    worker.forward_batch_generation(batch)
except RuntimeError as e:
    print("SPOT5", "record_stream" if "unknown parameter type" in str(e) else "past: " + str(e))
except Exception as e:  # past the spot, into what the shell does not carry
    print("SPOT5", "past: " + type(e).__name__)
"""


DFLASH_PP_CHECKS = r"""
import inspect, json
from types import SimpleNamespace as NS
import torch

out = {}
# PR 8: the last-rank condition on every device
from sglang.srt.disaggregation import prefill
out["8"] = "_is_npu" not in inspect.getsource(prefill.PrefillBootstrapQueue._init_kv_manager)

# PR 9: plain-MHA layer ids only on a DFLASH PP prefill; a decode's ids filled at registration
from sglang.srt.disaggregation import mha_layer_ids, utils
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
pool = object.__new__(MHATokenToKVPool)
pool.model_layer_ids = [2, 3]
kw = dict(token_to_kv_pool=pool, draft_token_to_kv_pool=object(), num_draft_entries=2,
          num_hidden_layers=4)
mha_layer_ids.serving_dflash_pp_prefill = lambda: False
out["9_other"] = [utils.build_kv_layer_ids(**kw), mha_layer_ids.published_num_layers()]
mha_layer_ids.serving_dflash_pp_prefill = lambda: True
ids = utils.build_kv_layer_ids(**kw)
reg = NS(dst_kv_layer_ids=[], dst_kv_item_lens=[8] * 10, dst_kv_ptrs=[0] * 10)
bad = NS(dst_kv_layer_ids=[], dst_kv_item_lens=[8] * 9, dst_kv_ptrs=[0] * 9)
out["9_pp"] = [ids, mha_layer_ids.fill_decode_layer_ids(NS(kv_layer_ids=ids), reg),
               reg.dst_kv_layer_ids, mha_layer_ids.fill_decode_layer_ids(NS(kv_layer_ids=ids), bad)]

# PR 10: project_target_hidden finishes a stashed partial; without one it is the stock method
from sglang.srt.models.dflash import DFlashDraftModel
from sglang.srt.models.dflash_last_stage_context import LastStageContext, stashed_context
shell = NS(hidden_norm=NS(forward_native=lambda t: t * 10))
with stashed_context(shell, LastStageContext(torch.eye(2), torch.ones(3, 2))):
    out["10_stashed"] = DFlashDraftModel.project_target_hidden(shell, torch.ones(3, 2)).tolist()
try:
    DFlashDraftModel.project_target_hidden(shell, torch.ones(3, 2))
except AttributeError as e:  # the stock body, reading what the shell does not carry
    out["10_stock"] = str(e)

# PR 11: a non-last stage arms its capture only on a DFLASH PP prefill
import importlib
out["11"] = {}
for mod, cls in (("llama", "LlamaForCausalLM"), ("qwen3", "Qwen3ForCausalLM"),
                 ("qwen3_moe", "Qwen3MoeForCausalLM"), ("gpt_oss", "GptOssForCausalLM")):
    m = importlib.import_module("sglang.srt.models." + mod)
    armed = []
    m.arm_stage_capture = lambda *a, **k: armed.append([a[2], k.get("takes_accumulator", False)])
    shell = NS(pp_group=NS(is_last_rank=False), model=NS(layers_to_capture=None))
    m.serving_dflash_pp_prefill = lambda: False
    getattr(m, cls).set_dflash_layers_to_capture(shell, [0, 2])
    other = list(armed)
    m.serving_dflash_pp_prefill = lambda: True
    getattr(m, cls).set_dflash_layers_to_capture(shell, [0, 2])
    out["11"][cls] = [other, armed, shell.model.layers_to_capture]

# PR 12: the PP-aware worker for DFLASH PP on a PD prefill only; the last stage's draft build
# takes the stage's seed and load group
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
out["12_worker"] = [
    SpeculativeAlgorithm.DFLASH.create_worker(
        NS(pp_size=pp, disaggregation_mode=mode, device="cuda")).__name__
    for pp, mode in ((2, "prefill"), (1, "prefill"), (2, "null"))
]
import contextlib
from sglang.srt.layers.moe import utils as moe_utils
from sglang.srt.speculative import draft_worker_common as dwc
from sglang.srt.speculative.dflash_last_stage_draft_build import last_stage_draft_build
moe_utils.draft_model_build_scope = contextlib.nullcontext
dwc.resolve_draft_worker_attention_backend = lambda **k: "torch_native"
built = []
class _Built(Exception):
    pass
class _Worker:
    def __init__(self, **kw):
        built.append([kw["random_seed"], kw["load_group"] == "stage group"])
        raise _Built
for ctx in (contextlib.nullcontext(), last_stage_draft_build("stage group", 7, (1,))):
    with ctx:
        try:
            dwc.build_draft_tp_worker(server_args=None, gpu_id=0, nccl_port=0,
                                      target_model_config=NS(context_len=8),
                                      algo_label="DFLASH", draft_worker_cls=_Worker)
        except _Built:
            pass
out["12_build"] = built

# PR 13: the PP relay rebuilds DFlashDraftInputV2 for DFLASH, on every rank
from sglang.srt.managers.scheduler_pp_mixin import SchedulerPPMixin
from sglang.srt.model_executor.forward_batch_info import PPProxyTensors
out["13"] = {}
for name in ("DFLASH", "EAGLE"):
    empty = torch.empty(3, 0)
    result = NS(next_token_ids=torch.tensor([5, 6, 7]), accept_lens=None, logits_output=None,
                next_draft_input=NS(topk_p=empty, topk_index=empty.long(), hidden_states=empty,
                                    dsa_topk_indices=None))
    batch = NS(spec_algorithm=SpeculativeAlgorithm[name], return_logprob=False, input_ids=None,
               seq_lens=torch.tensor([9, 4, 12]), req_pool_indices=torch.arange(3))
    sched = NS(_pp_spec_relay=False, pp_group=NS(is_first_rank=False),
               future_map=NS(stash=lambda idx, payload: None),
               tp_worker=NS(model_runner=NS(sampling_observer=None)))
    tensors = SchedulerPPMixin._pp_prepare_tensor_dict(sched, result, batch)
    res = SchedulerPPMixin._pp_prep_batch_result(
        sched, batch, NS(can_run_cuda_graph=False, fpm_timing=None, fwd_batch=None),
        PPProxyTensors(tensors))
    out["13"][name] = ["draft_topk_p" in tensors, type(res.next_draft_input).__name__,
                       res.next_draft_input is batch.spec_info]

# PR 15: only the last stage's draft build is KV-write-only; a marked draft refuses to project
# without the PP context; the dummy initialiser is unchanged for any other model
from sglang.srt.model_loader.weight_utils import initialize_dummy_weights
from sglang.srt.models import dflash_kv_write_only as kvw
linear = torch.nn.Linear(2, 2)
initialize_dummy_weights(linear)
with last_stage_draft_build("stage group", 7, (1, 2)):
    inside = kvw.building_kv_write_only()
marked = NS(hidden_norm=None)
marked.__dict__[kvw.KV_WRITE_ONLY_ATTR] = kvw.KVWriteOnlyDraft((1, 2), 3, 2)
try:
    DFlashDraftModel.project_target_hidden(marked, torch.ones(3, 2))
    refused = None
except RuntimeError as e:
    refused = str(e)
out["15"] = [kvw.building_kv_write_only(), inside, refused,
             bool(torch.all(linear.weight.abs() <= 1e-3))]
print("PP_CHECK " + json.dumps(out))
"""


def _gate_cases(dirs):
    """DFLASH with PP2 on a dense Llama target: the served case and two refused ones."""
    base = dict(
        model_path=dirs["target"], speculative_algorithm="DFLASH",
        speculative_draft_model_path=dirs["draft_dense"], pp_size=2,
        disaggregation_mode="prefill", disaggregation_transfer_backend="mooncake",
        device="cuda", random_seed=0,
    )
    return {
        "served": base,
        "nixl": {**base, "disaggregation_transfer_backend": "nixl"},
        "decode": {**base, "disaggregation_mode": "decode"},
    }


def _resolve_on_tree(tree_dir, cases, tmp_path):
    """``ServerArgs`` resolved as ``launch_server`` does, on the tree, without the plugin."""
    path = os.path.join(tmp_path, "gate_cases.json")
    with open(path, "w") as f:
        json.dump(cases, f)
    script = os.path.join(REPO, "test", "srt", "resolution.py")
    r = subprocess.run([sys.executable, script, path], env=verify.tree_env(tree_dir),
                       capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_dflash_pp_prs_are_inert_without_the_plugin_on_the_exported_commits(
    exported, tmp_path, model_dirs
):
    """PRs 8 to 15 on the exported series, checked out at PR 13's and at PR 15's commit (the
    stack's order puts PR 6 after them), each in a subprocess with the tree first and no
    plugin: every module the PRs up to 15 touched imports, and each PR acts only on a DFLASH PP
    prefill; the gate refuses DFLASH PP2 as stock does before PR 14 and serves it after."""
    from sglang_dflash_pp.tools.export_patches import stack_pp

    ours = [p.number for p in stack_pp.PRS]
    assert ours == ["8", "9", "10", "11", "12", "13", "14", "15"]
    done = [r.pr for r in exported.report.prs]
    assert set(ours) <= set(done), exported.report.stop.message
    modules = []
    for r in exported.report.prs[: done.index(ours[-1]) + 1]:
        modules += [m for m in r.modules if m not in modules]
    with _at_pr(exported, "13") as tree_dir:  # PRs 8 to 13: DFLASH with PP is still refused
        before_gate = _resolve_on_tree(tree_dir, _gate_cases(model_dirs), tmp_path)
    code = verify._PRELUDE + "\nimport importlib\nfor _m in %r:\n    importlib.import_module(_m)\n" % (
        modules,
    ) + DFLASH_PP_CHECKS + "\nprint('PLUGIN_STATE ' + json.dumps(_plugin_state()))\n"
    with _at_pr(exported, ours[-1]) as tree_dir, ThreadPoolExecutor(2) as pool:
        checks = pool.submit(verify._run, code, [], verify.tree_env(tree_dir), timeout=300)
        gate = pool.submit(_resolve_on_tree, tree_dir, _gate_cases(model_dirs), tmp_path)
        r, after = checks.result(), gate.result()
    out, state = verify._tagged(r.stdout, "PP_CHECK"), verify._tagged(r.stdout, "PLUGIN_STATE")
    assert out is not None and state is not None, r.stderr[-3000:]
    assert os.path.realpath(state["sglang_file"]).startswith(os.path.realpath(tree_dir))
    assert state["hooks"] == [] and state["plugin_modules"] == []
    assert out["8"]
    assert out["9_other"] == [[], None]
    ids, filled, decode_ids, refused = out["9_pp"]
    assert ids == [2, 3, 2, 3, 4, 4] and filled is None
    assert decode_ids == [0, 1, 2, 3, 0, 1, 2, 3, 4, 4]
    assert "layer id" in refused and "9 KV entries" in refused
    assert out["10_stashed"] == [[20.0, 20.0]] * 3 and out["10_stock"]
    for cls, (other, armed, layers) in out["11"].items():
        keyword = "captured_last_layer_outputs" if "Moe" in cls else "capture_output"
        assert other == [] and armed == [[keyword, "Moe" in cls]] and layers is None, cls
    assert out["12_worker"] == ["PPDFlashWorkerV2", "DFlashWorkerV2", "DFlashWorkerV2"]
    assert out["12_build"] == [[None, False], [7, True]]
    assert out["13"] == {"DFLASH": [False, "DFlashDraftInputV2", True],
                         "EAGLE": [True, "EagleDraftInput", True]}
    none, inside, refused, dummy = out["15"]
    assert none is None and inside == [1, 2] and "KV-write-only" in refused and dummy
    # PR 14: the gate accepts DFLASH PP2 on a Mooncake PD prefill, and refuses naming the fix
    stock = "only supports pp_size == 1"
    assert all(stock in o.get("error", "") for o in before_gate.values()), before_gate
    assert "resolved" in after["served"], after["served"]
    assert after["served"]["resolved"]["pp_size"] == 2
    assert "--disaggregation-transfer-backend mooncake" in after["nixl"]["error"]
    assert "only supported on the PD prefill server" in after["decode"]["error"]


def _spot_5(package_dir, cwd):
    if package_dir is None:  # the installed, stock sglang
        env = dict(os.environ, SGLANG_PLUGINS=verify.NO_PLUGIN)
    else:
        env = verify.tree_env(package_dir)
    r = subprocess.run([sys.executable, "-c", SPOT_5], env=env, capture_output=True, text=True,
                       timeout=600, cwd=cwd)
    line = next((l for l in r.stdout.splitlines() if l.startswith("SPOT5 ")), None)
    assert line, r.stderr[-3000:]
    return line[len("SPOT5 "):]


def test_each_bug_fix_pr_fixes_its_reproduction_on_the_patched_tree(exported, tmp_path):
    prs = [stack.REGISTRY[r.pr] for r in exported.report.prs if stack.REGISTRY[r.pr].bug]
    assert {p.number for p in prs} >= {"1", "2", "3"}
    with ThreadPoolExecutor(2) as pool:
        runs = {p.number: pool.submit(verify.run_repro, p.bug, exported.tree) for p in prs}
        spot = {"patched": pool.submit(_spot_5, exported.tree, str(tmp_path)),
                "stock": pool.submit(_spot_5, None, str(tmp_path))}
    for p in prs:
        out = runs[p.number].result()
        res = out["result"]
        assert out["from_tree"] and out["hooks"] == [] and out["plugin_modules"] == []
        assert res["mode"] == "stock" and res["hooked_targets"] == []
        wrong = sorted(k for k in res["observed"] if res["observed"][k] != res["expected"][k])
        assert wrong == sorted(p.bug_unshown), (p.number, res["observed"])
    # The spot the reproduction cannot show: the worker's own record_stream call.
    assert spot["stock"].result() == "record_stream"
    assert spot["patched"].result().startswith("past: ")


# -- stopping like git am --------------------------------------------------------------------


def fake_tree(root, runner_method=True, skip_call=True):
    """A tiny stand-in tree (our own text) in sglang's layout (``tree/python/sglang``): PR 1's
    and PR 2's symbols, anchors as requested. Returns the package directory."""
    pkg = os.path.join(root, "tree", "python", "sglang")
    os.makedirs(os.path.join(pkg, "srt", "model_executor"))
    os.makedirs(os.path.join(pkg, "srt", "managers"))
    open(os.path.join(pkg, "__init__.py"), "w").close()
    with open(os.path.join(pkg, "srt", "model_executor", "model_runner.py"), "w") as f:
        f.write("class ModelRunner:\n")
        if runner_method:
            f.write("    def _extend_forward_kwargs(self, forward_batch, pp):\n"
                    "        return {'input_embeds': forward_batch.input_embeds.bfloat16()}\n")
        else:
            f.write("    def _build_kwargs(self, forward_batch, pp):\n        return {}\n")
    with open(os.path.join(pkg, "srt", "managers", "scheduler_pp_mixin.py"), "w") as f:
        f.write("class SchedulerPPMixin:\n    def _pp_make_skip_output_result(self, batch, m):\n")
        body = "Result(x=1)" if skip_call else "make_result(batch)"
        f.write(f"        return {body}\n")
    return pkg


def test_a_missing_symbol_stops_at_its_pr_naming_the_file_and_the_symbol(tmp_path):
    pkg = fake_tree(tmp_path, runner_method=False)
    report = generator.export(pkg, str(tmp_path / "out"), log=lambda s: None)
    assert report.stop.kind == "failed" and report.stop.pr == "1" and report.prs == []
    msg = report.stop.message
    assert "PR 1 does not apply" in msg
    assert "python/sglang/srt/model_executor/model_runner.py" in msg
    assert "ModelRunner._extend_forward_kwargs" in msg and "no class or function" in msg
    assert git(pkg, "rev-list", "--count", "HEAD").strip() == "1"  # the base only
    assert git(pkg, "status", "--porcelain") == ""


def test_a_missing_anchor_stops_after_the_finished_prefix(tmp_path, capsys):
    pkg = fake_tree(tmp_path, skip_call=False)
    code = cli.main(["export-patches", "--sglang-src", pkg, "--out", str(tmp_path / "out")])
    printed = capsys.readouterr().out
    assert code == 1
    assert "PR 1: input_embeds in the runner's dtype" in printed  # PR 1 applied and committed
    assert ("error: PR 2 does not apply: python/sglang/srt/managers/scheduler_pp_mixin.py: "
            "SchedulerPPMixin._pp_make_skip_output_result: call of `GenerationBatchResult(...)` "
            "not found") in printed
    assert git(pkg, "log", "-1", "--format=%s").startswith("PR 1: ")
    assert sorted(os.listdir(tmp_path / "out")) == [
        "0001-PR-1-input_embeds-in-the-runner-s-dtype-not-always-b.patch", "report.json"]
    with open(os.path.join(pkg, "srt", "model_executor", "model_runner.py")) as f:
        assert "forward_batch.input_embeds.to(self.dtype)" in f.read()


def test_check_reports_what_applies_and_writes_nothing(tmp_path, capsys):
    pkg = fake_tree(tmp_path, skip_call=False)
    before = {p: open(os.path.join(d, p)).read() for d, _, fs in os.walk(pkg) for p in fs}
    code = cli.main(["export-patches", "--sglang-src", pkg, "--check"])
    printed = capsys.readouterr().out
    assert code == 1
    assert re.search(r"PR 1: .*: applies", printed)
    assert re.search(r"PR 2: .*: does not apply\n  "
                     r"python/sglang/srt/managers/scheduler_pp_mixin.py: "
                     r"SchedulerPPMixin._pp_make_skip_output_result: ", printed)
    # PR 3b's files are absent here: reported as files, not as a crash
    assert "python/sglang/srt/disaggregation/prefill.py: <module>: no such file" in printed
    assert not os.path.exists(os.path.join(tmp_path, "tree", ".git"))
    after = {p: open(os.path.join(d, p)).read() for d, _, fs in os.walk(pkg) for p in fs}
    assert after == before


def test_a_dirty_tree_is_refused(tmp_path, capsys):
    pkg = fake_tree(tmp_path)
    root = os.path.join(tmp_path, "tree")
    git(root, "init", "-q")
    git(root, "add", "-A")
    git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "base")
    with open(os.path.join(pkg, "__init__.py"), "w") as f:
        f.write("x = 1\n")
    assert cli.main(["export-patches", "--sglang-src", root, "--out", str(tmp_path / "o")]) == 2
    assert "uncommitted changes" in capsys.readouterr().out


def test_a_package_outside_sglangs_layout_is_refused_naming_the_layout(tmp_path, capsys):
    """The old mode (a bare copy of the wheel's ``sglang/``) has no place for the tests: refused
    with the layout to use; so is a package inside a repository that is not its root."""
    pkg = fake_tree(tmp_path)
    bare = os.path.join(tmp_path, "bare", "sglang")
    shutil.copytree(pkg, bare)
    assert cli.main(["export-patches", "--sglang-src", bare, "--out", str(tmp_path / "o")]) == 2
    printed = capsys.readouterr().out
    assert "outside sglang's repository layout" in printed
    assert "hint: lay the tree out as sglang's repository" in printed
    assert "cp -r \"$SGLANG\" /tmp/tree/python/sglang" in printed
    assert not os.path.exists(os.path.join(tmp_path, "bare", ".git"))
    root = os.path.join(tmp_path, "tree")
    git(str(tmp_path), "init", "-q")  # the tree is now inside a repository rooted above it
    assert cli.main(["export-patches", "--sglang-src", root, "--out", str(tmp_path / "o")]) == 2
    assert "is not its root" in capsys.readouterr().out


# -- the registry ----------------------------------------------------------------------------


def test_the_registry_covers_the_stack_and_finished_prs_are_a_prefix():
    rows = list(read_stack(default_stack_doc()))
    assert set(rows) == set(stack.REGISTRY)
    finished = [p for p in rows if stack.REGISTRY[p].finished]
    # The export stops before the first unfinished PR, so a PR finished after it waits for it
    # (and is in no exported commit the tests could check out).
    prefix = finished_prefix()
    assert finished[: len(prefix)] == prefix
    for p in rows:
        if not stack.REGISTRY[p].finished:
            assert stack.REGISTRY[p].unfinished and not stack.REGISTRY[p].edits
    for p in finished:
        pr = stack.REGISTRY[p]
        assert pr.edits or pr.new_modules
        for e in pr.edits:
            assert e.symbol or isinstance(e, ce.AddImport), e  # anchored on a symbol
        if pr.bug:
            bugs = os.path.join(REPO, "docs", "upstream", "bugs")
            assert os.path.isfile(os.path.join(bugs, pr.bug, "repro.py"))


def _normal(line: str) -> str:
    return " ".join(line.split()).strip("'\"(),")


def _upstream_lines():
    files = {e.file for p in stack.REGISTRY.values() for e in p.edits}
    lines = set()
    for rel in files:
        if not os.path.isfile(os.path.join(INSTALLED, rel)):
            continue  # a file an earlier PR of the series created (PR 5's draft_kv_send): ours
        with open(os.path.join(INSTALLED, rel)) as f:
            lines |= {_normal(l) for l in f if len(_normal(l)) >= 30}
    return files, lines


def stored_upstream_lines(paths, upstream, anchors):
    """Lines of ``paths`` that are lines of the upstream files and not inside a declared anchor."""
    found = []
    for path in paths:
        with open(path) as f:
            for n, line in enumerate(f, 1):
                text = _normal(line)
                if text.startswith(("from ", "import ")):
                    continue  # an import names a module; it is no upstream text
                if len(text) >= 30 and text in upstream and not any(text in a for a in anchors):
                    found.append(f"{os.path.relpath(path, REPO)}:{n}: {line.strip()}")
    return found


def _anchors():
    return [_normal(a) for p in stack.REGISTRY.values() for e in p.edits for a in e.anchors()]


def test_no_upstream_text_is_stored_in_this_repository():
    files, upstream = _upstream_lines()
    assert len(files) >= 8 and len(upstream) > 1000
    ours = [os.path.join(GENERATOR_DIR, f) for f in os.listdir(GENERATOR_DIR) if f.endswith(".py")]
    ours += [DOC, os.path.abspath(__file__)]
    found = stored_upstream_lines(ours, upstream, _anchors())
    assert not found, "upstream lines stored outside the anchors:\n" + "\n".join(found)
    # and no stored patch anywhere in the repository
    stored = []
    for d, dirs, fs in os.walk(REPO):
        dirs[:] = [x for x in dirs if x not in (".git", ".venv", "node_modules", "__pycache__")]
        stored += [os.path.join(d, f) for f in fs if f.endswith((".patch", ".diff"))]
    assert not stored, stored


def test_the_no_upstream_text_check_can_fail(tmp_path):
    _, upstream = _upstream_lines()
    with open(os.path.join(INSTALLED, "srt", "managers", "scheduler_pp_mixin.py")) as f:
        code = [l for l in f if not l.lstrip().startswith(("from ", "import "))]
        copied = [l for l in code if len(_normal(l)) >= 30][10:12]
    path = tmp_path / "copied.py"
    path.write_text("".join(copied))
    assert len(stored_upstream_lines([str(path)], upstream, _anchors())) == 2


# -- the primitives, on snippets of our own --------------------------------------------------

SNIPPET = textwrap.dedent(
    '''\
    import os

    from pkg.a import alpha
    from pkg.b import beta

    LIMIT = 3


    class Box:
        def fill(self, items):
            """Fill it."""
            total = count(items)
            out = make(
                first=1,
                second=2,
            )

            if ready(items) or total > LIMIT:
                out.go(total)
            return out
    '''
)


def apply(edit, code=SNIPPET):
    import libcst

    return edit.apply(libcst.parse_module(code)).code


def test_replace_expression_and_its_errors():
    out = apply(ce.ReplaceExpression("f.py", "Box.fill", old="count( items )", new="len(items)"))
    assert "total = len(items)" in out and out.count("\n") == SNIPPET.count("\n")
    with pytest.raises(AnchorError, match="expression `count\\(other\\)` not found"):
        apply(ce.ReplaceExpression("f.py", "Box.fill", old="count(other)", new="0"))
    with pytest.raises(AnchorError, match="no class or function `Box.empty`"):
        apply(ce.ReplaceExpression("f.py", "Box.empty", old="x", new="y"))
    with pytest.raises(AnchorError, match="found 3 times"):
        apply(ce.ReplaceExpression("f.py", "Box.fill", old="items", new="xs"))


def test_add_keyword_argument_follows_the_call_layout():
    out = apply(ce.AddKeywordArgument("f.py", "Box.fill", call="make", keyword="third",
                                      value="total", comment="ours"))
    assert "            second=2,\n            # ours\n            third=total,\n        )" in out
    with pytest.raises(AnchorError, match="already passes `first=`"):
        apply(ce.AddKeywordArgument("f.py", "Box.fill", call="make", keyword="first", value="0"))


def test_replace_keyword_argument_keeps_the_layout_and_checks_the_old_value():
    out = apply(ce.ReplaceKeywordArgument("f.py", "Box.fill", call="make", keyword="second",
                                          old="2", value="total"))  # fmt: skip
    assert "            first=1,\n            second=total,\n        )" in out
    with pytest.raises(AnchorError, match="passes `second=2`, not `3`"):
        apply(ce.ReplaceKeywordArgument("f.py", "Box.fill", call="make", keyword="second",
                                        old="3", value="total"))  # fmt: skip
    with pytest.raises(AnchorError, match="argument `third=` not found"):
        apply(ce.ReplaceKeywordArgument("f.py", "Box.fill", call="make", keyword="third",
                                        old="3", value="total"))  # fmt: skip


def test_add_parameter_follows_the_signature_layout():
    out = apply(ce.AddParameter("f.py", "Box.fill", name="packs"))
    assert "    def fill(self, items, packs=None):\n" in out
    wide = "def send(\n    a,\n    b: int = 0,\n):\n    pass\n"
    out = apply(ce.AddParameter("f.py", "send", name="packs", annotation="Optional[P]"), wide)
    assert out == "def send(\n    a,\n    b: int = 0,\n    packs: Optional[P] = None,\n):\n    pass\n"
    with pytest.raises(AnchorError, match="already has a parameter `items`"):
        apply(ce.AddParameter("f.py", "Box.fill", name="items"))


def test_insert_statements_widen_guard_and_replace_body():
    out = apply(ce.InsertStatements("f.py", "Box.fill", after=ce.Stmt("total = count(items)"),
                                    code="# ours\ntotal += 1\n"))
    assert "total = count(items)\n        # ours\n        total += 1\n        out = make(" in out
    anchor = ce.IfTest("ready(items) or total > LIMIT")
    out = apply(ce.InsertStatements("f.py", "Box.fill", before=anchor, code="log(total)"))
    assert "        )\n\n        log(total)\n\n        if ready(items)" in out
    out = apply(ce.InsertStatements("f.py", "Box.fill", at="start", code="check(items)"))
    assert '"""Fill it."""\n        check(items)\n        total' in out
    out = apply(ce.WidenCondition("f.py", "Box.fill", condition="ready(items) or total > LIMIT",
                                  extra="forced"))
    assert "if ready(items) or total > LIMIT or forced:" in out
    out = apply(ce.GuardStatement("f.py", "Box.fill", statement="out.go(total)", condition="total"))
    assert "            if total:\n                out.go(total)\n" in out
    out = apply(ce.ReplaceBody("f.py", "Box.fill", code="return None"))
    assert '"""Fill it."""\n        return None\n' in out
    with pytest.raises(AnchorError, match="`if nothing:` not found"):
        apply(ce.InsertStatements("f.py", "Box.fill", after=ce.IfTest("nothing"), code="x = 1"))
    out = apply(ce.WrapStatement("f.py", "Box.fill", call="make", context="scope(total)"))
    assert "        with scope(total):\n            out = make(\n                first=1,\n" in out
    out = apply(ce.WrapStatement("f.py", "Box.fill", call="count", context="scope() as xs",
                                 rename=("items", "xs")))  # fmt: skip
    assert "        with scope() as xs:\n            total = count(xs)\n        out = make(" in out
    with pytest.raises(AnchorError, match="argument `other` of `count\\(...\\)` not found"):
        apply(ce.WrapStatement("f.py", "Box.fill", call="count", context="s()",
                               rename=("other", "xs")))  # fmt: skip
    empty = "class Empty(Base):\n    pass\n"
    out = apply(ce.ReplaceBody("f.py", "Empty", code="def poll(self):\n    return 1\n"), empty)
    assert out == "class Empty(Base):\n    def poll(self):\n        return 1\n"
    with pytest.raises(AnchorError, match="class `Box` has a body"):
        apply(ce.ReplaceBody("f.py", "Box", code="x = 1"))


def test_widen_condition_breaks_a_parenthesised_condition_one_operand_per_line():
    code = "def f(a):\n    ok = (\n        a.x or a.y or a.z\n    )\n"
    out = apply(ce.WidenCondition("f.py", "f", condition="a.x or a.y or a.z", extra="a.w"), code)
    lines = ["def f(a):", "    ok = (", "        a.x", "        or a.y", "        or a.z",
             "        or a.w", "    )"]
    assert out == "\n".join(lines) + "\n"


def test_add_import_merges_or_places_in_order():
    out = apply(ce.AddImport("f.py", module="pkg.a", names=("Alpha",)))
    assert "from pkg.a import Alpha, alpha\nfrom pkg.b import beta\n" in out
    out = apply(ce.AddImport("f.py", module="pkg.A", names=("Z",)))  # first of its group
    assert "import os\n\nfrom pkg.A import Z\nfrom pkg.a import alpha\n" in out
    out = apply(ce.AddImport("f.py", module="pkg.ab", names=("gamma",)))
    assert "from pkg.a import alpha\nfrom pkg.ab import gamma\nfrom pkg.b import beta\n" in out
    long_names = tuple(f"name_{i:02d}_of_some_length" for i in range(4))
    out = apply(ce.AddImport("f.py", module="pkg.b", names=long_names))
    assert "from pkg.b import (\n    beta,\n    name_00_of_some_length,\n" in out


def test_new_module_moves_our_code_without_the_glue():
    fence = "sglang_dflash_pp.srt.disaggregation.kv_write_fence"
    m = NewModule(fence, drop=("send_around", "HOOKS"), docstring="In-tree.",
                  values=(("WRITTEN_ATTR", '"_x"'),))
    text = m.render({m.source: m.module})
    assert m.file == "srt/disaggregation/kv_write_fence.py"
    assert text.startswith('"""In-tree.\n"""') and 'WRITTEN_ATTR = "_x"' in text
    assert "def chunk_wait_event" in text and "send_around" not in text
    assert "PluginHook" not in text and "sglang_dflash_pp" not in text
    with pytest.raises(AnchorError, match="imports \\['sglang_dflash_pp.hooks'\\]"):
        NewModule(fence).render({})
    with pytest.raises(AnchorError, match="no top-level \\['nothing'\\]"):
        NewModule(fence, drop=("nothing",)).render({})
    # a module importing one no PR moved yet is refused
    with pytest.raises(AnchorError, match="which no PR up to this one moves in-tree"):
        NewModule("sglang_dflash_pp.srt.disaggregation.transfer_chunk").render({})


def test_new_test_moves_our_test_and_refuses_what_needs_this_repository():
    """A moved test: imports rewritten to the in-tree modules (``from pkg import module`` too),
    the dropped tests and the imports only they used gone, the ``sys.path`` edit for our
    harness gone, the CI registration after the imports and the ``__main__`` entry at the end.
    A test that still imports a helper of this repository or the plugin is refused, naming
    the import."""
    from sglang_dflash_pp.tools.export_patches.new_tests import NewTest

    fence = "sglang_dflash_pp.srt.disaggregation.kv_write_fence"
    moved = {fence: "sglang.srt.disaggregation.kv_write_fence"}
    pr = stack.REGISTRY["3b"]
    (t,) = pr.tests
    text, names = t.render(moved)
    assert names == ("test_record_kv_written_is_a_no_op_without_streams",
                     "test_record_kv_written_attaches_one_event_to_every_request")
    assert "\nfrom sglang.srt.disaggregation import kv_write_fence\n" in text
    assert "sender_shell" not in text and "harness" not in text and "sys.path" not in text
    assert "import numpy" not in text and "noqa" not in text
    assert text.rstrip().endswith('sys.exit(pytest.main([__file__, "-v"]))')
    assert 'register_cpu_ci(est_time=5, suite="base-a-test-cpu")' in text
    keep_harness = NewTest(t.source, t.target, est_time=5)
    helper = "imports \\['test_draft_kv_mooncake'\\], test-only helpers"
    with pytest.raises(AnchorError, match=helper):
        keep_harness.render(moved)
    plugin_tool = NewTest("test/srt/test_qkv_kv_heads.py",
                          "test/registered/unit/disaggregation/test_qkv_kv_heads.py", est_time=5)
    with pytest.raises(AnchorError, match="sglang_dflash_pp.tools.qkv_kv_heads"):
        plugin_tool.render({})
    with pytest.raises(AnchorError, match="not a test_\\*.py under test/registered/"):
        NewTest(t.source, "test/srt/test_kv_write_fence.py", est_time=5).render(moved)


def test_cli_lists_export_patches():
    parser = cli.build_parser()
    assert "export-patches" in parser.format_help()


# -- the Mooncake group (PRs 4 to 7) on the patched tree, without the plugin ------------------

HEADS_BUG = os.path.join(REPO, "docs", "upstream", "bugs", "mooncake-draft-kv-heads-per-rank")

# The bug report's Kimi-K3 numbers (its repro's helpers: 8 draft KV heads, head_dim 128, bf16,
# page 64, 16 MLA target layers, prefill TP4 rank 1) on the patched tree's real manager and
# _publish_peer_registration; KVArgs.draft_kv_source is what the patched _init_kv_manager fills,
# which runs first on a queue shell (FAKE backend) for a DFLASH and an EAGLE scheduler.
DRAFT_KV_REGISTRATION = r"""
import runpy, types
import torch
repro = runpy.run_path(sys.argv[1], run_name="kimi_k3_shape")
from sglang.srt.disaggregation.draft_kv_source import describe_draft_pool
from sglang.srt.runtime_context import get_context, get_parallel

get_context().override_server_args(speculative_algorithm="DFLASH").install()
H, PAGE = repro["H"], repro["PAGE"]

def init_kv_manager(algorithm):
    from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue
    from sglang.srt.disaggregation.utils import TransferBackend
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    def pool(heads, layers):
        return MHATokenToKVPool(size=256, page_size=PAGE, dtype=torch.bfloat16, head_num=heads,
                                head_dim=32, layer_num=layers, device="cpu",
                                enable_memory_saver=False)
    q = object.__new__(PrefillBootstrapQueue)
    q.token_to_kv_pool, q.draft_token_to_kv_pool = pool(2, 4), pool(2, 2)
    q.pp_rank, q.pp_size, q.tp_rank, q.is_mla_backend = 0, 1, 0, False
    q.transfer_backend = TransferBackend.FAKE
    q.metadata_buffers = types.SimpleNamespace(get_buf_infos=lambda: ([], [], []))
    ns = types.SimpleNamespace
    runner = ns(token_to_kv_pool=q.draft_token_to_kv_pool,
                model_config=ns(get_total_num_kv_heads=lambda: 8))
    q.scheduler = ns(
        rust_server=None, server_args=None,
        spec_algorithm=SpeculativeAlgorithm.from_string(algorithm),
        draft_worker=ns(weight_update_runners=lambda: [("draft", runner)]),
        tp_worker=ns(model_runner=ns(kv_cache_dtype_str="auto")),
        model_config=ns(num_hidden_layers=4, hf_text_config=ns(),
                        get_total_num_kv_heads=lambda: 2))
    with get_parallel().override(dp_rank=None):
        source = PrefillBootstrapQueue._init_kv_manager(q).kv_args.draft_kv_source
    return None if source is None else [source.shape.total_heads, source.shape.k_head_dim]

out = {"init_dflash": init_kv_manager("DFLASH"), "init_eagle": init_kv_manager("EAGLE")}
pool = repro["prefill_draft_pool"]()
targets = [torch.zeros(repro["POOL_PAGES"] * repro["MLA_ITEM"], dtype=torch.uint8)
           for _ in range(repro["NUM_TARGET_LAYERS"])]
m = repro["prefill_manager"](pool, targets)
m.kv_args.draft_kv_source = describe_draft_pool(pool, H)

def register(tp, rank):
    reg = repro["decode_registration"]()
    reg.mooncake_session_id, reg.dst_tp_rank, reg.dst_attn_tp_size = f"d{tp}:{rank}", rank, tp
    heads = max(1, H // tp)  # the oracle: QKVParallelLinear's heads per rank
    reg.dst_kv_item_lens = ([repro["MLA_ITEM"]] * repro["NUM_TARGET_LAYERS"]
                            + [PAGE * heads * 128 * 2] * repro["N_DRAFT"])
    refused = m._publish_peer_registration(reg.mooncake_session_id, reg)
    plan = getattr(reg, "dflash_draft_kv_plan", None)
    return {"refused": refused, "cached": m.state_layout_rejections.get(reg.mooncake_session_id),
            "plan": None if plan is None else plan.action.name}

out["tp32"], out["tp4"], out["tp8"] = register(32, 12), register(4, 1), register(8, 3)
print("RESULT " + json.dumps(out))
"""


def _at_pr(exported, pr):
    """The exported tree checked out at ``pr``'s commit while the block runs (the scratch
    repository in tmp; restored after), as ``verify_prefixes`` does."""
    import contextlib

    @contextlib.contextmanager
    def checkout():
        commit = next(r.commit for r in exported.report.prs if r.pr == pr)
        head = git(exported.tree, "rev-parse", "HEAD").strip()
        git(exported.tree, "checkout", "-q", commit)
        try:
            yield exported.tree
        finally:
            git(exported.tree, "checkout", "-q", head)

    return checkout()


def _no_plugin(out):
    assert out["from_tree"] and out["hooks"] == [] and out["plugin_modules"] == []
    return out["result"]


def test_pr_4_refuses_a_kimi_k3_draft_tp4_to_tp32_and_accepts_equal_heads(exported):
    assert "4" in [r.pr for r in exported.report.prs], exported.report.stop.message
    with _at_pr(exported, "4") as tree:
        res = _no_plugin(verify.run_on_tree(
            DRAFT_KV_REGISTRATION, tree, [os.path.join(HEADS_BUG, "repro.py")]
        ))
    assert res["init_dflash"] == [8, 32] and res["init_eagle"] is None
    # TP4 -> TP32: 2 draft heads per prefill rank, 1 per decode rank: stock corrupts, PR 4 refuses
    for tp in ("tp32", "tp8"):
        refused = res[tp]["refused"]
        assert refused and res[tp]["cached"] == refused and res[tp]["plan"] is None
        assert "attention TP (4, --tp-size)" in refused, refused
    assert "holds 2 draft KV heads per rank and the decode 1" in res["tp32"]["refused"]
    assert res["tp4"] == {"refused": None, "cached": None, "plan": "STOCK"}


def test_the_head_aware_bytes_through_mooncake_on_the_patched_tree(exported, tmp_path):
    """PR 5 onwards: test_draft_kv_loopback's transfer (the real Mooncake engine over TCP on
    127.0.0.1, two processes) with a prefill peer that imports sglang from the patched tree and
    refuses the plugin's code; the decode peer checks every byte of every decode rank's
    buffers, guards included, against the heads sglang's QKVParallelLinear gives that rank.
    PR 6: the TP4 -> TP32 ranks are sent from the prefill's pack staging (the staging builder
    of the patched _init_kv_manager, registered by the patched register_buffer_to_engine)."""
    assert {"5", "6"} <= {r.pr for r in exported.report.prs}, exported.report.stop.message
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import test_draft_kv_loopback as loopback

    env = verify.tree_env(exported.tree)
    env["PYTHONPATH"] = os.pathsep.join([loopback.HERE, env["PYTHONPATH"]])
    # PR 6's staging, sized by the switch rather than a 16k-token chunk: 4 slots of 4 MiB
    env["SGLANG_DFLASH_DRAFT_KV_PACK_BUFFER_MB"] = "16"
    decode = prefill = None
    try:
        decode = loopback.Peer("decode", str(tmp_path), timeout=120)
        prefill = loopback.Peer("prefill-tree", str(tmp_path), timeout=300, env=env)
        session = decode.read()["session"]
        ready = prefill.read()
        assert os.path.realpath(ready["sglang_file"]).startswith(os.path.realpath(exported.tree))
        assert ready["hooks"] == [] and ready["plugin_modules"] == []
        peers = (decode, prefill, session)
        big = loopback.run_case(peers, "tp4_to_tp32")  # 2 heads per prefill rank, 1 per decode
        small = loopback.run_case(peers, "tp2_to_tp1")  # two prefill ranks fill each decode row
        equal = loopback.run_case(peers, "tp4_to_tp4")
    finally:
        for peer in (prefill, decode):
            if peer is not None:
                peer.close()
    for res in (big, small, equal):
        state = res.pop("_plugin_state")
        assert state["hooks"] == [] and state["plugin_modules"] == []
        assert all(r["failures"] == [] for r in res.values()), res
    assert {r["action"] for r in big.values()} == {"head aware"} and len(big) == 8
    assert (small["0->0"]["action"], small["1->0"]["action"]) == ("head aware", "draft only")
    assert {r["action"] for r in equal.values()} == {"stock"}
    draft_bytes = 12 * len(loopback.DST_PAGES) * 64 * 128 * 2  # 12 entries, 1 head per row
    assert all(r["draft_bytes"] == draft_bytes for r in big.values())
    # PR 6: each TP32 rank's chunk packed (both head slices of prefill rank 1 in one launch)
    # and sent from the slab, one descriptor per destination page run: 4 target entries x 3
    # runs, then 12 draft entries x 3 runs (PR 5 alone: 12 x 5 pages x 64 token rows)
    for r in big.values():
        assert (r["packed_sends"], r["pack_launches"]) == (1, 1), big
        assert r["staging_registered"], big
        assert r["descriptors"] == 4 * 3 + 12 * 3, big
    # the other layouts are not packed: TP2 -> TP1 per token row, TP4 -> TP4 stock
    assert all(r["packed_sends"] == 0 == r["pack_launches"] for r in (*small.values(),
                                                                      *equal.values())), small
    assert small["1->0"]["descriptors"] == 12 * len(loopback.SRC_PAGES) * 64


# A plain-MHA target at another attention TP goes through send_kvcache_slice: prefill TP2 rank 0
# (target 2 of 4 KV heads, draft 4 of 8) -> decode TP4 rank 1 (target head 1, draft heads 2-3),
# real CPU pools, the real manager's _publish_peer_registration and send_kvcache_slice; the
# transfer engine is an in-process copy, so the decode images hold exactly what was written.
SLICE_SEND = r"""
import concurrent.futures, ctypes, threading
from collections import defaultdict
import numpy as np, torch
from sglang.srt.disaggregation.base.conn import KVArgs
from sglang.srt.disaggregation.draft_kv_source import describe_draft_pool
from sglang.srt.disaggregation.mooncake.conn import KVArgsRegisterInfo, MooncakeKVManager
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.runtime_context import get_context

get_context().override_server_args(speculative_algorithm="DFLASH").install()
PAGE, PAGES = 16, 8
ROWS = PAGES * PAGE + PAGE  # sglang's token slots
TARGET, DRAFT = (4, 32, 2), (8, 64, 3)  # total KV heads, head dim, layers
P_TP, P_RANK, D_TP, D_RANK = 2, 0, 4, 1
SRC, DST = [1, 2, 5], [3, 4, 0]

def heads(total, tp, rank):  # the oracle: tp divides total, one contiguous block per rank
    n = total // tp
    return range(rank * n, (rank + 1) * n)

def global_kv(seed, total, dim):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(ROWS, total, dim, generator=g).to(torch.bfloat16)

def pool(spec, seed):
    total, dim, layers = spec
    h = heads(total, P_TP, P_RANK)
    p = MHATokenToKVPool(size=PAGES * PAGE, page_size=PAGE, dtype=torch.bfloat16,
                         head_num=len(h), head_dim=dim, layer_num=layers, device="cpu",
                         enable_memory_saver=False)
    for q, buf in enumerate(list(p.k_buffer) + list(p.v_buffer)):
        buf.copy_(global_kv(seed + q, total, dim)[:, h.start : h.stop])
    return p

target, draft = pool(TARGET, 100), pool(DRAFT, 200)
(t_ptrs, t_lens, t_items), (d_ptrs, d_lens, d_items) = (
    target.get_contiguous_buf_infos(), draft.get_contiguous_buf_infos())
kv_args = KVArgs()
kv_args.engine_rank, kv_args.page_size, kv_args.pp_rank = P_RANK, PAGE, 0
kv_args.kv_data_ptrs = list(t_ptrs) + list(d_ptrs)
kv_args.kv_data_lens = list(t_lens) + list(d_lens)
kv_args.kv_item_lens, kv_args.kv_layer_ids = list(t_items) + list(d_items), []  # PP1: no ids
kv_args.num_draft_entries = len(d_ptrs)
kv_args.kv_head_num, kv_args.total_kv_head_num = TARGET[0] // P_TP, TARGET[0]
kv_args.aux_data_ptrs, kv_args.aux_data_lens, kv_args.aux_item_lens = [], [], []
kv_args.state_types, kv_args.state_data_ptrs, kv_args.state_data_lens = [], [], []
kv_args.state_item_lens, kv_args.state_layer_ids = [], []
kv_args.mla_compression_ratios, kv_args.prefill_start_layer = None, 0
kv_args.draft_kv_source = describe_draft_pool(draft, DRAFT[0])  # what _init_kv_manager fills

images, stray = [], []
class CopyEngine:  # the transfer: an in-process copy into the decode images, nothing outside
    def batch_transfer_sync(self, session, srcs, dsts, lens):
        for s, d, n in zip(srcs, dsts, lens):
            if any(a <= d and d + n <= a + img.nbytes for a, img in images):
                ctypes.memmove(d, s, n)
            else:
                stray.append((d, n))
        return 0

m = object.__new__(MooncakeKVManager)
m.kv_args, m.disaggregation_mode = kv_args, DisaggregationMode.PREFILL
m.is_mla_backend = m.is_hybrid_mla_backend = False
m.attn_tp_size, m.attn_tp_rank, m.state_tp_size = P_TP, P_RANK, P_TP
m.attn_cp_size, m.attn_cp_rank, m.pp_size, m.pp_rank = 1, 0, 1, 0
m.engine = CopyEngine()
m.decode_kv_args_table, m.transfer_infos, m.request_status = {}, {}, {}
m.session_lock = threading.Lock()
m.state_layout_rejections, m.state_strides_validated = {}, set()
m.failed_sessions, m.session_failures, m.failed_session_probes = set(), defaultdict(int), {}
m.max_transfer_batch_indices, m.enable_custom_mem_pool, m.custom_mem_pool_type = 0, False, None
m.enable_trace = m.enable_staging = m.enable_deferred_decode_kv_release = False
m.transfer_queues, m._dcp_pack_buffers, m.bootstrap_port = [None], None, 0

specs = [TARGET] * (2 * TARGET[2]) + [DRAFT] * (2 * DRAFT[2])
row_bytes = [len(heads(t, D_TP, D_RANK)) * dim * 2 for t, dim, _ in specs]
for rb in row_bytes:
    img = np.zeros(ROWS * rb, np.uint8)
    images.append((img.ctypes.data, img))
reg = KVArgsRegisterInfo(
    room="None", endpoint="127.0.0.1", dst_port=1, mooncake_session_id="d4:1",
    dst_kv_ptrs=[a for a, _ in images], dst_aux_ptrs=[], dst_state_data_ptrs=[],
    dst_tp_rank=D_RANK, dst_attn_tp_size=D_TP, dst_kv_item_len=PAGE * row_bytes[0],
    dst_state_item_lens=[], dst_state_dim_per_tensor=[], dst_kv_layer_ids=[],
    dst_state_layer_ids=[], dst_kv_item_lens=[PAGE * rb for rb in row_bytes])
out = {"refused": m._publish_peer_registration(reg.mooncake_session_id, reg)}
plan = getattr(reg, "dflash_draft_kv_plan", None)
out["plan"] = None if plan is None else plan.action.name
with concurrent.futures.ThreadPoolExecutor(2) as ex:
    out["ret"] = m.send_kvcache_slice(
        reg.mooncake_session_id, np.asarray(SRC, np.int32), reg.dst_kv_ptrs,
        np.asarray(DST, np.int32), D_RANK, D_TP, reg.dst_kv_item_len, ex, reg.dst_kv_layer_ids)
wrong = []
for q, ((total, dim, layers), (_, img), rb) in enumerate(zip(specs, images, row_bytes)):
    seed = 100 + q if q < 2 * TARGET[2] else 200 + q - 2 * TARGET[2]
    h = heads(total, D_TP, D_RANK)
    want = np.zeros_like(img).reshape(ROWS, rb)
    full = global_kv(seed, total, dim)[:, h.start : h.stop].contiguous()
    full = full.view(torch.uint8).reshape(ROWS, rb).numpy()
    for s, d in zip(SRC, DST):
        want[d * PAGE : (d + 1) * PAGE] = full[s * PAGE : (s + 1) * PAGE]
    if not np.array_equal(img.reshape(ROWS, rb), want):
        wrong.append(q)
out["wrong_entries"], out["stray_writes"] = wrong, len(stray)

# A local failure of the draft send (a prefill page id past the pool) fails that room, not the
# decode's session: transfer_worker passes the room, and the send returns 0 without sending
# the rest of the room.
from sglang.srt.disaggregation.base.conn import KVPoll
failures = []
def conclude_failure(**kw):
    failures.append(kw)
    m.request_status[kw["bootstrap_room"]] = KVPoll.Failed
m.conclude_failure, m.request_status[7] = conclude_failure, KVPoll.Transferring
moved = len(stray), [img.copy() for _, img in images]
with concurrent.futures.ThreadPoolExecutor(2) as ex:
    ret = m.send_kvcache_slice(
        reg.mooncake_session_id, np.asarray([1, 999, 5], np.int32), reg.dst_kv_ptrs,
        np.asarray(DST, np.int32), D_RANK, D_TP, reg.dst_kv_item_len, ex, reg.dst_kv_layer_ids,
        room=7)
out["local_failure"] = {
    "ret": ret, "rooms": [f["bootstrap_room"] for f in failures],
    "reason": failures[0]["failure_reason"] if failures else None,
    "status_failed": m.request_status[7] == KVPoll.Failed,
    "failed_sessions": sorted(m.failed_sessions), "session_failures": dict(m.session_failures),
    "nothing_sent": len(stray) == moved[0] and all(
        np.array_equal(img, before) for (_, img), before in zip(images, moved[1]))}
print("RESULT " + json.dumps(out))
"""


def test_pr_7_slices_the_draft_by_its_own_plan_for_a_plain_mha_target(exported):
    """PR 7 on the patched tree, without the plugin. While PR 6 is unfinished the series stops
    before it, so PR 7's edits are applied to the tree's working copy here (restored after)."""
    from sglang_dflash_pp.tools.export_patches import generator as gen
    from sglang_dflash_pp.tools.export_patches import stack_mooncake

    done = [r.pr for r in exported.report.prs]
    assert "5" in done, exported.report.stop.message
    applied = "7" not in done
    if applied:
        tree = gen.Tree(exported.tree)
        changes, _ = gen.plan_pr(stack_mooncake.PR_7, "PR 7", tree, {})
        tree.write(changes)
    try:
        res = _no_plugin(verify.run_on_tree(SLICE_SEND, exported.tree))
    finally:
        if applied:
            git(exported.tree, "checkout", "-q", "--", ".")
    local = res.pop("local_failure")
    assert res == {"refused": None, "plan": "HEAD_AWARE", "ret": 0, "wrong_entries": [],
                   "stray_writes": 0}, res
    # rule 10 in-tree: the room fails with the reason, the healthy decode is not blacklisted
    assert local["ret"] == 0 and local["rooms"] == [7] and local["status_failed"], local
    assert "room 7 to decode d4:1" in local["reason"] and "999" in local["reason"], local
    assert local["failed_sessions"] == [] and local["session_failures"] == {}, local
    assert local["nothing_sent"], local
