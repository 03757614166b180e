"""Check a series on the patched tree itself: every prefix imports, the bug-fix PRs fix their bug.

Each check runs in a subprocess that imports ``sglang`` from the tree (its parent directory first
on ``sys.path``, the tree's package directory must be named ``sglang``) and never our plugin:

* ``SGLANG_PLUGINS`` names only an entry point no plugin has. Unset or empty is not enough:
  ``sglang.srt.plugins.load_plugins_by_group`` treats an empty whitelist as none and then loads
  every installed ``sglang.srt.plugins`` entry point, ours (``dflash_pp``) included;
* an import hook refuses every ``sglang_dflash_pp`` module, so in-tree code that still imported
  the plugin fails the check instead of quietly using it;
* the subprocess then calls ``load_plugins()`` as a server process does and reports every
  registered hook and every imported module of ours (both must be empty), and where ``sglang``
  came from (must be the tree).

:func:`run_moved_tests` runs the tests the series moved in-tree (``test/registered/``) the same
way: ``pytest`` in a subprocess on the patched tree, a pytest plugin of its own installing the
import hook and reporting each test's outcome and the plugin state at the end.

Bytecode goes to the tree's ``__pycache__`` (ignored by sglang's ``.gitignore``, and by the
scratch repository the generator makes), or to ``cache_dir`` (``PYTHONPYCACHEPREFIX``) when given.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

from sglang_dflash_pp.tools.export_patches.errors import ExportError
from sglang_dflash_pp.tools.export_patches.git_repo import ScratchRepo
from sglang_dflash_pp.tools.export_patches.import_server import ImportServer, server_env
from sglang_dflash_pp.tools.export_patches.import_server import available as forks

NO_PLUGIN = "stock-sglang-only"  # the entry-point whitelist: a name no plugin uses

_PRELUDE = r"""
import importlib, importlib.abc, json, os, sys, traceback

