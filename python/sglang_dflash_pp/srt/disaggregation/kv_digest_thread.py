"""The thread a prefill rank computes its KV digest on, beside sglang's transfer workers.

A transfer worker spends most of a chunk inside Mooncake's ``batch_transfer_sync``, which
releases the GIL while the bytes move. The digest's host work (resolving descriptors into
blocks, one engine call per batch of them) therefore runs here, during the transfers it
verifies, instead of before them on the worker: the worker only hands over references
(:meth:`DigestThread.submit`) and waits once per room, just before the room's status goes out
(:meth:`DigestThread.wait`), for what the thread has not finished yet. Jobs run in submission
order, so a room's sums are complete when every job submitted before that wait has run.

The thread is woken only when a worker enters a transfer with jobs queued
(:meth:`DigestThread.wake`) or waits for it, and then runs every queued job: each
wake-up hands the GIL over twice, and a worker that wakes from a transfer while this thread
holds the GIL waits for it, so the thread runs in few, long stretches inside the workers'
GIL-free waits, not once per job. With no such wake-up for ``IDLE_S`` it runs anyway (the
workers are idle then too).

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
        self.wake()  # this worker holds no GIL while it waits
        return done.wait(timeout_s)

    def wake(self) -> None:
        """A worker is about to wait without the GIL (a transfer): run what is queued."""
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
            self._wake.wait(IDLE_S)
            self._wake.clear()
            self._busy = True
            while self._jobs:
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
