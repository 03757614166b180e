"""Test support: the in-tree patch series, generated once per test session.

``test/srt/test_export_patches.py`` and ``test/e2e/test_patched_tree_pd_dflash.py`` both read the
series ``export-patches`` writes onto a copy of the installed sglang laid out as sglang's
repository (``<root>/python/sglang``; the moved tests land in ``<root>/test/registered``).
Generating it takes about 35 s on the 2-core CI box, so a session generates it once (the
``exported_series`` fixture of ``test/conftest.py``), for whichever module asks first; each module
still runs alone. A test that checks out an earlier commit of the scratch repository restores
``HEAD`` after it; nothing else writes to the tree.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from types import SimpleNamespace


def installed_sglang() -> str:
    """The installed package directory (the wheel's ``sglang/``), without importing it."""
    return importlib.util.find_spec("sglang").submodule_search_locations[0]


def generate(workdir: str) -> SimpleNamespace:
    """The generator on a copy of the installed sglang (bytecode kept: copy2 keeps mtimes).

    ``root``: the scratch repository (sglang's layout); ``tree``: its ``python/sglang``;
    ``out``: the patches and ``report.json``; ``log``: what the generator printed."""
    from sglang_dflash_pp.tools.export_patches import generator

    root = os.path.join(workdir, "tree")
    tree = os.path.join(root, "python", "sglang")
    shutil.copytree(installed_sglang(), tree, symlinks=True)
    out = os.path.join(workdir, "series")
    log = []
    report = generator.export(root, out, log=log.append)
    return SimpleNamespace(root=root, tree=tree, out=out, report=report, log="\n".join(log))