class _RefusePlugin(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "sglang_dflash_pp" or name.startswith("sglang_dflash_pp."):
            raise ImportError(name + " is imported: the patched tree must not need the plugin")
        return None

sys.meta_path.insert(0, _RefusePlugin())

def _plugin_state():
    from sglang.srt.plugins import load_plugins
    from sglang.srt.plugins.hook_registry import HookRegistry

    load_plugins()
    import sglang
    return {
        "sglang_file": sglang.__file__,
        "hooks": sorted(HookRegistry._hooks),
        "plugin_modules": sorted(m for m in sys.modules if m.startswith("sglang_dflash_pp")),
    }
"""

_IMPORT = _PRELUDE + r"""
errors = {}
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except BaseException:
        errors[name] = traceback.format_exc(limit=-4)
state = _plugin_state()
print("IMPORT_CHECK " + json.dumps({"errors": errors, **state}))
"""

_REPRO = _PRELUDE + r"""
import runpy
script = sys.argv[1]
sys.argv = [script]
runpy.run_path(script, run_name="__main__")
print("PLUGIN_STATE " + json.dumps(_plugin_state()))
"""


def tree_env(package_dir: str, cache_dir: Optional[str] = None) -> Dict[str, str]:
    if os.path.basename(os.path.normpath(package_dir)) != "sglang":
        raise ExportError(
            f"{package_dir} cannot be imported as sglang: its directory is not named sglang"
        )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.dirname(os.path.normpath(package_dir))
    env["SGLANG_PLUGINS"] = NO_PLUGIN
    if cache_dir is not None:
        env["PYTHONPYCACHEPREFIX"] = cache_dir
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def _run(code: str, args: Sequence[str], env, timeout: float):
    return subprocess.run(
        [sys.executable, "-c", code, *args], env=env, capture_output=True, text=True,
        timeout=timeout, cwd=tempfile.gettempdir(),
    )


def _tagged(stdout: str, tag: str) -> Optional[dict]:
    for line in stdout.splitlines():
        if line.startswith(tag + " "):
            return json.loads(line[len(tag) + 1 :])
    return None


def _from_tree(state: dict, package_dir: str) -> bool:
    return os.path.realpath(state.get("sglang_file", "")).startswith(
        os.path.realpath(package_dir) + os.sep
    )


@dataclass
class ImportCheck:
    pr: str
    commit: str
    modules: List[str]
    errors: Dict[str, str] = field(default_factory=dict)
    sglang_file: str = ""
    hooks: List[str] = field(default_factory=list)
    plugin_modules: List[str] = field(default_factory=list)
    from_tree: bool = False

    @property
    def ok(self) -> bool:
        return self.from_tree and not (self.errors or self.hooks or self.plugin_modules)


def import_modules(package_dir: str, modules: Sequence[str], cache_dir: Optional[str] = None,
                   timeout: float = 600, server: Optional[ImportServer] = None) -> dict:
    """Import ``modules`` from the tree at ``package_dir`` without our plugin: in a cold
    subprocess, or in a child of ``server`` (``import_server``: the same check, without
    re-importing sglang's third-party dependencies)."""
    env = tree_env(package_dir, cache_dir)
    if server is not None:
        state = server.check(env["PYTHONPATH"], modules, env, timeout)
    else:
        r = _run(_IMPORT, modules, env, timeout)
        state = _tagged(r.stdout, "IMPORT_CHECK")
        if state is None:
            raise ExportError(
                f"the import check did not finish (exit {r.returncode}):\n{r.stderr[-3000:]}"
            )
    state["from_tree"] = _from_tree(state, package_dir)
    return state


def verify_prefixes(package_dir: str, prs: Sequence, cache_dir: Optional[str] = None,
                    log=print, workers: int = 2) -> List[ImportCheck]:
    """Check out each commit of the series and import every module the PRs up to it touched;
    the repository is left where it was. The prefixes are spread over ``workers`` checkouts (the
    repository and detached worktrees of it, removed after), each with an import server
    (``import_server``: one cold import, then a forked child per prefix) where it can fork."""
    repo = ScratchRepo(package_dir)
    rel = os.path.relpath(package_dir, repo.root)
    ref = subprocess.run(
        ["git", "symbolic-ref", "-q", "--short", "HEAD"], cwd=repo.root, capture_output=True,
        text=True,
    ).stdout.strip() or repo.head()
    prefixes, modules = [], []
    for r in prs:
        modules += [m for m in r.modules if m not in modules]
        prefixes.append((r, list(modules)))
    workers = max(1, min(workers, len(prefixes)))
    checks: Dict[int, ImportCheck] = {}
    with tempfile.TemporaryDirectory(prefix="export-patches-prefixes-") as tmp:
        roots = [repo.root]
        try:
            for k in range(1, workers):
                root = os.path.join(tmp, str(k), os.path.basename(os.path.normpath(repo.root)))
                repo.git("worktree", "add", "-q", "--detach", root, prefixes[k][0].commit)
                roots.append(root)

            def run(k: int) -> None:
                root = roots[k]
                server = ImportServer(_PRELUDE, server_env()) if forks() else None
                try:
                    for idx in range(k, len(prefixes), workers):
                        r, mods = prefixes[idx]
                        subprocess.run(["git", "checkout", "-q", r.commit], cwd=root, check=True,
                                       capture_output=True)  # fmt: skip
                        state = import_modules(os.path.join(root, rel), mods, cache_dir,
                                               server=server)  # fmt: skip
                        checks[idx] = ImportCheck(r.pr, r.commit, list(mods), **state)
                finally:
                    if server is not None:
                        server.close()

            with ThreadPoolExecutor(workers) as pool:
                for f in [pool.submit(run, k) for k in range(workers)]:
                    f.result()
        finally:
            repo.git("checkout", "-q", ref)
            for root in roots[1:]:
                repo.git("worktree", "remove", "--force", root)
    out = [checks[i] for i in range(len(prefixes))]
    for check in out:
        log(f"prefix up to PR {check.pr}: {'imports' if check.ok else 'FAILS'} "
            f"({len(check.modules)} modules)")
        for name, tb in check.errors.items():
            log(f"  {name}:\n{tb}")
    return out


# A pytest plugin (written to a temporary directory, named with -p): the import hook, each
# collected test and its outcome, and the plugin state when the session ends.
_PYTEST_PLUGIN = _PRELUDE + r"""
_out = {"collected": [], "outcomes": {}}

def pytest_collection_finish(session):
    _out["collected"] = [item.nodeid for item in session.items]

def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":
        _out["outcomes"].setdefault(report.nodeid, report.outcome)

def pytest_sessionfinish(session, exitstatus):
    _out.update(_plugin_state())
    with open(os.environ["EXPORT_PATCHES_TEST_RESULT"], "w") as f:
        json.dump(_out, f)
"""


@dataclass
class MovedTestRun:
    returncode: int
    collected: List[str]  # node ids, relative to the root: test/registered/...::test_x[...]
    outcomes: Dict[str, str]  # node id -> passed | failed | skipped
    sglang_file: str
    hooks: List[str]
    plugin_modules: List[str]
    from_tree: bool
    output: str

    @property
    def passed(self) -> List[str]:
        return [n for n in self.collected if self.outcomes.get(n) == "passed"]

    def by_file(self) -> Dict[str, List[str]]:
        """The collected tests per file, parametrized cases counted once (``test_x``,
        ``Class::test_x``): what to compare with the tests the generator moved."""
        out: Dict[str, List[str]] = {}
        for node in self.collected:
            path, name = node.split("::", 1)
            name = name.split("[", 1)[0]
            if name not in out.setdefault(path, []):
                out[path].append(name)
        return out

    @property
    def ok(self) -> bool:
        clean = self.from_tree and not self.hooks and not self.plugin_modules
        return clean and self.returncode == 0 and len(self.passed) == len(self.collected) > 0


def run_moved_tests(root: str, paths: Sequence[str] = ("test/registered",),
                    cache_dir: Optional[str] = None, timeout: float = 600) -> MovedTestRun:
    """``pytest`` over ``paths`` (relative to the root) on the patched tree, without the plugin.
    Run from a temporary directory (hypothesis keeps its database in the working directory),
    with the root as pytest's rootdir and no cache written to the tree."""
    package_dir = os.path.join(root, *"python/sglang".split("/"))
    env = tree_env(package_dir, cache_dir)
    with tempfile.TemporaryDirectory(prefix="export-patches-tests-") as tmp:
        with open(os.path.join(tmp, "export_patches_no_plugin.py"), "w") as f:
            f.write(_PYTEST_PLUGIN)
        result = os.path.join(tmp, "result.json")
        env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], tmp])
        env["EXPORT_PATCHES_TEST_RESULT"] = result
        r = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "export_patches_no_plugin",
             "-p", "no:cacheprovider", "-p", "no:warnings", "--rootdir", root, "-c", os.devnull,
             *[os.path.join(root, p) for p in paths]],
            env=env, capture_output=True, text=True, timeout=timeout, cwd=tmp,
        )
        if not os.path.isfile(result):
            raise ExportError(
                f"pytest on the patched tree did not finish (exit {r.returncode}):\n"
                f"{(r.stdout + r.stderr)[-3000:]}"
            )
        with open(result) as f:
            out = json.load(f)
    return MovedTestRun(
        returncode=r.returncode, collected=out["collected"], outcomes=out["outcomes"],
        sglang_file=out["sglang_file"], hooks=out["hooks"],
        plugin_modules=out["plugin_modules"], from_tree=_from_tree(out, package_dir),
        output=(r.stdout + r.stderr)[-6000:],
    )


