"""Where a rank computes KV digests (``kv_digest``): the GPU kernel on a CUDA pool, numpy over
host memory on a CPU pool. Built at startup, with everything the GPU path needs preallocated
and its kernel compiled, so no digest allocates, compiles or captures while serving.

One engine per KV manager; its calls are serialised by a lock (sglang's transfer workers run in
several threads, and a digest is a few microseconds of kernel on the GPU path).

A digest is submitted and its sums read later (:meth:`DigestEngine.submit`, a :class:`Sums`):
on the GPU the submit returns once the kernel is queued, so a transfer worker that digests
inside its transfers never waits there for the GPU; on the host the sums are computed at the
submit. Either way ``result()`` returns the per-slot uint64 sums or raises what the digest
raised.

No sglang import.
"""

from __future__ import annotations

import os
import threading
from typing import Optional, Sequence

import numpy as np

from sglang_dflash_pp.srt.disaggregation.kv_digest import Blocks, digest_blocks_host

MAX_BLOCKS_ENV = "SGLANG_DFLASH_KV_DIGEST_MAX_BLOCKS"
MAX_SLOTS = 8192  # decode buffers one digest can name: KV entries + state components
DEFAULT_MAX_BLOCKS = 65536  # per kernel launch; more are digested in pieces


class DigestEngine:
    def __init__(self, device, max_blocks: int = 0, max_slots: int = MAX_SLOTS, lanes: int = 1):
        import torch

        self.device = torch.device(device)
        self._lock = threading.Lock()
        self._gpu = None
        if self.device.type == "cuda":
            from sglang_dflash_pp.srt.disaggregation.kv_digest_triton import DeviceDigest

            blocks = max_blocks or int(os.environ.get(MAX_BLOCKS_ENV, DEFAULT_MAX_BLOCKS))
            self._gpu = DeviceDigest(self.device, blocks, max_slots, lanes=lanes)
            self._gpu.warm()

    @property
    def on_gpu(self) -> bool:
        return self._gpu is not None

    def submit(self, blocks: Blocks, keys: Sequence[int], wait_events=()) -> "Sums":
        """The per-slot sums (uint64) of ``blocks``, to be read with ``result()``;
        ``wait_events`` are the CUDA events after which the source bytes are written (the
        chunk's KV-write events, ``kv_write_fence``). Raises only where nothing was started
        (too many keys for the GPU's buffers)."""
        with self._lock:
            if self._gpu is not None:
                return self._gpu.submit(blocks, keys, wait_events=wait_events)
            try:
                return Sums(digest_blocks_host(blocks, keys))
            except Exception as e:  # noqa: BLE001 - raised where the GPU path raises: the result
                return Sums(error=e)

    def digest(self, blocks: Blocks, keys: Sequence[int], wait_events=()) -> np.ndarray:
        """:meth:`submit`, then its result."""
        return self.submit(blocks, keys, wait_events).result()

    def describe(self) -> str:
        if self._gpu is None:
            return "host (numpy)"
        return (f"Triton kernel on {self.device}, {len(self._gpu.lanes)} lane(s) of "
                f"{self._gpu.nbytes / len(self._gpu.lanes) / (1 << 20):.1f} MiB pinned and as much "
                "on the GPU")


def unsupported_state(kv_args) -> Optional[str]:
    """Why a rank's state cannot be digested (only Mamba / KDA state is), or None."""
    names = [getattr(st, "name", str(st)) for st in getattr(kv_args, "state_types", []) or []]
    other = [n for n in names if n != "MAMBA"]
    if other:
        return (
            f"the composed KV digest covers KV entries and Mamba/KDA state; this pool also "
            f"transfers {', '.join(other)} state. Run without --disaggregation-enable-kv-checksum."
        )
    return None


class Sums:
    """Sums already computed (the host path), read as the GPU path's ``DeviceSums`` is."""

    __slots__ = ("_value", "_error")

    def __init__(self, value: Optional[np.ndarray] = None, error: Optional[BaseException] = None):
        self._value, self._error = value, error

    def done(self) -> bool:
        return True

    def result(self) -> np.ndarray:
        if self._error is not None:
            raise self._error
        return self._value
