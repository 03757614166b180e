"""Apply the series to the sglang installed in this environment, in place.

``scripts/setup-dev.sh`` runs it after installing the pinned wheel, so ``python -m
sglang.launch_server`` is the patched server and every test serves the code that goes upstream.
The patches go through ``git am`` exactly as on a fork: in a scratch repository holding the
wheel's own copies of the files they touch (kept under ``<site-packages>/sglang_series_pristine/``
on the first run), from which the results are copied into the package. Each run starts from
those copies, removes the files an earlier run added, and writes
``<site-packages>/sglang_series.json`` (the patches' fingerprint, the files written). Running it
again after changing ``patches/`` is how a developer updates the environment; the tests refuse
to start on a stale one.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Optional

from sglang_dflash_pp.patch_series.export import apply_patches, select
from sglang_dflash_pp.patch_series.git_repo import ScratchRepo
from sglang_dflash_pp.patch_series.series import PACKAGE_PATH, fingerprint

STATE_FILE = "sglang_series.json"
PRISTINE_DIR = "sglang_series_pristine"


def installed_package() -> Path:
    """The installed ``sglang`` package directory, found without importing it."""
    import importlib.util

    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("error: sglang is not installed in this environment")
    return Path(list(spec.submodule_search_locations)[0])


def read_state(site: Path) -> Optional[dict]:
    path = site / STATE_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def install(upto: Optional[str] = None, log=print) -> dict:
    package = installed_package()
    site = package.parent
    pristine = site / PRISTINE_DIR
    previous = read_state(site) or {"upstream": [], "added": []}

    def installed(repo_path: str) -> Path:  # python/sglang/x -> <site>/sglang/x
        return site / repo_path[len("python/"):]

    for repo_path in previous["added"]:
        installed(repo_path).unlink(missing_ok=True)
    for repo_path in previous["upstream"]:
        shutil.copyfile(pristine / repo_path, installed(repo_path))

    patches = select(upto)
    touched = sorted({p for patch in patches for p, new in patch.files
                      if not new and p.startswith(PACKAGE_PATH + "/")})
    with tempfile.TemporaryDirectory(prefix="sglang-series-install-") as scratch:
        for repo_path in touched:
            saved = pristine / repo_path
            if not saved.is_file():
                saved.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(installed(repo_path), saved)
            (Path(scratch) / repo_path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(saved, Path(scratch) / repo_path)
        repo = ScratchRepo(scratch)
        repo.ensure(None, lambda _: None)
        base = repo.head()
        _, failure = apply_patches(repo, patches)
        if failure is not None:
            raise SystemExit(f"error: {failure.message()}")
        changed = repo.git("diff", "--name-status", base, "HEAD", "--", PACKAGE_PATH)
        upstream, added = [], []
        for row in changed.splitlines():
            status, repo_path = row.split("\t")
            (added if status == "A" else upstream).append(repo_path)
            target = installed(repo_path)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(Path(scratch) / repo_path, target)
    state = {
        # A partial series is not the checkout's: the test session refuses it.
        "fingerprint": fingerprint() if upto is None else f"upto {upto}",
        "prs": [p.name for p in patches],
        "upstream": upstream,
        "added": added,
    }
    (site / STATE_FILE).write_text(json.dumps(state, indent=1) + "\n")
    log(f"sglang at {package}: {len(patches)} patches of the series applied "
        f"({len(upstream)} upstream files changed, {len(added)} added)")
    return state


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m sglang_dflash_pp.patch_series.install",
        description="Apply the patch series to the sglang installed in this environment.",
    )
    p.add_argument("--upto", help="stop after this patch (its number or file name)")
    args = p.parse_args(argv)
    os.environ.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    install(args.upto)
    return 0


if __name__ == "__main__":
    sys.exit(main())
