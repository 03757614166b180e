"""Suite-wide policy: a skipped test does not count as passing (house rule 3). And the one
session-wide fixture both the export-patches tests and the patched-tree e2e test read."""

from __future__ import annotations

import pytest


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
