"""Timing two trees of this project in one run: the code at an earlier commit, checked out into a
temporary git worktree, and the working tree. Each runs its driver in a subprocess whose
``sys.path`` starts with that tree's ``python/``, so the two never share an imported module.
Used by ``draft_kv_transfer/host_time.py`` and ``kv_digest/host_work.py``."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from typing import Iterator, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TAG = "RESULT "


@contextlib.contextmanager
def worktree_at(commit: str, prefix: str) -> Iterator[str]:
    """A detached worktree of ``commit`` for the ``with`` block, removed after."""
    path = tempfile.mkdtemp(prefix=prefix)
    subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", path, commit], check=True,
                   capture_output=True)  # fmt: skip
    try:
        yield path
    finally:
        subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", path],
                       capture_output=True)  # fmt: skip


def run_driver(root: str, module_dir: str, call: str, *, extra_paths: Sequence[str] = (),
               timeout: float = 1800, cwd: str = ROOT) -> dict:
    """``import <module>; <call>`` (``call`` returns a JSON-able result) in a subprocess on the
    tree at ``root``: ``sys.path`` starts with ``module_dir`` (where the driver module lives),
    ``root/python`` and ``extra_paths``. Its last ``RESULT`` line, parsed."""
    paths = [os.path.join(root, "python"), *extra_paths]
    module = call.split(".", 1)[0]
    code = (f"import json, sys; sys.path[:0] = {paths!r}; sys.path.insert(0, {module_dir!r}); "
            f"import {module}; print({TAG!r} + json.dumps({call}))")  # fmt: skip
    env = dict(os.environ, PYTHONPATH=os.path.join(root, "python"))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=cwd)  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(TAG)]
    if proc.returncode or not lines:
        raise RuntimeError(f"driver at {root} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return json.loads(lines[-1][len(TAG):])
