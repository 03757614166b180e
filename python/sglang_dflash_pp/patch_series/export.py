"""The series on an sglang tree: ``export-patches`` (commit it), ``--check`` (would it apply)
and ``update-patches`` (write a tree's commits back to ``patches/``).

``export-patches`` applies ``patches/`` to a tree with ``git am``, one patch at a time, and
writes ``git format-patch`` of the commits it made with ``report.json`` (per PR: its commit and
the lines added and removed per file). A patch that does not apply stops it as ``git am`` would,
after the ones before it. On the pinned release the patches it writes are byte for byte those in
``patches/``; on a fork they carry the fork's context. ``update-patches`` is the reverse, for
whoever changes the series: edit the exported tree, commit (``git commit --fixup``, ``git rebase
--autosquash``), and write its commits since the base back to ``patches/``.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from typing import List, Optional, Tuple

from sglang_dflash_pp import SGLANG_VERSION
from sglang_dflash_pp.patch_series.errors import ExportError, PatchFailed
from sglang_dflash_pp.patch_series.git_repo import ScratchRepo, find_tree, tree_version
from sglang_dflash_pp.patch_series.series import (
    PACKAGE_PATH,
    PATCHES_DIR,
    Patch,
    load_patches,
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


def select(upto: Optional[str]) -> List[Patch]:
    """The patches to apply; an ``upto`` that names none is a usage error, not the series."""
    patches = load_patches(upto)
    if not patches:
        raise ExportError(f"no patches in {PATCHES_DIR}")
    if upto is not None and upto not in (patches[-1].number, patches[-1].name,
                                         patches[-1].path.name, patches[-1].name[:4]):
        names = ", ".join(p.path.name for p in load_patches())
        raise ExportError(f"--upto {upto}: no such patch in the series ({names})")
    return patches


def open_tree(src: str, log) -> Tuple[str, Optional[str]]:
    """The tree's root and release; another release is reported (hunks may not apply)."""
    root, package_dir = find_tree(src)
    version = tree_version(package_dir)
    if version != SGLANG_VERSION:
        log(f"note: the series is written against sglang {SGLANG_VERSION}; this tree is "
            f"{version or 'a checkout of unknown version'}")
    return root, version


def _kind(path: str, new: bool) -> str:
    if not path.startswith(PACKAGE_PATH + "/"):
        return "test"
    return "new" if new else "upstream"


def apply_patches(repo: ScratchRepo, patches: List[Patch]
                  ) -> Tuple[List[ExportedPR], Optional[PatchFailed]]:
    done, failure = [], None
    for patch in patches:
        try:
            commit = repo.am(str(patch.path))
        except PatchFailed as e:
            failure = e
            break
        files = [FileLines(s.path, _kind(s.path, s.new), s.added, s.removed)
                 for s in repo.numstat(commit)]
        done.append(ExportedPR(patch.name, patch.title, commit, files))
    return done, failure


def export(src: str, out: str, upto: Optional[str] = None, log=print
           ) -> Tuple[dict, Optional[PatchFailed]]:
    """Commit the series on ``src``, write its patches and ``report.json`` to ``out``; the
    report, and the patch that stopped it (None when every PR was committed)."""
    patches = select(upto)
    root, version = open_tree(src, log)
    repo = ScratchRepo(root)
    repo.ensure(version, log, series_titles=[p.title for p in load_patches()])
    base = repo.tag_base()
    done, failure = apply_patches(repo, patches)
    written = repo.format_patch(base, out) if done else []
    report = {
        "sglang_version": version,
        "root": root,
        "base": base,
        "patches": written,
        "prs": [asdict(pr) for pr in done],
        "stopped": None if failure is None else failure.message(),
    }
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(report, f, indent=1)
    log(render(done))
    if written:
        log(f"{len(written)} patches in {out}; apply with: {APPLY_HINT} {out}/*.patch")
    if failure is not None:
        log(f"error: {failure.message()}")
    return report, failure


def check(src: str, upto: Optional[str] = None, log=print) -> List[Tuple[Patch, Optional[str]]]:
    """Which patches apply to ``src`` in order, trying each on a scratch copy of the files the
    series touches (the tree is not written); a patch that fails is skipped and the next is
    tried on what applied, so every failing hunk is named at once."""
    patches = select(upto)
    root, version = open_tree(src, log)
    results = []
    with tempfile.TemporaryDirectory(prefix="sglang-series-check-") as scratch:
        touched = sorted({p for patch in patches for p, new in patch.files if not new})
        for path in touched:
            if os.path.isfile(os.path.join(root, path)):
                os.makedirs(os.path.dirname(os.path.join(scratch, path)), exist_ok=True)
                shutil.copyfile(os.path.join(root, path), os.path.join(scratch, path))
        repo = ScratchRepo(scratch)
        repo.ensure(version, lambda _: None)
        for patch in patches:
            try:
                repo.am(str(patch.path))
                results.append((patch, None))
            except PatchFailed as e:
                results.append((patch, e.detail))
    for patch, why in results:
        log(f"{patch.name}: {'applies' if why is None else 'does not apply'}")
        if why:
            log(f"  {why}")
    ok = sum(why is None for _, why in results)
    log(f"{ok} of {len(results)} patches apply to sglang {version or '(unknown version)'} "
        f"at {root}")
    return results


def update_patches(src: str, out: str = str(PATCHES_DIR), log=print) -> List[str]:
    """Write the commits of a tree made by ``export-patches`` (since its base tag) to ``out``,
    replacing the series there."""
    root, _ = find_tree(src)
    repo = ScratchRepo(root)
    written = repo.format_patch(repo.base(), out)
    log(f"{len(written)} patches written to {out} from {root}")
    return written


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
