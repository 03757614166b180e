"""Apply the series to the sglang installed in this environment, in place.

``scripts/setup-dev.sh`` runs it after installing the pinned wheel, so ``python -m
sglang.launch_server`` is the patched server and every test serves the code that goes upstream.
The first run keeps a copy of every upstream file it changes, as the wheel shipped it, under
``<site-packages>/sglang_series_pristine/``; each run starts from those copies, removes the files
an earlier run added, and writes ``<site-packages>/sglang_series.json`` (the series' fingerprint,
the files written). Running it again after editing the series is how a developer updates the
environment; the tests refuse to start on a stale one.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Optional

from sglang_dflash_pp.patch_series.series import (
    PACKAGE_PATH,
    apply_series,
    fingerprint,
    load_series,
)

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

    def upstream_path(repo_path: str) -> Path:  # python/sglang/x -> <site>/sglang/x
        return site / repo_path[len("python/") :]

    for repo_path in previous["added"]:
        upstream_path(repo_path).unlink(missing_ok=True)
    for repo_path in previous["upstream"]:
        shutil.copyfile(pristine / repo_path, upstream_path(repo_path))

    def read(repo_path: str) -> Optional[str]:
        if not repo_path.startswith(PACKAGE_PATH + "/"):
            return None
        path = upstream_path(repo_path)
        return path.read_text() if path.is_file() else None

    prs = load_series(upto)
    tree = apply_series(prs, read)
    upstream, added = [], []
    for repo_path, text in sorted(tree.items()):
        if not repo_path.startswith(PACKAGE_PATH + "/"):
            continue  # tests stay in this repository
        target = upstream_path(repo_path)
        if target.is_file():
            saved = pristine / repo_path
            if not saved.is_file():
                saved.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(target, saved)
            upstream.append(repo_path)
        else:
            added.append(repo_path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    state = {
        "fingerprint": fingerprint(),
        "prs": [pr.name for pr in prs],
        "upstream": upstream,
        "added": added,
    }
    (site / STATE_FILE).write_text(json.dumps(state, indent=1) + "\n")
    log(
        f"sglang at {package}: {len(prs)} PRs of the series applied "
        f"({len(upstream)} upstream files changed, {len(added)} added)"
    )
    return state


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m sglang_dflash_pp.patch_series.install",
        description="Apply the patch series to the sglang installed in this environment.",
    )
    p.add_argument("--upto", help="stop after this PR (its number or file name)")
    args = p.parse_args(argv)
    os.environ.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    install(args.upto)
    return 0


if __name__ == "__main__":
    sys.exit(main())
