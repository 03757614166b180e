"""Suite-wide policy: a skipped test does not count as passing (house rule 3), and no test runs
on an installed sglang that is not the series as it stands (``pytest_sessionstart``). The
series exported onto the wheel's own tree, once per session (``exported_series``). And the
``flashinfer`` stub (``cpu_servers.write_flashinfer_stub``: a CUDA-only library, about 3 s of
each sglang process's startup on this box), first on this session's ``sys.path`` and on the
``PYTHONPATH`` every process it starts inherits, before anything imports sglang."""

from __future__ import annotations

import atexit
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from types import SimpleNamespace

import pytest

import cpu_servers

STUB_ROOT = cpu_servers.write_flashinfer_stub(tempfile.mkdtemp(prefix="sglang-dflash-pp-stubs-"))
atexit.register(shutil.rmtree, STUB_ROOT, True)
sys.path.insert(0, STUB_ROOT)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [STUB_ROOT, os.environ.get("PYTHONPATH")]))


def pytest_sessionfinish(session, exitstatus):
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = len(reporter.stats.get("skipped", [])) if reporter else 0
    if skipped and exitstatus == 0:
        reporter.write_line(
            f"{skipped} test(s) were skipped; a skipped test does not count as passing. "
            "Install what the skip reason names.",
            red=True,
        )
        session.exitstatus = 1


STALE = "run `sglang-dflash-pp install` (or scripts/setup-dev.sh)"


def pytest_sessionstart(session):
    """Every test serves the installed sglang, so it must be the series of this checkout: an
    edit of series/ or python/sglang/ not installed yet would be tested as the old code. Reads
    two files (sglang is not imported)."""
    from sglang_dflash_pp.patch_series.install import STATE_FILE
    from sglang_dflash_pp.patch_series.series import fingerprint

    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        pytest.exit(f"sglang is not installed in this environment: {STALE}", returncode=4)
    site = os.path.dirname(list(spec.submodule_search_locations)[0])
    state_path = os.path.join(site, STATE_FILE)
    if not os.path.isfile(state_path):
        pytest.exit(f"the sglang at {site} carries no patch series ({STATE_FILE} is missing): "
                    f"{STALE}", returncode=4)
    with open(state_path) as f:
        installed = json.load(f).get("fingerprint")
    if installed != fingerprint():
        pytest.exit(f"the sglang at {site} carries another version of the patch series "
                    f"(installed {installed}, this checkout {fingerprint()}): {STALE}",
                    returncode=4)


@pytest.fixture(scope="session")
def exported_series(tmp_path_factory):
    """``export-patches`` onto the wheel's own sglang, once per session: the installed package
    copied to ``<root>/python/sglang`` (sglang's repository layout), the upstream files the
    installer changed restored from its pristine copies and the files it added removed, so
    the base commit is the release as shipped. ``root``: the scratch repository, at the
    series' HEAD; ``base``: its base commit; ``out``: the patches and report.json."""
    from sglang_dflash_pp.patch_series.export import export
    from sglang_dflash_pp.patch_series.install import (
        PRISTINE_DIR,
        installed_package,
        read_state,
    )

    site = installed_package().parent
    state = read_state(site)
    work = tmp_path_factory.mktemp("export")
    root = work / "tree"
    shutil.copytree(site / "sglang", root / "python" / "sglang",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for path in state["upstream"]:
        shutil.copyfile(site / PRISTINE_DIR / path, root / path)
    for path in state["added"]:
        (root / path).unlink()
    log = []
    report, failure = export(str(root), str(work / "patches"), log=log.append)
    if failure is not None:
        pytest.fail(f"export-patches stopped: {failure.message()}", pytrace=False)
    return SimpleNamespace(site=site, state=state, root=root, base=report["base"],
                           out=work / "patches", report=report, log="\n".join(log))
