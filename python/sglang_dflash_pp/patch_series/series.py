"""The patch series: ``patches/NNNN-*.patch``, in order, as ``git format-patch`` wrote them.

The patch files are the source of truth, as Electron keeps its Chromium patches: each is one
pull request (its commit message is the PR description), applied with ``git am`` to a pinned
sglang tree and written back from it with ``git format-patch`` (:mod:`.git_repo`). This module
only reads them: their order, subjects, the files each touches, and a fingerprint the installed
tree records.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

REPO_ROOT = Path(__file__).resolve().parents[3]
PATCHES_DIR = REPO_ROOT / "patches"
PACKAGE_PATH = "python/sglang"  # the package's path in sglang's repository


@dataclass(frozen=True)
class Patch:
    path: Path
    title: str  # the commit subject, without git's "[PATCH n/m]"
    files: Tuple[Tuple[str, bool], ...]  # (repository path, added by this patch)

    @property
    def name(self) -> str:  # "0005-PD-Mooncake-send-..."
        return self.path.stem

    @property
    def number(self) -> str:  # "05"
        return self.path.name[2:4]

    @property
    def product_files(self) -> List[str]:
        return [p for p, _ in self.files if p.startswith(PACKAGE_PATH + "/")]


def parse_patch(path: Path) -> Patch:
    text = path.read_text()
    subject = re.search(r"^Subject: (?:\[PATCH[^\]]*\] )?(.*(?:\n [^\n]*)*)", text, re.M)
    title = " ".join(subject.group(1).split()) if subject else path.stem
    files, current = [], None
    for line in text.splitlines():
        if line.startswith("diff --git "):
            current = line.split(" b/", 1)[1]
            files.append([current, False])
        elif current and line.startswith("new file mode"):
            files[-1][1] = True
    return Patch(path, title, tuple((p, new) for p, new in files))


def load_patches(upto: Optional[str] = None, directory: Path = PATCHES_DIR) -> List[Patch]:
    """The patches in order, up to and including ``upto`` (its number, e.g. ``05``, or its
    file name)."""
    patches = []
    for path in sorted(directory.glob("[0-9][0-9][0-9][0-9]-*.patch")):
        patches.append(parse_patch(path))
        if upto is not None and upto in (path.stem, path.name, path.name[2:4], path.name[:4]):
            break
    return patches


def fingerprint(directory: Path = PATCHES_DIR) -> str:
    """A hash of the patch files: what decides the patched tree. The installed tree records
    it (``install``) and the test session compares it with the checkout's."""
    h = hashlib.sha256()
    for patch in load_patches(directory=directory):
        h.update(patch.path.name.encode())
        h.update(patch.path.read_bytes())
    return h.hexdigest()[:16]
