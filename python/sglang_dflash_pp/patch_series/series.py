"""The patch series: the pull requests of ``series/``, in order.

Each ``series/NN_<name>.py`` defines ``PR``, one :class:`PullRequest`: the commit message a
reviewer reads, our edits of upstream files (:mod:`.cst_edits`, :mod:`.cst_declaration_edits`;
anchored on symbols by :mod:`.cst_anchors`, never on line numbers) and the files the PR adds,
which live in this repository at their in-tree paths (``python/sglang/...``,
``test/registered/...``). :func:`apply_pr` turns one PR into the new
text of every file it touches, given a reader of the tree it applies to; nothing here stores
upstream code.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import libcst as cst

from sglang_dflash_pp.patch_series.cst_edits import Edit
from sglang_dflash_pp.patch_series.errors import AnchorError, EditFailed

REPO_ROOT = Path(__file__).resolve().parents[3]
SERIES_DIR = REPO_ROOT / "series"
PACKAGE_PATH = "python/sglang"  # the package's path in sglang's repository

Reader = Callable[[str], Optional[str]]  # repository path -> text, None if absent


@dataclass(frozen=True)
class PullRequest:
    name: str  # the file's stem, e.g. "01_input_embeds_dtype"
    title: str  # the commit subject
    description: str  # the commit body: motivation, change, tests, accuracy / speed
    edits: Tuple[Edit, ...] = ()
    files: Tuple[str, ...] = ()  # new files, repository paths

    @property
    def upstream_files(self) -> List[str]:
        return sorted({f"{PACKAGE_PATH}/{e.file}" for e in self.edits})

    @property
    def product_files(self) -> List[str]:
        return [f for f in self.files if f.startswith(PACKAGE_PATH + "/")]

    @property
    def test_files(self) -> List[str]:
        return [f for f in self.files if not f.startswith(PACKAGE_PATH + "/")]

    def message(self) -> str:
        return f"{self.title}\n\n{self.description.strip()}\n"


def _load(path: Path) -> PullRequest:
    spec = importlib.util.spec_from_file_location(f"_series_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    pr = module.PR
    return PullRequest(
        name=path.stem,
        title=pr["title"],
        description=pr["description"],
        edits=tuple(pr.get("edits", ())),
        files=tuple(pr.get("files", ())),
    )


def load_series(upto: Optional[str] = None) -> List[PullRequest]:
    """The PRs in order (``series/NN_*.py`` by number), up to and including ``upto``."""
    prs = []
    for path in sorted(SERIES_DIR.glob("[0-9][0-9]_*.py")):
        prs.append(_load(path))
        if upto is not None and upto in (path.stem, path.stem[:2]):
            break
    return prs


def apply_pr(pr: PullRequest, read: Reader) -> Dict[str, str]:
    """The new text of every file ``pr`` touches, repository path -> text, applied over
    ``read`` (the tree as the PRs before it left it)."""
    modules: Dict[str, cst.Module] = {}  # each file parsed once: a parse costs ~0.3 s
    for edit in pr.edits:
        path = f"{PACKAGE_PATH}/{edit.file}"
        if path not in modules:
            text = read(path)
            if text is None:
                raise EditFailed(pr.name, pr.title, path, edit.symbol, "no such file")
            modules[path] = cst.parse_module(text)
        try:
            modules[path] = edit.apply(modules[path])
        except AnchorError as e:
            raise EditFailed(pr.name, pr.title, path, edit.symbol or "(module)", str(e))
    out: Dict[str, str] = {}
    for path, module in modules.items():
        out[path] = format_our_lines(read(path), module.code)
    for path in pr.files:
        if read(path) is not None and path not in out:
            raise EditFailed(pr.name, pr.title, path, "", "the file it adds already exists")
        out[path] = (REPO_ROOT / path).read_text()
    return out


def format_our_lines(before: str, after: str) -> str:
    """``after`` laid out by sglang's formatter (``ruff format``, line length 88). Upstream
    files are already in that layout, so only the lines our edits wrote can change."""
    import subprocess

    ruff = [sys.executable, "-m", "ruff", "format", "--line-length", "88", "-"]
    done = subprocess.run(ruff, input=after, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"ruff format failed: {done.stderr.strip()}")
    return done.stdout


def apply_series(prs: List[PullRequest], read: Reader) -> Dict[str, str]:
    """Every file the series touches, applied in order over ``read``."""
    tree: Dict[str, str] = {}

    def current(path: str) -> Optional[str]:
        return tree[path] if path in tree else read(path)

    for pr in prs:
        tree.update(apply_pr(pr, current))
    return tree


# The modules of this package that decide the installed tree. The commands around them
# (export-patches, install's command line) are left out: editing those must not make every
# developer's environment stale (the test session refuses a stale one).
APPLIER_MODULES = (
    "cst_anchors.py", "cst_edits.py", "cst_declaration_edits.py", "errors.py", "series.py",
    "install.py",
)


def fingerprint() -> str:
    """A hash of everything that decides the patched tree: the recipes, the files the series
    adds and the code that applies them. The installed tree records it (``install``)."""
    h = hashlib.sha256()
    here = Path(__file__).parent
    paths = [here / name for name in APPLIER_MODULES]
    for root in (SERIES_DIR, REPO_ROOT / PACKAGE_PATH):
        paths += sorted(root.rglob("*.py"))
    for path in paths:
        if "__pycache__" in path.parts:
            continue
        h.update(str(path.relative_to(REPO_ROOT)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]
