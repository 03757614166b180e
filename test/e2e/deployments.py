"""Deployments of real servers for the end-to-end tests: named processes started together, waited
for together (bounded), killed together, and their startup wall times recorded for the session
summary (``conftest.pytest_terminal_summary``)."""

from __future__ import annotations

import os
from typing import Dict, List

import cpu_servers

# The Llama deployment starts 11 server processes and 4 routers at once on CI's 2 cores: its TP2 x
# PP2 prefill was ready after 207 s on the dev box and 253 s on a clean CI run, past 300 s when
# the machine was also busy with other work, and one CI run took 2.2x the dev box's time over
# the whole suite; the bound only decides when a startup that hangs is called failed.
STARTUP_TIMEOUT_S = float(os.environ.get("SGLANG_DFLASH_PP_TEST_STARTUP_TIMEOUT_S", "720"))
startup_times: List[Dict] = []


def record_startup(deployment: str, servers) -> None:
    for s in servers:
        startup_times.append(
            {"deployment": deployment, "server": s.name, "ready_after_s": s.ready_after_s}
        )


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
