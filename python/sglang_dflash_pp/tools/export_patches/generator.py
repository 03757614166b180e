"""Apply the PR stack to an sglang tree, one commit per PR, and write the series.

:func:`export` commits each finished PR of ``docs/upstream/README.md``, in the stack's order,
with the PR's title and description, then writes ``git format-patch`` of those commits and a
``report.json`` to the output directory. It stops like ``git am``: at the first PR whose edit
cannot be applied (the PR, the file, the symbol and what was not found), or at the first PR the
registry declares unfinished. A PR is planned completely in memory before a byte is written, so
the tree is always at the last finished PR's commit.

The tree is laid out as sglang's repository (``python/sglang/...``, and ``test/registered/...``
for the tests that move with the PRs); every path here is relative to its root.

:func:`check` applies the same edits in memory only, past failures, and says per PR whether it
applies as it is and which anchors are missing: the report against another sglang release.
"""

from __future__ import annotations

import json
import os
import textwrap
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

from sglang_dflash_pp import REQUIRED_SGLANG_VERSION
from sglang_dflash_pp.tools.export_patches.errors import (
    AnchorError,
    EditFailed,
    ExportError,
)
from sglang_dflash_pp.tools.export_patches.git_repo import (
    TRAILER,
    UPSTREAM_PACKAGE_PATH,
    ScratchRepo,
    find_tree,
    tree_version,
)
from sglang_dflash_pp.tools.export_patches.stack import PR, REGISTRY
from sglang_dflash_pp.tools.export_patches.stack_doc import (
    StackRow,
    default_stack_doc,
    read_stack,
)

Log = Callable[[str], None]


def _upstream(path: str) -> str:
    return f"{UPSTREAM_PACKAGE_PATH}/{path}"


@dataclass
class FileChange:
    path: str  # relative to the repository root: python/sglang/..., test/registered/...
    before: Optional[str]  # None: a new file
    after: str
    edits: List[str] = field(default_factory=list)  # "Symbol: what", one per edit
    tests: Tuple[str, ...] = ()  # a moved test file: the tests it holds


class Tree:
    """The tree's files as the PRs so far left them (in memory over the directory), by path
    relative to its root."""

    def __init__(self, root: str):
        self.root = root
        self.overlay: Dict[str, str] = {}

    def read(self, path: str) -> Optional[str]:
        if path in self.overlay:
            return self.overlay[path]
        full = os.path.join(self.root, path)
        if not os.path.isfile(full):
            return None
        with open(full) as f:
            return f.read()

    def write(self, changes: List[FileChange]) -> None:
        for c in changes:
            full = os.path.join(self.root, c.path)
            os.makedirs(os.path.dirname(full), exist_ok=True)
            with open(full, "w") as f:
                f.write(c.after)


def registry_entry(number: str) -> PR:
    return REGISTRY.get(number) or PR(number, unfinished="no in-tree edits are registered for it")


