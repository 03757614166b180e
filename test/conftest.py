"""Suite-wide policy: a skipped test does not count as passing (house rule 3). The one
session-wide fixture both the export-patches tests and the patched-tree e2e test read. And the
``flashinfer`` stub (``cpu_servers.write_flashinfer_stub``: a CUDA-only library, about 3 s of
each sglang process's startup on this box), first on this session's ``sys.path`` and on the
``PYTHONPATH`` every process it starts inherits, before anything imports sglang."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile

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


@pytest.fixture(scope="session")
def exported_series(tmp_path_factory):
    """The in-tree patch series on a copy of the installed sglang, generated once per session
    (``test/patch_series.py``)."""
    import patch_series

    return patch_series.generate(str(tmp_path_factory.mktemp("export")))
