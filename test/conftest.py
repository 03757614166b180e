"""Suite-wide policy: a skipped test does not count as passing (house rule 3)."""

from __future__ import annotations


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