def plan_pr(
    pr: PR, title: str, tree: Tree, moved: Dict[str, str], keep_going: bool = False
) -> Tuple[List[FileChange], List[EditFailed]]:
    """Every file this PR changes, computed in memory; with ``keep_going`` the failures are
    collected (and the edits that apply still applied), else the first one is raised."""
    import libcst as cst

    failures: List[EditFailed] = []

    def fail(path: str, symbol: str, detail: str) -> None:
        err = EditFailed(pr.number, title, path, symbol, detail)
        if not keep_going:
            raise err
        failures.append(err)

    moved = dict(moved)
    for m in pr.new_modules:
        moved[m.source] = m.module
    changes: Dict[str, FileChange] = {}
    for m in pr.new_modules:
        path = _upstream(m.file)
        if tree.read(path) is not None:
            fail(path, m.symbol, "the new file exists already in the tree")
            continue
        try:
            text = m.render(moved)
        except AnchorError as e:
            fail(path, m.symbol, str(e))
            continue
        changes[path] = FileChange(path, None, text, [m.describe()])
    for t in pr.tests:
        if tree.read(t.target) is not None:
            fail(t.target, t.symbol, "the new file exists already in the tree")
            continue
        try:
            text, names = t.render(moved)
        except AnchorError as e:
            fail(t.target, t.symbol, str(e))
            continue
        changes[t.target] = FileChange(t.target, None, text, [t.describe()], names)
    modules: Dict[str, "cst.Module"] = {}
    missing = set()
    for edit in pr.edits:
        path = _upstream(edit.file)
        if path in missing:
            continue
        if path not in modules:
            text = tree.read(path)
            if text is None:
                missing.add(path)
                fail(path, edit.symbol or "<module>", "no such file in the tree (moved?)")
                continue
            try:
                modules[path] = cst.parse_module(text)
            except cst.ParserSyntaxError as e:
                missing.add(path)
                fail(path, "<module>", f"libcst cannot parse it: {e}")
                continue
            changes[path] = FileChange(path, text, text)
        try:
            new = edit.apply(modules[path])
        except AnchorError as e:
            fail(path, edit.symbol or "<module>", str(e))
            continue
        if new.code == modules[path].code:
            fail(path, edit.symbol or "<module>",
                 f"the edit changes nothing ({edit.describe()})")
            continue
        modules[path] = new
        changes[path].after = new.code
        changes[path].edits.append(f"{edit.symbol or 'imports'}: {edit.describe()}")
    return [c for c in changes.values() if c.after != c.before], failures


def commit_message(pr: PR, row: StackRow, changes: List[FileChange]) -> str:
    parts = [row.title, row.description()]
    if pr.note:
        parts.append(textwrap.fill(pr.note, width=72, break_on_hyphens=False))
    lines = ["In-tree edits (generated):"]
    for c in changes:
        if c.tests:
            continue
        head = f"- {'new ' if c.before is None else ''}{c.path}"
        lines.append(head)
        for e in c.edits:
            lines.append(textwrap.fill(e, width=72, initial_indent="    ",
                                       subsequent_indent="      ", break_on_hyphens=False))
    parts.append("\n".join(lines))
    moved = {t.target: t for t in pr.tests}
    if moved:
        lines = ["Tests moved with it (generated; CPU unit tests registered for CPU CI):"]
        for c in changes:
            if not c.tests:
                continue
            t = moved[c.path]
            lines.append(f"- new {c.path}")
            lines.append(f"  from sglang-dflash-pp {t.source}:")
            lines += [f"    {name}" for name in c.tests]
            left = [n for n in t.drop if n.startswith("test")]
            if left:
                lines.append(textwrap.fill(
                    f"({len(left)} more test(s) of that file stay in sglang-dflash-pp: they "
                    "test its plugin or need its test helpers)",
                    width=72, initial_indent="  ", subsequent_indent="  "))
        parts.append("\n".join(lines))
    parts.append(
        textwrap.fill(
            f"PR {row.pr} of the stack in sglang-dflash-pp docs/upstream/README.md, "
            f'group "{row.group}".',
            width=72,
        )
        + "\n"
        + TRAILER
    )
    return "\n\n".join(parts) + "\n"


@dataclass
class FileStat:
    path: str  # python/sglang/..., test/registered/...
    added: int
    removed: int
    new: bool

    @property
    def test(self) -> bool:
        return _is_test(self.path)


def _is_test(path: str) -> bool:
    return not path.startswith(UPSTREAM_PACKAGE_PATH + "/")


@dataclass
class PRResult:
    pr: str
    title: str
    commit: Optional[str]
    files: List[FileStat]
    edits: Dict[str, List[str]]  # path -> edit lines
    modules: List[str]  # in-tree modules the PR touches
    tests: Dict[str, List[str]] = field(default_factory=dict)  # moved test file -> its tests

    @property
    def upstream(self) -> Tuple[int, int, int]:
        fs = [f for f in self.files if not f.new and not f.test]
        return sum(f.added for f in fs), sum(f.removed for f in fs), len(fs)

    @property
    def new(self) -> Tuple[int, int]:
        fs = [f for f in self.files if f.new and not f.test]
        return sum(f.added for f in fs), len(fs)

    @property
    def moved_tests(self) -> Tuple[int, int, int]:
        """Lines added, files, tests (functions) of the moved tests."""
        fs = [f for f in self.files if f.test]
        return sum(f.added for f in fs), len(fs), sum(len(t) for t in self.tests.values())