def docs_bug_dir() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(here))))
    return os.path.join(repo, "docs", "upstream", "bugs")


def run_repro(bug: str, package_dir: str, cache_dir: Optional[str] = None,
              timeout: float = 600) -> dict:
    """``docs/upstream/bugs/<bug>/repro.py`` on the patched tree, in its stock mode."""
    script = os.path.join(docs_bug_dir(), bug, "repro.py")
    if not os.path.isfile(script):
        raise ExportError(f"no reproduction {script}")
    r = _run(_REPRO, [script], tree_env(package_dir, cache_dir), timeout)
    result = _tagged(r.stdout, "RESULT")
    state = _tagged(r.stdout, "PLUGIN_STATE")
    if result is None or state is None:
        raise ExportError(
            f"{bug}/repro.py did not finish (exit {r.returncode}):\n{r.stderr[-3000:]}"
        )
    state["from_tree"] = _from_tree(state, package_dir)
    return {"result": result, **state, "stdout": r.stdout}


def run_on_tree(code: str, package_dir: str, args: Sequence[str] = (),
                cache_dir: Optional[str] = None, timeout: float = 600) -> dict:
    """Our ``code`` on the patched tree, without the plugin (the import hook of every check
    refuses it): what it printed as ``RESULT {json}``, and the plugin state after it."""
    script = _PRELUDE + code + '\nprint("PLUGIN_STATE " + json.dumps(_plugin_state()))\n'
    r = _run(script, args, tree_env(package_dir, cache_dir), timeout)
    result = _tagged(r.stdout, "RESULT")
    state = _tagged(r.stdout, "PLUGIN_STATE")
    if result is None or state is None:
        raise ExportError(f"the script did not finish (exit {r.returncode}):\n{r.stderr[-3000:]}")
    state["from_tree"] = _from_tree(state, package_dir)
    return {"result": result, **state, "stdout": r.stdout}
