"""End-to-end deployments of real SGLang servers on this CPU box (``test/cpu_servers.py``).

Each test module starts its deployments once (module scope) and tears them down at its end, so
only one module's servers share the 2 cores and 24 GB at a time. Startup wall times are recorded
and printed at the end of the session.
"""

from __future__ import annotations

import os
import sys
from typing import Dict, List

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
TEST_ROOT = os.path.dirname(HERE)
for path in (TEST_ROOT, os.path.join(TEST_ROOT, "srt")):
    if path not in sys.path:
        sys.path.insert(0, path)

import cpu_servers  # noqa: E402

STARTUP_TIMEOUT_S = float(os.environ.get("SGLANG_DFLASH_PP_TEST_STARTUP_TIMEOUT_S", "300"))
_startup_times: List[Dict] = []


def record_startup(deployment: str, servers) -> None:
    for s in servers:
        _startup_times.append(
            {"deployment": deployment, "server": s.name, "ready_after_s": s.ready_after_s}
        )


def pytest_terminal_summary(terminalreporter):
    if not _startup_times:
        return
    terminalreporter.section("end-to-end server startup (wall time to ready)")
    for row in _startup_times:
        ready = row["ready_after_s"]
        shown = "not ready" if ready is None else f"{ready:6.1f} s"
        terminalreporter.write_line(f"{row['deployment']:>24}  {row['server']:<28} {shown}")


@pytest.fixture(scope="session")
def e2e_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("e2e"))


@pytest.fixture(scope="session")
def stub_root(e2e_root):
    return cpu_servers.write_vllm_stub(os.path.join(e2e_root, "stub"))


class Deployment:
    """Named server processes started together; killed together."""

    def __init__(self, name: str):
        self.name = name
        self.servers: Dict[str, cpu_servers.ServerProcess] = {}

    def add(self, server: cpu_servers.ServerProcess) -> cpu_servers.ServerProcess:
        self.servers[server.name] = server
        return server

    def __getitem__(self, name: str) -> cpu_servers.ServerProcess:
        return self.servers[name]

    def wait(self, names=None, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        chosen = [self.servers[n] for n in (names or list(self.servers))]
        try:
            cpu_servers.wait_all(chosen, timeout_s)
        except BaseException:
            self.kill()
            raise
        finally:
            record_startup(self.name, chosen)

    def kill(self) -> None:
        for s in self.servers.values():
            s.kill()
