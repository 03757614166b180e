"""The export-patches import check in forked children (``import_server``) reports what a cold
subprocess reports: where sglang came from, modules that fail to import, in-tree code that still
imports our plugin, and a check that hangs, before and after the server loaded the third-party
modules of its first check.

The tree is a minimal ``sglang`` package written here (the prelude's ``load_plugins`` and
``HookRegistry`` and a few modules); the real series goes through the same server in
``test_export_patches.test_every_prefix_imports_its_touched_modules_without_the_plugin``.
"""

from __future__ import annotations

import os
import time

import pytest

from sglang_dflash_pp.tools.export_patches import verify
from sglang_dflash_pp.tools.export_patches.errors import ExportError
from sglang_dflash_pp.tools.export_patches.import_server import ImportServer, server_env

MODULES = {
    "__init__.py": "",
    "srt/__init__.py": "",
    "srt/plugins/__init__.py": "def load_plugins():\n    pass\n",
    "srt/plugins/hook_registry.py": "class HookRegistry:\n    _hooks = {}\n",
    # a third-party import the server loads after its first check, then shares with children
    "fine.py": "import json.decoder\nimport email.mime.text\nVALUE = 1\n",
    "broken.py": "raise ImportError('broken on purpose')\n",
    "needs_plugin.py": "import sglang_dflash_pp.srt\n",
    "hangs.py": "import time\ntime.sleep(60)\n",
    # output that is not a line, and a process left running: neither may stall the check
    "noisy.py": "import os\nos.write(1, b'partial')\nprint('IMPORT_CHECK {}')\n",
    "starts_a_process.py": (
        "import os, subprocess\n"
        "p = subprocess.Popen(['sleep', '60'])\n"
        "open(os.path.join(os.path.dirname(__file__), 'started.pid'), 'w').write(str(p.pid))\n"
    ),
}


def _tree(root: str, version: int) -> str:
    pkg = os.path.join(root, "sglang")
    for rel, text in MODULES.items():
        path = os.path.join(pkg, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    with open(os.path.join(pkg, "version.py"), "w") as f:
        f.write(f"VERSION = {version}\n")
    return pkg


def test_forked_checks_report_what_a_cold_check_reports(tmp_path):
    trees = [_tree(str(tmp_path / f"t{i}"), i) for i in range(2)]
    mods = ["sglang.fine", "sglang.version", "sglang.broken", "sglang.needs_plugin"]
    cold = verify.import_modules(trees[0], mods)
    server = ImportServer(verify._PRELUDE, server_env())
    try:
        # the first check (cold child), then forked ones after the preload, from other trees
        states = [verify.import_modules(t, mods, server=server) for t in trees + trees[::-1]]
        with pytest.raises(ExportError, match="ran past 2s and was killed"):
            verify.import_modules(trees[0], ["sglang.hangs"], timeout=2, server=server)
        after = verify.import_modules(trees[1], ["sglang.fine"], server=server)  # still serving
        t0 = time.monotonic()
        odd = verify.import_modules(trees[0], ["sglang.noisy", "sglang.starts_a_process"],
                                    timeout=30, server=server)  # fmt: skip
        took = time.monotonic() - t0
    finally:
        server.close()
    for state, tree in zip([cold] + states, trees[:1] + trees + trees[::-1]):
        assert state["from_tree"] and state["sglang_file"] == os.path.join(tree, "__init__.py")
        assert sorted(state["errors"]) == ["sglang.broken", "sglang.needs_plugin"]
        assert "broken on purpose" in state["errors"]["sglang.broken"]
        assert "must not need the plugin" in state["errors"]["sglang.needs_plugin"]
        assert state["hooks"] == [] and state["plugin_modules"] == []
    assert after["errors"] == {} and after["from_tree"]
    assert odd["errors"] == {} and odd["from_tree"] and took < 20
    with open(os.path.join(trees[0], "started.pid")) as f:
        started = int(f.read())
    for _ in range(50):  # killed with the child's process group
        try:
            os.kill(started, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the process the imports started outlived the check")


def test_a_server_that_dies_fails_the_check_naming_it(tmp_path):
    tree = _tree(str(tmp_path / "t"), 0)
    server = ImportServer(verify._PRELUDE, server_env())
    server._proc.kill()
    server._proc.wait()
    try:
        with pytest.raises(ExportError, match="import server exited"):
            verify.import_modules(tree, ["sglang.fine"], server=server)
    finally:
        server.close()
