"""How the emulated link's transfers wait out their bytes' time (``kv_digest_cost``,
``kv_digest_timeline``): asleep, or spinning without the GIL as Mooncake's own wait does.

Mooncake's Python binding waits for a transfer in a loop that polls the batch's status with
the GIL released and never sleeps (``TransferEnginePy::batchTransferSync`` and
``getBatchTransferStatus`` in ``mooncake-integration/transfer_engine/transfer_engine_py.cpp``,
0.3.x). A ``time.sleep`` releases the GIL too, but it takes the thread off its core and wakes
it later than asked (timer slack, ~50-70 us a transfer on the H200 host).
:func:`spin_until` keeps the thread on its core: a C loop on ``CLOCK_MONOTONIC`` (the clock of
``time.perf_counter`` on Linux), called through ``ctypes``, which releases the GIL for the call.
It is compiled at first use with the machine's C compiler (Triton's launchers need one too);
where none is found, :func:`spin_until` is None and the callers run the sleeping wait only.

Benchmark support only: nothing in the plugin imports it.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Callable, Optional

_SOURCE = r"""
#include <time.h>
void spin_until(double deadline) {
    struct timespec ts;
    for (;;) {
        clock_gettime(CLOCK_MONOTONIC, &ts);
        if ((double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec >= deadline) return;
    }
}
"""


# How each way of waiting is named where results are rendered.
HOW = {"sleep": "each transfer waiting asleep",
       "spin": "each transfer waiting on its core, as Mooncake's polling wait does"}


def sleep_until(deadline: float) -> None:
    """Wait asleep (``time.sleep``, the GIL released) until ``time.perf_counter()`` reaches
    ``deadline``."""
    left = deadline - time.perf_counter()
    if left > 0:
        time.sleep(left)


def _compile() -> Optional[Callable[[float], None]]:
    if not sys.platform.startswith("linux") or time.get_clock_info("perf_counter").implementation != (
            "clock_gettime(CLOCK_MONOTONIC)"):  # fmt: skip
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return None
    d = tempfile.mkdtemp(prefix="link_wait_")
    src, lib = os.path.join(d, "spin.c"), os.path.join(d, "spin.so")
    with open(src, "w") as f:
        f.write(_SOURCE)
    try:
        subprocess.run([cc, "-O2", "-shared", "-fPIC", src, "-o", lib], check=True,
                       capture_output=True, timeout=60)  # fmt: skip
        fn = ctypes.CDLL(lib).spin_until  # CDLL: the GIL is released for the call
    except (OSError, subprocess.SubprocessError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_double], None
    return fn


spin_until = _compile()


def describe() -> dict:
    return dict(
        sleep="time.sleep for what is left until the deadline (the GIL released, the thread off its core)",
        spin=("a C loop on clock_gettime(CLOCK_MONOTONIC) until the deadline, through ctypes (the GIL "
              "released, the thread on its core, as Mooncake's polling wait)") if spin_until else
             "not available (no C compiler, or perf_counter is not CLOCK_MONOTONIC)",
    )  # fmt: skip
