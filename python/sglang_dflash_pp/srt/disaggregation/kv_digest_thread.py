"""The thread a prefill rank computes its KV digest on, beside sglang's transfer workers.

A transfer worker spends most of a chunk inside Mooncake's ``batch_transfer_sync``, which
releases the GIL while the bytes move. The digest's host work (resolving descriptors into
blocks, one engine call per batch of them) therefore runs here, during the transfers it
verifies, instead of before them on the worker: the worker only hands over references
(:meth:`DigestThread.submit`) and waits once per room, just before the room's status goes out
(:meth:`DigestThread.wait`), for what the thread has not finished yet. Jobs run in submission
order, so a room's sums are complete when every job submitted before that wait has run.

The thread runs only inside such windows: a worker opens one around a transfer it enters
(:meth:`DigestThread.window`, which also wakes the thread) and around its wait for the thread
(:meth:`DigestThread.wait`); between jobs the thread checks that a window is still open and
otherwise stops until the next. A worker back from its transfer therefore waits for the GIL at
most for the job the thread is in, not for everything queued (CPython hands the GIL over only
when its holder blocks, or after ``sys.getswitchinterval()``, 5 ms). With no window for
``IDLE_S`` it runs anyway (the workers are idle then too).

Started at startup, a daemon; it never touches the GPU itself except through what its jobs do.
No sglang import.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable, Deque, Tuple

logger = logging.getLogger(__name__)


IDLE_S = 0.05  # no transfer this long: the workers are idle, the thread need not wait for one


class DigestThread:
    def __init__(self, name: str):
        self._jobs: Deque[Tuple[Callable, tuple]] = collections.deque()  # append/popleft: atomic
        self._wake = threading.Event()
        self._open: list = []  # one item per open window (list append/pop: atomic)
        self._busy = False
        self.busy_s = 0.0  # time spent in jobs (the benchmark reads it)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable, *args) -> None:
        """Run ``fn(*args)`` on the thread after every job submitted before it (at the next
        transfer or wait). A job that raises is logged; it must itself fail whatever depends on
        it (the digest's jobs fail their rooms)."""
        self._jobs.append((fn, args))

    def wait(self, timeout_s: float) -> bool:
        """Block until every job submitted before this call has run; False on timeout (the
        thread stuck or gone: the caller fails the rooms it waited for, never hangs)."""
        done = threading.Event()
        self._jobs.append((done.set, ()))
        self._open.append(None)  # this worker holds no GIL while it waits
        try:
            self._wake.set()
            return done.wait(timeout_s)
        finally:
            self._open.pop()

    def window(self) -> "_Window":
        """``with thread.window(): <a call that releases the GIL>``: the thread may run queued
        jobs while it lasts."""
        return _Window(self)

    def wake(self) -> None:
        """Run what is queued, if a window is open."""
        if self._jobs:
            self._wake.set()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def idle(self) -> bool:
        """Every job submitted so far has run (``_busy`` is set before a job is taken)."""
        return not self._busy and not self._jobs

    def _run(self) -> None:
        while True:
            idle = not self._wake.wait(IDLE_S)  # no window for IDLE_S: the workers are idle
            self._wake.clear()
            self._busy = True
            while self._jobs and (idle or self._open):
                fn, args = self._jobs.popleft()
                self._timed(fn, *args)
            self._busy = False

    def _timed(self, fn: Callable, *args) -> None:
        t0 = time.perf_counter()
        try:
            fn(*args)
        except BaseException:  # a job's own failure path has run; keep serving the rest
            logger.exception("KV digest job %r failed", getattr(fn, "__name__", fn))
        self.busy_s += time.perf_counter() - t0


class _Window:
    __slots__ = ("_thread",)

    def __init__(self, thread: DigestThread):
        self._thread = thread

    def __enter__(self):
        self._thread._open.append(None)
        self._thread.wake()

    def __exit__(self, *exc):
        self._thread._open.pop()
        return False
