"""The git repository the series is applied in (``git am``) and written back from
(``git format-patch``).

The repository has sglang's own layout: code under ``python/sglang/``, tests under
``test/registered/``. It is a checkout of sglang (its root, or its ``python/sglang``), or a
directory laid out the same way around a copy of the installed wheel's package
(``<root>/python/sglang``). When the root is in no git work tree, one is made there and the tree
as found becomes the base commit. A package directory not under ``python/`` is refused: the
patches would not say where the tests go. Paths in the patches are the repository's own, so the
series applies with ``git am`` on a checkout.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from sglang_dflash_pp.patch_series.errors import ExportError, PatchFailed

UPSTREAM_PACKAGE_PATH = "python/sglang"  # the package's path in sglang's repository
UPSTREAM_TEST_PATH = "test/registered"  # where sglang's repository keeps its registered tests
BASE_TAG = "sglang-dflash-pp-base"  # the release commit the series is applied on
# Deterministic patches: the same commits always give the same bytes, so a fresh export
# compares equal to patches/ (no commit ids, full blob ids, no git version).
FORMAT_PATCH = ("format-patch", "--zero-commit", "--full-index", "--no-signature")
FALLBACK_IDENTITY = {
    "GIT_AUTHOR_NAME": "sglang-dflash-pp export-patches",
    "GIT_AUTHOR_EMAIL": "export-patches@sglang-dflash-pp.invalid",
    "GIT_COMMITTER_NAME": "sglang-dflash-pp export-patches",
    "GIT_COMMITTER_EMAIL": "export-patches@sglang-dflash-pp.invalid",
}
LAYOUT_HINT = (
    "lay the tree out as sglang's repository and pass its root: "
    "mkdir -p /tmp/tree/python && cp -r \"$SGLANG\" /tmp/tree/python/sglang && "
    "sglang-dflash-pp export-patches --sglang-src /tmp/tree ... "
    "(SGLANG: the installed package, python -c 'import os, sglang; "
    "print(os.path.dirname(sglang.__file__))'), or pass a checkout of sglang"
)


def _is_package(path: str) -> bool:
    return os.path.isdir(os.path.join(path, "srt")) and os.path.isfile(
        os.path.join(path, "__init__.py")
    )


def find_tree(src: str) -> Tuple[str, str]:
    """``(root, package_dir)`` of ``src``: a root holding ``python/sglang``, or that package
    directory itself (its root two levels up)."""
    src = os.path.abspath(src)
    if _is_package(os.path.join(src, *UPSTREAM_PACKAGE_PATH.split("/"))):
        return src, os.path.join(src, *UPSTREAM_PACKAGE_PATH.split("/"))
    if _is_package(src):
        parent = os.path.dirname(src)
        if os.path.basename(src) == "sglang" and os.path.basename(parent) == "python":
            return os.path.dirname(parent), src
        raise ExportError(
            f"{src} is an sglang package outside sglang's repository layout (it is not "
            f"<root>/python/sglang): the series puts code under python/sglang/ and tests under "
            f"{UPSTREAM_TEST_PATH}/ of one root",
            hint=LAYOUT_HINT,
        )
    raise ExportError(
        f"{src} is not an sglang tree (no python/sglang with srt/ and __init__.py under it)",
        hint=LAYOUT_HINT,
    )


def find_package_dir(src: str) -> str:
    """The sglang package directory of ``src`` (see :func:`find_tree`)."""
    return find_tree(src)[1]


def tree_version(package_dir: str) -> Optional[str]:
    """The release a tree is: a wheel's ``_version.py`` (setuptools-scm); None for a checkout
    (its version is only known at build time)."""
    path = os.path.join(package_dir, "_version.py")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        m = re.search(r"""__version__\s*=\s*(?:version\s*=\s*)?["']([^"']+)["']""", f.read())
    return m.group(1) if m else None


@dataclass(frozen=True)
class NumStat:
    path: str  # as in sglang's repository: python/sglang/..., test/registered/...
    added: int
    removed: int
    new: bool


# what a commit of the series may touch, relative to the root
SERIES_PATHS = (UPSTREAM_PACKAGE_PATH, UPSTREAM_TEST_PATH)


class ScratchRepo:
    """The git repository of a tree laid out as sglang's (``root``: where ``python/sglang``
    is); ``path`` is the root or any directory under it."""

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        top = self._toplevel(self.path)
        self.root = top
        self._env: Optional[Dict[str, str]] = None

    @staticmethod
    def _toplevel(path: str) -> Optional[str]:
        r = subprocess.run(
            ["git", "rev-parse", "--show-toplevel"], cwd=path, capture_output=True, text=True
        )
        return r.stdout.strip() if r.returncode == 0 else None

    @property
    def env(self) -> Dict[str, str]:
        if self._env is None:
            env = dict(os.environ)
            for key in ("user.name", "user.email"):
                if subprocess.run(
                    ["git", "config", key], cwd=self.root or self.path, capture_output=True
                ).returncode:
                    env.update(FALLBACK_IDENTITY)
                    break
            self._env = env
        return self._env

    def git(self, *args: str, input: Optional[str] = None) -> str:
        r = subprocess.run(
            ["git", *args], cwd=self.root or self.path, capture_output=True, text=True,
            input=input, env=self.env,
        )
        if r.returncode:
            why = r.stderr.strip() or r.stdout.strip()
            raise ExportError(f"git {' '.join(args)} failed: {why}")
        return r.stdout

    # -- setup ---------------------------------------------------------------------------

    def ensure(self, version: Optional[str], log, series_titles: Sequence[str] = ()) -> None:
        """A git work tree whose root is the tree's root, with nothing uncommitted in
        ``python/sglang`` or ``test/registered``, whose ``HEAD`` is no commit of the series
        (its subject is none of ``series_titles``): the series goes on the release, once."""
        if self.root is None:
            self.root = self.path
            self.git("init", "-q")
            with open(os.path.join(self.root, ".git", "info", "exclude"), "a") as f:
                f.write("__pycache__/\n*.pyc\n")  # a copied wheel may hold bytecode
            # The base commit is the whole package (~5,800 files, 130 MB): zlib's fastest
            # level halves the CPU of this git add, for objects of about the same size.
            self.git("-c", "core.looseCompression=1", "add", "-A", ".")
            self.git("commit", "-q", "-m", f"sglang {version or '(unknown version)'} as found")
            log(f"initialised a git repository at {self.root}; base commit: the tree as found")
            return
        if os.path.realpath(self.root) != os.path.realpath(self.path):
            raise ExportError(
                f"{self.path} is inside the git repository {self.root} but is not its root: "
                f"the series' paths ({UPSTREAM_PACKAGE_PATH}/..., {UPSTREAM_TEST_PATH}/...) "
                "are the root's",
                hint="copy the tree to a directory in no repository (python/sglang under it), "
                "or pass a checkout of sglang",
            )
        dirty = self.git("status", "--porcelain", "--untracked-files=no", "--", *SERIES_PATHS)
        if dirty.strip():
            raise ExportError(
                f"{self.root} has uncommitted changes:\n{dirty.rstrip()}",
                hint="commit or discard them first; the series is committed on top of HEAD",
            )
        subject = self.git("log", "-1", "--format=%s").strip() if self.has_commits() else ""
        if subject and subject in series_titles:
            raise ExportError(
                f"HEAD is already a commit of the series ({subject!r})",
                hint="reset the repository to the sglang base commit and run again",
            )

    def has_commits(self) -> bool:
        return subprocess.run(
            ["git", "rev-parse", "-q", "--verify", "HEAD"], cwd=self.root,
            capture_output=True,
        ).returncode == 0

    def head(self) -> str:
        return self.git("rev-parse", "HEAD").strip()

    # -- commits -------------------------------------------------------------------------

    def tag_base(self) -> str:
        """Mark ``HEAD`` as the base the series goes on (``update-patches`` exports from it)."""
        self.git("tag", "-f", BASE_TAG, "HEAD")
        return self.head()

    def base(self) -> str:
        return self.git("rev-parse", f"{BASE_TAG}^{{commit}}").strip()

    def am(self, patch: str) -> str:
        """``git am`` one patch (its subject's tags kept); on failure the tree is left at the
        commit before it and :class:`PatchFailed` says which file and hunk."""
        r = subprocess.run(
            ["git", "am", "-q", "--keep-non-patch", "--committer-date-is-author-date", patch],
            cwd=self.root, capture_output=True, text=True, env=self.env,
        )
        if r.returncode:
            subprocess.run(["git", "am", "--abort"], cwd=self.root, capture_output=True,
                           env=self.env)
            detail = "; ".join(ln.strip() for ln in (r.stderr or r.stdout).splitlines()
                               if ln.startswith("error:"))
            raise PatchFailed(os.path.basename(patch), detail or r.stderr.strip())
        return self.head()

    def numstat(self, commit: str) -> List[NumStat]:
        status = {}
        for line in self.git("diff", "--name-status", f"{commit}^", commit).splitlines():
            kind, path = line.split("\t", 1)
            status[path] = kind
        stats = []
        for line in self.git("diff", "--numstat", f"{commit}^", commit).splitlines():
            added, removed, path = line.split("\t", 2)
            stats.append(NumStat(path, int(added), int(removed), status[path] == "A"))
        return stats

    def format_patch(self, base: str, out: str) -> List[str]:
        os.makedirs(out, exist_ok=True)
        for name in os.listdir(out):
            if re.match(r"^\d{4}-.*\.patch$", name):
                os.remove(os.path.join(out, name))
        files = self.git(*FORMAT_PATCH, "-o", os.path.abspath(out), f"{base}..HEAD")
        return [os.path.basename(f) for f in files.split()]

    def commits(self, base: str) -> Sequence[str]:
        return self.git("rev-list", "--reverse", f"{base}..HEAD").split()