@dataclass
class Stop:
    pr: str
    title: str
    kind: str  # "unfinished" | "failed" | "upto" | "end"
    message: str


@dataclass
class ExportReport:
    sglang_tree: str  # the package directory: <root>/python/sglang
    root: str  # the repository root
    sglang_version: Optional[str]
    base: Optional[str]
    prs: List[PRResult]
    stop: Stop
    patches: List[str]
    out: Optional[str]

    def to_json(self) -> dict:
        d = asdict(self)
        for p, r in zip(d["prs"], self.prs):
            a, rm, n = r.upstream
            p["upstream_lines"] = {"added": a, "removed": rm, "files": n}
            na, nn = r.new
            p["new_lines"] = {"added": na, "files": nn}
            ta, tf, tn = r.moved_tests
            p["test_lines"] = {"added": ta, "files": tf, "tests": tn}
        return d

    @property
    def moved_tests(self) -> Dict[str, List[str]]:
        """Every test file the series moved in-tree (root-relative) and its tests."""
        return {path: names for r in self.prs for path, names in r.tests.items()}


def render_pr(r: PRResult) -> str:
    lines = [f"{r.title}" + (f"  [{r.commit[:12]}]" if r.commit else "")]
    width = max((len(f.path) for f in r.files), default=0)
    for f in r.files:
        kind = "test    " if f.test else "new     " if f.new else "upstream"
        counts = f"+{f.added}" if f.new else f"+{f.added} -{f.removed}"
        lines.append(f"  {kind} {f.path:{width}s}  {counts}")
        for e in r.edits.get(f.path, []):
            lines.append(f"           {e}")
    a, rm, n = r.upstream
    na, nn = r.new
    ta, tf, tn = r.moved_tests
    lines.append(
        f"  = upstream code +{a} -{rm} in {n} file(s); new files +{na} in {nn} file(s)"
        + (f"; tests moved: {tn} in {tf} file(s), +{ta}" if tf else "")
    )
    return "\n".join(lines)


def _stats_from_changes(changes: List[FileChange]) -> List[FileStat]:
    import difflib

    stats = []
    for c in changes:
        old = [] if c.before is None else c.before.splitlines()
        new = c.after.splitlines()
        added = removed = 0
        matcher = difflib.SequenceMatcher(None, old, new, autojunk=False)
        for tag, i1, i2, j1, j2 in matcher.get_opcodes():
            if tag in ("replace", "delete"):
                removed += i2 - i1
            if tag in ("replace", "insert"):
                added += j2 - j1
        stats.append(FileStat(c.path, added, removed, c.before is None))
    return stats


def _result(pr: PR, row: StackRow, changes, commit, stats: List[FileStat]) -> PRResult:
    return PRResult(
        pr=pr.number,
        title=row.title,
        commit=commit,
        files=stats,
        edits={c.path: c.edits for c in changes},
        modules=list(pr.touched_modules()),
        tests={c.path: list(c.tests) for c in changes if c.tests},
    )


def _open_tree(src: str, log: Log) -> Tuple[str, str, Optional[str]]:
    root, package_dir = find_tree(src)
    version = tree_version(package_dir)
    if version != REQUIRED_SGLANG_VERSION:
        log(
            f"note: the stack is written against sglang {REQUIRED_SGLANG_VERSION}; "
            f"this tree is {version or 'of unknown version'}"
        )
    return root, package_dir, version


