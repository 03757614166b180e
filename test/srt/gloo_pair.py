"""Run a two-rank gloo script (``script RANK PORT OUT_DIR``) as two processes and wait for both.

``SGLANG_USE_CPU_ENGINE`` is dropped from their environment: sglang freezes its CPU-engine flag
at import, and the scripts pick the torch paths themselves."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def run_pair(script: str, out_dir, *, timeout_s: float = 300.0) -> None:
    """Both ranks of ``script`` (a file next to this one); raises with a rank's output tail if
    either fails."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_USE_CPU_ENGINE"}
    procs = [
        subprocess.Popen([sys.executable, os.path.join(HERE, script), str(rank), port,
                          str(out_dir)], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
        for rank in (0, 1)
    ]  # fmt: skip
    try:
        outputs = [p.communicate(timeout=timeout_s)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"{script} rank {rank} failed:\n{out[-4000:]}"
