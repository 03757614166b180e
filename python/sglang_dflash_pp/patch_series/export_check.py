"""``export-patches --check``: which PRs apply to a tree, and which anchors are missing.

The tool for another sglang release: nothing is written and no git is needed. A PR that does
not apply as a whole is tried edit by edit, so the report names every missing anchor at once
rather than the first; what did apply stays in the in-memory tree, so a later PR is judged on
as much of its predecessors as the release allows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import libcst as cst

from sglang_dflash_pp.patch_series.errors import AnchorError, EditFailed
from sglang_dflash_pp.patch_series.export import open_tree, select, tree_reader
from sglang_dflash_pp.patch_series.series import (
    PACKAGE_PATH,
    REPO_ROOT,
    PullRequest,
    Reader,
    apply_pr,
)


@dataclass(frozen=True)
class CheckResult:
    name: str
    title: str
    failures: List[EditFailed]

    @property
    def applies(self) -> bool:
        return not self.failures


def _each_edit(pr: PullRequest, read: Reader) -> Tuple[Dict[str, str], List[EditFailed]]:
    """Every edit of ``pr`` on its own: the files as far as they applied, and each failure."""
    modules: Dict[str, cst.Module] = {}
    unusable: Dict[str, str] = {}  # path -> why no edit of it can apply
    failures = []

    def fail(path: str, symbol: str, detail: str) -> None:
        failures.append(EditFailed(pr.name, pr.title, path, symbol, detail))

    for edit in pr.edits:
        path = f"{PACKAGE_PATH}/{edit.file}"
        if path not in modules and path not in unusable:
            text = read(path)
            try:
                if text is None:
                    unusable[path] = "no such file"
                else:
                    modules[path] = cst.parse_module(text)
            except cst.ParserSyntaxError as e:
                unusable[path] = f"libcst cannot parse it: {e}"
        if path in unusable:
            fail(path, edit.symbol or "(module)", unusable[path])
            continue
        try:
            modules[path] = edit.apply(modules[path])
        except AnchorError as e:
            fail(path, edit.symbol or "(module)", str(e))
    out = {path: m.code for path, m in modules.items()}
    for path in pr.files:
        if read(path) is not None:
            fail(path, "", "the file it adds already exists")
        else:
            out[path] = (REPO_ROOT / path).read_text()
    return out, failures


def check_series(prs: List[PullRequest], read: Reader) -> List[CheckResult]:
    tree: Dict[str, str] = {}

    def current(path: str) -> Optional[str]:
        return tree[path] if path in tree else read(path)

    results = []
    for pr in prs:
        try:
            tree.update(apply_pr(pr, current))
            failures = []
        except EditFailed:
            changes, failures = _each_edit(pr, current)
            tree.update(changes)
        results.append(CheckResult(pr.name, pr.title, failures))
    return results


def check(src: str, upto: Optional[str] = None, log=print) -> List[CheckResult]:
    prs = select(upto)
    root, version = open_tree(src, log)
    results = check_series(prs, tree_reader(root))
    for r in results:
        log(f"{r.name}: {'applies' if r.applies else 'does not apply'}  ({r.title})")
        for f in r.failures:
            log("  " + ": ".join(part for part in (f.file, f.symbol, f.detail) if part))
    ok = sum(r.applies for r in results)
    log(f"{ok} of {len(results)} PRs apply to sglang {version or '(unknown version)'} at {root}")
    return results
