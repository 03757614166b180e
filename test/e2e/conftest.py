"""End-to-end deployments of real SGLang servers on this CPU box (``test/cpu_servers.py``).

Each test module starts its deployments once (module scope) and tears them down at its end, so
only one module's servers share the 2 cores and 24 GB at a time. Startup wall times are recorded
and printed at the end of the session.
"""

from __future__ import annotations

import os
import sys
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
TEST_ROOT = os.path.dirname(HERE)
for path in (TEST_ROOT, os.path.join(TEST_ROOT, "srt")):
    if path not in sys.path:
        sys.path.insert(0, path)

import cpu_servers  # noqa: E402
import deployments  # noqa: E402


def pytest_terminal_summary(terminalreporter):
    if cpu_servers.transport_stall_retries:
        terminalreporter.section("requests sent again after a Mooncake TCP transport stall")
        for row in cpu_servers.transport_stall_retries:
            terminalreporter.write_line(f"{row['url']}  rid={row['rid']}  "
                                        f"{row['after_s']} s after its first stall  {row['error']}")
            for line in row["reasons"]:
                terminalreporter.write_line(f"    {line}")
    if not deployments.startup_times:
        return
    terminalreporter.section("end-to-end server startup (wall time to ready)")
    for row in deployments.startup_times:
        ready = row["ready_after_s"]
        shown = "not ready" if ready is None else f"{ready:6.1f} s"
        terminalreporter.write_line(f"{row['deployment']:>24}  {row['server']:<28} {shown}")


@pytest.fixture(scope="session")
def e2e_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("e2e"))


@pytest.fixture(scope="session")
def stub_root(e2e_root):
    return cpu_servers.write_server_stubs(os.path.join(e2e_root, "stub"))