def export(
    src: str,
    out: str,
    stack_doc: Optional[str] = None,
    upto: Optional[str] = None,
    log: Log = print,
) -> ExportReport:
    root, package_dir, version = _open_tree(src, log)
    rows = read_stack(stack_doc or default_stack_doc())
    if upto is not None and upto not in rows:
        raise ExportError(f"--upto {upto}: no such PR in the stack ({', '.join(rows)})")
    repo = ScratchRepo(root)
    repo.ensure(version, log)
    base = repo.head()
    tree = Tree(root)
    moved: Dict[str, str] = {}
    results: List[PRResult] = []
    stop = Stop("", "", "end", "every PR of the stack is in the series")
    for row in rows.values():
        pr = registry_entry(row.pr)
        if not pr.finished:
            stop = Stop(row.pr, row.title, "unfinished",
                        f"stopped before PR {row.pr} ({row.title}): not finished in the "
                        f"generator: {pr.unfinished}")
            break
        try:
            changes, _ = plan_pr(pr, row.title, tree, moved)
        except EditFailed as e:
            stop = Stop(row.pr, row.title, "failed", f"error: {e.message()}")
            break
        paths = [c.path for c in changes]
        try:
            tree.write(changes)
            commit = repo.commit(commit_message(pr, row, changes), paths)
        except BaseException:
            repo.discard(paths)
            raise
        moved.update({m.source: m.module for m in pr.new_modules})
        stats = [FileStat(s.path, s.added, s.removed, s.new) for s in repo.numstat(commit)]
        result = _result(pr, row, changes, commit, stats)
        results.append(result)
        log(render_pr(result))
        if upto == row.pr:
            stop = Stop(row.pr, row.title, "upto", f"stopped after PR {row.pr} (--upto)")
            break
    patches = repo.format_patch(base, out) if results else []
    report = ExportReport(package_dir, root, version, base, results, stop, patches,
                          os.path.abspath(out))
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(report.to_json(), f, indent=1)
    log(summary(report))
    return report


def summary(report: ExportReport) -> str:
    done = ", ".join(r.pr for r in report.prs) or "none"
    a = sum(r.upstream[0] for r in report.prs)
    rm = sum(r.upstream[1] for r in report.prs)
    na = sum(r.new[0] for r in report.prs)
    tf = sum(r.moved_tests[1] for r in report.prs)
    tn = sum(r.moved_tests[2] for r in report.prs)
    lines = [
        f"series: PRs {done} ({len(report.patches)} patches in {report.out}); "
        f"upstream code +{a} -{rm}, new files +{na}, tests moved: {tn} in {tf} file(s)",
        report.stop.message,
    ]
    return "\n".join(lines)


# -- the report against another release -------------------------------------------------------


@dataclass
class CheckResult:
    pr: str
    title: str
    status: str  # "applies" | "does not apply" | "unfinished"
    failures: List[Dict[str, str]]  # file, symbol, detail
    files: List[FileStat]


def check(src: str, stack_doc: Optional[str] = None, log: Log = print) -> List[CheckResult]:
    """Apply every finished PR in memory on ``src``, past failures; nothing is written."""
    root, _, version = _open_tree(src, log)
    rows = read_stack(stack_doc or default_stack_doc())
    tree = Tree(root)
    moved: Dict[str, str] = {}
    results = []
    for row in rows.values():
        pr = registry_entry(row.pr)
        if not pr.finished:
            results.append(CheckResult(row.pr, row.title, "unfinished", [], []))
            continue
        changes, failures = plan_pr(pr, row.title, tree, moved, keep_going=True)
        for c in changes:
            tree.overlay[c.path] = c.after
        moved.update({m.source: m.module for m in pr.new_modules})
        results.append(
            CheckResult(
                row.pr,
                row.title,
                "does not apply" if failures else "applies",
                [{"file": f.file, "symbol": f.symbol, "detail": f.detail} for f in failures],
                _stats_from_changes(changes),
            )
        )
    for r in results:
        if r.status == "unfinished":
            continue
        log(f"{r.title}: {r.status}")
        for f in r.failures:
            log(f"  {f['file']}: {f['symbol']}: {f['detail']}")
    log(
        f"sglang {version}: "
        + ", ".join(f"PR {r.pr} {r.status}" for r in results if r.status != "unfinished")
    )
    return results
