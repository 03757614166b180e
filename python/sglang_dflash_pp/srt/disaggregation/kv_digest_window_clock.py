"""When a transfer worker's digest step fits inside the transfer it is waiting for
(``kv_digest_send._digest_window``): what this prefill rank has seen of its own link and of its
own steps, learned while serving, nothing to configure.

A worker that digests inside a transfer it submitted asynchronously delays the chunk by
whatever of that work outlasts the transfer: the bytes have landed and the worker is still
busy. On the H200 host a window's steps (resolving the queued sends, one engine call) take
0.1-0.5 ms each, the Kimi-K3 chunk's transfers 0.5-0.75 ms at 50 GB/s (``benchmark/gpu/results``):
on a slower host or a faster link the sum no longer fits. So a step starts only where its
expected time ends before the transfer's bytes are expected to land; what does not fit waits
for the next window, or for the room's status, which digests the rest.

* The link: each window transfer the worker waited for (its steps ended before the bytes
  landed) gives its rate, bytes over submit-to-landing; one the steps outlasted gives a lower
  bound (bytes over submit-to-steps-end). Both feed one moving estimate; none yet: every step
  fits (the first windows learn).
* A step: the moving average of that step kind's own durations; none yet: it fits.

No sglang import.
"""

from __future__ import annotations

import time
from typing import Dict, Optional

# A status wait this long means the worker waited for the bytes (it returned at their landing,
# Mooncake's wait polls): the transfer's time is observed. Shorter: the steps outlasted it.
WAITED_S = 20e-6
SMOOTHING = 0.25  # weight of the newest sample in each moving estimate


class WindowClock:
    def __init__(self):
        self.link_bps: Optional[float] = None
        self.step_s: Dict[str, float] = {}

    def deadline(self, t_submit: float, nbytes: int) -> Optional[float]:
        """When a transfer submitted at ``t_submit`` is expected to land (None: not known yet)."""
        return None if not self.link_bps else t_submit + nbytes / self.link_bps

    def fits(self, step: str, deadline: Optional[float]) -> bool:
        """Whether a ``step`` started now is expected to end by ``deadline``."""
        if deadline is None:
            return True
        expected = self.step_s.get(step)
        return expected is None or time.perf_counter() + expected <= deadline

    def took(self, step: str, seconds: float) -> None:
        old = self.step_s.get(step)
        self.step_s[step] = seconds if old is None else old + SMOOTHING * (seconds - old)

    def landed(self, nbytes: int, t_submit: float, t_steps_end: float, t_return: float) -> None:
        """A window transfer's times: submitted, the worker's steps ended, its status returned."""
        if nbytes <= 0:
            return
        if t_return - t_steps_end >= WAITED_S:
            rate = nbytes / max(t_return - t_submit, 1e-9)
        else:  # the bytes landed before the steps ended: at least this fast
            bound = nbytes / max(t_steps_end - t_submit, 1e-9)
            if self.link_bps is not None and self.link_bps >= bound:
                return
            rate = bound
        old = self.link_bps
        self.link_bps = rate if old is None else old + SMOOTHING * (rate - old)
