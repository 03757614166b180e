"""Peer processes that talk JSON lines: spawn, talk to, and always clean up.

One owner for the protocol that ``preflight`` (its per-stage, last-stage and decode processes),
the draft-KV transfer benchmark and the Mooncake loopback test use between a parent and the peer
processes it starts (each side of a Mooncake transfer must be its own process).

Protocol: a peer writes one JSON object per line to stdout, prefixed ``@@`` (anything else on
stdout is ignored; stderr goes to a log file), and the parent writes JSON lines to the peer's
stdin. ``preflight`` tags every message with a ``kind`` (:func:`send`): ``progress`` (printed by
the parent), ``error`` (the child failed; the parent stops), or any other kind the parent waits
for (:class:`Children`). The benchmark and the test use plain request / reply
(:meth:`PeerProcess.ask`, :func:`write_message`).

Cleanup: every child starts in its own session (its own process group), so the parent can end
the child and anything it started with one ``killpg`` by the child's own pid, on every exit path;
a child also asks the kernel to kill it if the parent dies first (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import json
import os
import select
import selectors
import signal
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional

PREFIX = "@@"


# -- child side ------------------------------------------------------------------------------


def child_setup() -> None:
    """Die with the parent (Linux), and keep each child to one intra-op thread: several run at
    once on a small CPU box, and OpenMP spin-waits would dominate their tiny tensors."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def write_message(obj) -> None:
    """Write one message to the parent."""
    sys.stdout.write(PREFIX + json.dumps(obj, default=str) + "\n")
    sys.stdout.flush()


def send(kind: str, **payload) -> None:
    write_message(dict(kind=kind, **payload))


def progress(message: str) -> None:
    send("progress", message=message)


def read_command() -> dict:
    line = sys.stdin.readline()
    if not line:
        raise SystemExit("the parent process closed the pipe")
    return json.loads(line)


def run_child(main: Callable[[], None]) -> None:
    """Run ``main``; report any exception as an ``error`` message and exit non-zero."""
    child_setup()
    try:
        main()
    except SystemExit:
        raise
    except BaseException as e:  # report everything, including KeyboardInterrupt
        import traceback

        traceback.print_exc()
        send("error", message=f"{type(e).__name__}: {e}")
        sys.stderr.flush()
        os._exit(1)


# -- parent side -----------------------------------------------------------------------------


class ChildFailed(RuntimeError):
    pass


class PeerProcess:
    def __init__(self, name: str, argv: List[str], env: Dict[str, str], log_path: str):
        self.name = name
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=env,
            bufsize=0,
            start_new_session=True,
        )
        self.inbox: List[dict] = []
        self.closed = False
        self._partial = b""

    def write(self, obj: dict) -> None:
        self.proc.stdin.write((json.dumps(obj) + "\n").encode())
        self.proc.stdin.flush()

    def read_lines(self) -> Optional[List[str]]:
        """Complete lines available now (raw reads: a buffered reader would hide lines from
        ``select``); None at end of file."""
        data = os.read(self.proc.stdout.fileno(), 1 << 16)
        if not data:
            return None
        self._partial += data
        *lines, self._partial = self._partial.split(b"\n")
        return [ln.decode(errors="replace") for ln in lines]

    def read(self, timeout: float) -> dict:
        """The next message, waiting at most ``timeout`` seconds (for a parent talking to one
        peer at a time; :class:`Children` reads several together)."""
        deadline = time.monotonic() + timeout
        while not self.inbox:
            if self.closed:
                raise ChildFailed(
                    f"{self.name} exited (code {self.proc.poll()}); its log:\n{self.log_tail()}"
                )
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.name} gave no answer; its log:\n{self.log_tail()}")
            ready, _, _ = select.select([self.proc.stdout], [], [], min(left, 1.0))
            if not ready:
                continue
            lines = self.read_lines()
            if lines is None:
                self.closed = True
                continue
            self.inbox += [json.loads(ln[len(PREFIX) :]) for ln in lines if ln.startswith(PREFIX)]
        return self.inbox.pop(0)

    def ask(self, obj: dict, timeout: float) -> dict:
        self.write(obj)
        return self.read(timeout)

    def close(self, goodbye: Optional[dict] = None, timeout: float = 10) -> None:
        """Send ``goodbye`` (if any) and give the peer ``timeout`` seconds to exit, then
        :meth:`kill` whatever is left."""
        if goodbye is not None and self.proc.poll() is None:
            try:
                self.write(goodbye)
                self.proc.wait(timeout=timeout)
            except Exception:
                pass
        self.kill()

    def log_tail(self, n: int = 3000) -> str:
        self._log.flush()
        try:
            with open(self.log_path) as f:
                return f.read()[-n:]
        except OSError:
            return ""

    def kill(self) -> None:
        """End the child's whole process group (its pid is the group id), then reap it."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except Exception:
                pass
        self._log.close()


class Children:
    """All children of one run, read together; killed together by :meth:`kill_all`."""

    def __init__(self, deadline: float, on_progress: Callable[[str, str], None]):
        self.deadline = deadline
        self.on_progress = on_progress
        self.children: Dict[str, PeerProcess] = {}
        self._sel = selectors.DefaultSelector()

    def spawn(
        self, name: str, argv: List[str], env: Dict[str, str], log_path: str
    ) -> PeerProcess:
        child = PeerProcess(name, argv, env, log_path)
        self.children[name] = child
        self._sel.register(child.proc.stdout, selectors.EVENT_READ, child)
        return child

    def wait_for(self, name: str, *kinds: str) -> dict:
        """The next message of one of ``kinds`` from child ``name`` (others stay queued)."""
        child = self.children[name]
        kind = " or ".join(repr(k) for k in kinds)
        while True:
            for i, msg in enumerate(child.inbox):
                if msg["kind"] in kinds:
                    return child.inbox.pop(i)
            if child.closed:
                raise ChildFailed(
                    f"{name} exited (code {child.proc.poll()}) before sending {kind}; its log:\n"
                    + child.log_tail()
                )
            self._pump()

    def _pump(self) -> None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("preflight ran past its --timeout")
        for key, _ in self._sel.select(timeout=min(left, 1.0)):
            child: PeerProcess = key.data
            lines = child.read_lines()
            if lines is None:
                self._sel.unregister(child.proc.stdout)
                child.closed = True
                child.proc.wait(timeout=30)
                continue
            for line in lines:
                if not line.startswith(PREFIX):
                    continue
                msg = json.loads(line[len(PREFIX) :])
                if msg["kind"] == "progress":
                    self.on_progress(child.name, msg["message"])
                elif msg["kind"] == "error":
                    raise ChildFailed(f"{child.name} failed: {msg['message']}\n{child.log_tail()}")
                else:
                    child.inbox.append(msg)

    def kill_all(self) -> None:
        for child in self.children.values():
            try:
                self._sel.unregister(child.proc.stdout)
            except (KeyError, ValueError):
                pass
            child.kill()
        self.children.clear()


def loopback_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """The environment of every child: Mooncake over TCP bound to 127.0.0.1, quiet logs."""
    env = dict(os.environ)
    env.pop("SGLANG_USE_CPU_ENGINE", None)  # it would switch sglang to a CPU-kernel build
    env.update(
        MOONCAKE_PROTOCOL="tcp",
        MC_FORCE_TCP="1",
        MC_TCP_BIND_ADDRESS="127.0.0.1",
        GLOG_minloglevel="2",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    env.update(extra or {})
    return env
