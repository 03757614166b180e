"""The scratch git repository the series is committed in, and ``git format-patch`` of it.

The tree is an sglang package directory (the one holding ``srt/``): a copy of the installed
wheel's ``sglang/``, or ``python/sglang`` of a git checkout. When the directory is in no git work
tree, one is made there and the tree as found becomes the base commit. Patch paths are written
as in sglang's repository (``python/sglang/srt/...``), whatever the scratch repository's root, so
the series applies with ``git am`` on a checkout.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from sglang_dflash_pp.tools.export_patches.errors import ExportError

UPSTREAM_PACKAGE_PATH = "python/sglang"  # the package's path in sglang's repository
FALLBACK_IDENTITY = {
    "GIT_AUTHOR_NAME": "sglang-dflash-pp export-patches",
    "GIT_AUTHOR_EMAIL": "export-patches@sglang-dflash-pp.invalid",
    "GIT_COMMITTER_NAME": "sglang-dflash-pp export-patches",
    "GIT_COMMITTER_EMAIL": "export-patches@sglang-dflash-pp.invalid",
}
TRAILER = "Generated-by: sglang-dflash-pp export-patches"


def find_package_dir(src: str) -> str:
    """The sglang package directory of ``src``: ``src`` itself or ``src/python/sglang``."""
    src = os.path.abspath(src)
    for cand in (src, os.path.join(src, "python", "sglang"), os.path.join(src, "sglang")):
        if os.path.isdir(os.path.join(cand, "srt")) and os.path.isfile(
            os.path.join(cand, "__init__.py")
        ):
            return cand
    raise ExportError(
        f"{src} is not an sglang tree (no srt/ and __init__.py there, nor under python/sglang)",
        hint="pass the copied wheel's sglang/ directory, or a checkout of sglang",
    )


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
    path: str  # as in sglang's repository: python/sglang/...
    added: int
    removed: int
    new: bool


class ScratchRepo:
    def __init__(self, package_dir: str):
        self.package_dir = package_dir
        self.root = self._toplevel(package_dir)
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
                    ["git", "config", key], cwd=self.package_dir, capture_output=True
                ).returncode:
                    env.update(FALLBACK_IDENTITY)
                    break
            self._env = env
        return self._env

    def git(self, *args: str, input: Optional[str] = None) -> str:
        r = subprocess.run(
            ["git", *args], cwd=self.root or self.package_dir, capture_output=True, text=True,
            input=input, env=self.env,
        )
        if r.returncode:
            why = r.stderr.strip() or r.stdout.strip()
            raise ExportError(f"git {' '.join(args)} failed: {why}")
        return r.stdout

    # -- setup ---------------------------------------------------------------------------

    def ensure(self, version: Optional[str], log) -> None:
        """A git work tree holding the package, with nothing uncommitted in the package."""
        if self.root is None:
            self.root = self.package_dir
            self.git("init", "-q")
            with open(os.path.join(self.root, ".git", "info", "exclude"), "a") as f:
                f.write("__pycache__/\n*.pyc\n")  # a copied wheel may hold bytecode
            self.git("add", "-A", ".")
            self.git("commit", "-q", "-m", f"sglang {version or '(unknown version)'} as found")
            log(f"initialised a git repository at {self.root}; base commit: the tree as found")
            return
        dirty = self.git("status", "--porcelain", "--untracked-files=no", "--", self.rel)
        if dirty.strip():
            raise ExportError(
                f"{self.package_dir} has uncommitted changes:\n{dirty.rstrip()}",
                hint="commit or discard them first; the series is committed on top of HEAD",
            )
        last = self.git("log", "-1", "--format=%B") if self.has_commits() else ""
        if TRAILER in last:
            raise ExportError(
                "HEAD is already a commit of an exported series",
                hint="reset the scratch repository to the sglang base commit and run again",
            )

    def has_commits(self) -> bool:
        return subprocess.run(
            ["git", "rev-parse", "-q", "--verify", "HEAD"], cwd=self.root,
            capture_output=True,
        ).returncode == 0

    @property
    def rel(self) -> str:
        """The package directory relative to the repository root (``.`` when it is the root)."""
        return os.path.relpath(self.package_dir, self.root)

    def head(self) -> str:
        return self.git("rev-parse", "HEAD").strip()

    # -- commits -------------------------------------------------------------------------

    def commit(self, message: str) -> str:
        self.git("add", "-A", "--", self.rel)
        self.git("commit", "-q", "-F", "-", input=message)
        return self.head()

    def discard(self) -> None:
        """Drop what an unfinished PR wrote (the tree stays at the last commit)."""
        self.git("checkout", "-q", "--", self.rel)
        self.git("clean", "-q", "-f", "--", self.rel)

    def numstat(self, commit: str) -> List[NumStat]:
        status = {}
        for line in self.git("diff", "--name-status", f"{commit}^", commit).splitlines():
            kind, path = line.split("\t", 1)
            status[path] = kind
        stats = []
        for line in self.git("diff", "--numstat", f"{commit}^", commit).splitlines():
            added, removed, path = line.split("\t", 2)
            stats.append(
                NumStat(self.upstream_path(path), int(added), int(removed), status[path] == "A")
            )
        return stats

    def upstream_path(self, repo_path: str) -> str:
        return self.prefix + repo_path

    @property
    def prefix(self) -> str:
        """What puts a path of this repository at its place in sglang's repository."""
        rel = self.rel.replace(os.sep, "/")
        if rel == ".":
            return UPSTREAM_PACKAGE_PATH + "/"
        if UPSTREAM_PACKAGE_PATH == rel or UPSTREAM_PACKAGE_PATH.endswith("/" + rel):
            return UPSTREAM_PACKAGE_PATH[: -len(rel)]
        return ""

    def format_patch(self, base: str, out: str) -> List[str]:
        os.makedirs(out, exist_ok=True)
        for name in os.listdir(out):
            if re.match(r"^\d{4}-.*\.patch$", name):
                os.remove(os.path.join(out, name))
        p = self.prefix
        files = self.git(
            "format-patch", "--no-signature", f"--src-prefix=a/{p}", f"--dst-prefix=b/{p}",
            "-o", os.path.abspath(out), f"{base}..HEAD",
        )
        return [os.path.basename(f) for f in files.split()]

    def commits(self, base: str) -> Sequence[str]:
        return self.git("rev-list", "--reverse", f"{base}..HEAD").split()
