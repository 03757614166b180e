"""``sglang-dflash-pp export-patches``: the change as an in-tree patch series on sglang 0.5.23.

The generator runs once per session on a copy of the installed wheel's ``sglang/`` package (a
scratch git repository is made there) and the tests read what it did:

* one commit per finished PR, in the stack's order, titled and described from
  ``docs/upstream/README.md``; the export stops before the first unfinished PR, naming it;
* ``git format-patch`` of the commits is the series: applied to the base it gives the same tree;
* the report's line counts are git's;
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
import os
import re
import shutil
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

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


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The generator on a copy of the installed sglang (bytecode kept: copy2 keeps mtimes)."""
    root = tmp_path_factory.mktemp("export")
    tree = os.path.join(root, "tree", "sglang")
    shutil.copytree(INSTALLED, tree, symlinks=True)
    out = os.path.join(root, "series")
    log = []
    report = generator.export(tree, out, log=log.append)
    return SimpleNamespace(tree=tree, out=out, report=report, log="\n".join(log))


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
    stop = exported.report.stop
    nxt = list(rows)[len(expected)]
    assert stop.kind == "unfinished" and stop.pr == nxt
    assert f"stopped before PR {nxt}" in exported.log
    assert stack.REGISTRY[nxt].unfinished in stop.message
    assert len(exported.report.patches) == len(expected)
    for name, pr in zip(sorted(exported.report.patches), expected):
        with open(os.path.join(exported.out, name)) as f:
            text = f.read()
        subject = " ".join(re.search(r"^Subject: (.*(?:\n .*)*)", text, re.M).group(1).split())
        assert subject.endswith(rows[pr].title)
        assert "diff --git a/python/sglang/" in text  # sglang's repository layout
    assert os.path.isfile(os.path.join(exported.out, "report.json"))


def test_the_patches_rebuild_the_patched_tree_from_the_base(exported, tmp_path):
    env = dict(os.environ, GIT_INDEX_FILE=str(tmp_path / "index"))
    git(exported.tree, "read-tree", exported.report.base, env=env)
    patches = [os.path.join(exported.out, p) for p in sorted(exported.report.patches)]
    git(exported.tree, "apply", "--cached", "-p3", *patches, env=env)  # a/python/sglang/...
    rebuilt = git(exported.tree, "write-tree", env=env)
    assert rebuilt == git(exported.tree, "rev-parse", "HEAD^{tree}")
    assert git(exported.tree, "status", "--porcelain", "--untracked-files=no") == ""


def test_the_report_counts_what_git_counts_and_each_pr_touches_its_files(exported):
    for r in exported.report.prs:
        numstat = git(exported.tree, "diff", "--numstat", f"{r.commit}^", r.commit)
        git_counts = {}
        for line in numstat.splitlines():
            a, d, path = line.split("\t")
            git_counts["python/sglang/" + path] = (int(a), int(d))
        assert {f.path: (f.added, f.removed) for f in r.files} == git_counts
        pr = stack.REGISTRY[r.pr]
        declared = {"python/sglang/" + e.file for e in pr.edits} | {
            "python/sglang/" + m.file for m in pr.new_modules
        }
        assert set(git_counts) == declared
        new = {"python/sglang/" + m.file for m in pr.new_modules}
        assert {f.path for f in r.files if f.new} == new
        a, d, n = r.upstream
        assert f"= upstream code +{a} -{d} in {n} file(s)" in exported.log
        assert a + d > 0 and a <= 50  # a few lines of ours per upstream function


def test_every_prefix_imports_its_touched_modules_without_the_plugin(exported):
    checks = verify.verify_prefixes(exported.tree, exported.report.prs, log=lambda s: None)
    assert [c.pr for c in checks] == finished_prefix()
    for c in checks:
        assert c.errors == {}, c.errors
        assert os.path.realpath(c.sglang_file).startswith(os.path.realpath(exported.tree))
        assert c.hooks == [] and c.plugin_modules == []
        assert c.ok
    assert "sglang.srt.disaggregation.kv_write_fence" in checks[-1].modules
    assert git(exported.tree, "rev-parse", "HEAD").strip() == exported.report.prs[-1].commit


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
    """A tiny stand-in tree (our own text): PR 1's and PR 2's symbols, anchors as requested."""
    pkg = os.path.join(root, "sglang")
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
    assert not os.path.exists(os.path.join(pkg, ".git"))
    after = {p: open(os.path.join(d, p)).read() for d, _, fs in os.walk(pkg) for p in fs}
    assert after == before


def test_a_dirty_tree_is_refused(tmp_path, capsys):
    pkg = fake_tree(tmp_path)
    git(pkg, "init", "-q")
    git(pkg, "add", "-A")
    git(pkg, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "base")
    with open(os.path.join(pkg, "__init__.py"), "w") as f:
        f.write("x = 1\n")
    assert cli.main(["export-patches", "--sglang-src", pkg, "--out", str(tmp_path / "o")]) == 2
    assert "uncommitted changes" in capsys.readouterr().out


# -- the registry ----------------------------------------------------------------------------


def test_the_registry_covers_the_stack_and_finished_prs_are_a_prefix():
    rows = list(read_stack(default_stack_doc()))
    assert set(rows) == set(stack.REGISTRY)
    finished = [p for p in rows if stack.REGISTRY[p].finished]
    # a finished PR after an unfinished one would never be exported
    assert finished == rows[: len(finished)]
    for p in rows[len(finished):]:
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


def test_widen_condition_breaks_a_parenthesised_condition_one_operand_per_line():
    code = "def f(a):\n    ok = (\n        a.x or a.y or a.z\n    )\n"
    out = apply(ce.WidenCondition("f.py", "f", condition="a.x or a.y or a.z", extra="a.w"), code)
    lines = ["def f(a):", "    ok = (", "        a.x", "        or a.y", "        or a.z",
             "        or a.w", "    )"]
    assert out == "\n".join(lines) + "\n"


def test_add_import_merges_or_places_in_order():
    out = apply(ce.AddImport("f.py", module="pkg.a", names=("Alpha",)))
    assert "from pkg.a import Alpha, alpha\nfrom pkg.b import beta\n" in out
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


def test_cli_lists_export_patches():
    parser = cli.build_parser()
    assert "export-patches" in parser.format_help()
