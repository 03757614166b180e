"""``export-patches``: the series as commits on an sglang tree, and ``git format-patch`` of them.

Upstream reviews commits, not our recipes, so each PR of ``series/`` becomes one commit whose
message is exactly the PR's (:meth:`PullRequest.message`: nothing about this repository). Each
PR's files come from :func:`apply_pr`, the function ``install`` applies too, so the patches and
the installed tree cannot differ. A PR is computed in memory before anything is written: an edit
that does not apply stops the export as ``git am`` would, after the PRs before it, and leaves
the tree at the last commit. :mod:`.export_check` is the in-memory report for another release.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Tuple

from sglang_dflash_pp import SGLANG_VERSION
from sglang_dflash_pp.patch_series.errors import EditFailed, ExportError
from sglang_dflash_pp.patch_series.git_repo import ScratchRepo, find_tree, tree_version
from sglang_dflash_pp.patch_series.series import (
    PACKAGE_PATH,
    PullRequest,
    Reader,
    apply_pr,
    load_series,
)

APPLY_HINT = "git am --keep-non-patch"  # keeps the titles' [Bugfix] / [PD] tags


@dataclass(frozen=True)
class FileLines:
    path: str  # in sglang's repository: python/sglang/..., test/registered/...
    kind: str  # "upstream" (an sglang file), "new" (a file the PR adds) or "test"
    added: int
    removed: int


@dataclass(frozen=True)
class ExportedPR:
    name: str
    title: str
    commit: str
    files: List[FileLines]

    def lines(self, kind: str) -> Tuple[int, int, int]:
        """Lines added, removed and files of one kind."""
        fs = [f for f in self.files if f.kind == kind]
        return sum(f.added for f in fs), sum(f.removed for f in fs), len(fs)


def select(upto: Optional[str]) -> List[PullRequest]:
    """The PRs to export; an ``upto`` that names no PR is a usage error, not the whole series."""
    prs = load_series(upto)
    if upto is not None and upto not in (prs[-1].name, prs[-1].name[:2]):
        names = ", ".join(pr.name for pr in prs)
        raise ExportError(f"--upto {upto}: no such PR in the series ({names})")
    return prs


def open_tree(src: str, log) -> Tuple[str, Optional[str]]:
    """The tree's root and release; another release is reported, as anchors may be missing."""
    root, package_dir = find_tree(src)
    version = tree_version(package_dir)
    if version != SGLANG_VERSION:
        log(f"note: the series is written against sglang {SGLANG_VERSION}; this tree is "
            f"{version or 'a checkout of unknown version'}")
    return root, version


def tree_reader(root: str) -> Reader:
    def read(path: str) -> Optional[str]:
        full = os.path.join(root, path)
        if not os.path.isfile(full):
            return None
        with open(full) as f:
            return f.read()

    return read


def write_file(root: str, path: str, text: str) -> None:
    """Replace, never write into, the file: a tree made from the installed package with
    ``cp -al`` shares its inodes, which must keep the wheel's text. The mode is kept."""
    full = os.path.join(root, path)
    os.makedirs(os.path.dirname(full), exist_ok=True)
    tmp = full + ".export-patches.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    if os.path.exists(full):
        os.chmod(tmp, os.stat(full).st_mode & 0o7777)
    os.replace(tmp, full)


def _kind(path: str, new: bool) -> str:
    if not path.startswith(PACKAGE_PATH + "/"):
        return "test"
    return "new" if new else "upstream"


def export(
    src: str, out: str, upto: Optional[str] = None, log=print
) -> Tuple[dict, Optional[EditFailed]]:
    """Commit the series on ``src``, write its patches and ``report.json`` to ``out``; the
    report, and the edit that stopped it (None when every PR was committed)."""
    prs = select(upto)
    root, version = open_tree(src, log)
    repo = ScratchRepo(root)
    repo.ensure(version, log, series_titles=[pr.title for pr in load_series()])
    base = repo.head()
    read = tree_reader(root)
    done: List[ExportedPR] = []
    failure = None
    for pr in prs:
        try:
            changes: Dict[str, str] = apply_pr(pr, read)
        except EditFailed as e:
            failure = e
            break
        paths = sorted(changes)
        try:
            for path in paths:
                write_file(root, path, changes[path])
            commit = repo.commit(pr.message(), paths)
        except BaseException:
            repo.discard(paths)
            raise
        files = [FileLines(s.path, _kind(s.path, s.new), s.added, s.removed)
                 for s in repo.numstat(commit)]
        done.append(ExportedPR(pr.name, pr.title, commit, files))
    patches = repo.format_patch(base, out) if done else []
    report = {
        "sglang_version": version,
        "root": root,
        "base": base,
        "patches": patches,
        "prs": [asdict(pr) for pr in done],
        "stopped": None if failure is None else failure.message(),
    }
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(report, f, indent=1)
    log(render(done))
    if patches:
        log(f"{len(patches)} patches in {out}; apply with: {APPLY_HINT} {out}/*.patch")
    if failure is not None:
        log(f"error: {failure.message()}")
    return report, failure


def render(prs: List[ExportedPR]) -> str:
    """Per PR its commit and files, upstream lines +/- per file, new files and tests."""
    lines = []
    width = max((len(f.path) for pr in prs for f in pr.files), default=0)
    for pr in prs:
        lines.append(f"{pr.name}  {pr.commit[:12]}  {pr.title}")
        for f in pr.files:
            counts = f"+{f.added}" if f.kind != "upstream" else f"+{f.added} -{f.removed}"
            lines.append(f"  {f.kind:8s}  {f.path:{width}s}  {counts}")
        lines.append("  = " + _totals(pr.lines))
    if len(prs) > 1:
        def total(kind):
            sums = [pr.lines(kind) for pr in prs]
            return tuple(sum(s[i] for s in sums) for i in range(3))

        lines.append(f"series, {len(prs)} PRs: " + _totals(total))
    return "\n".join(lines)


def _totals(lines) -> str:
    ua, ur, un = lines("upstream")
    na, _, nn = lines("new")
    ta, _, tn = lines("test")
    return (f"upstream +{ua} -{ur} in {un} file(s); new files +{na} in {nn}; "
            f"tests +{ta} in {tn}")
