"""Which chunk a Mooncake transfer worker thread is sending: its room and its KV-write events.

sglang's transfer worker sends a chunk to each of its decode ranks in turn through
``send_kvcache`` / ``send_kvcache_slice`` / ``maybe_send_extra``, none of which is told the
chunk. ``mooncake_draft_kv``'s worker hook marks the chunk it hands out; the draft packs and the
KV digest (``kv_digest_send``) read it here. One owner for "this thread's chunk", so the two never
disagree about it.

No sglang import.
"""

from __future__ import annotations

import threading
from typing import Optional, Tuple

from sglang_dflash_pp.srt.disaggregation.kv_write_fence import cuda_event_of

_worker = threading.local()


def begin(manager, chunk) -> None:
    """This thread now sends ``chunk`` (a ``TransferKVChunk``, or None) for ``manager``."""
    _worker.manager, _worker.chunk = manager, chunk
    _worker.memo = {}
    # sglang synchronises and drops the chunk's wait_event before the sends; keep its events
    # for the readers on side streams (the pack, the digest: kv_write_fence).
    _worker.written = cuda_event_of(getattr(chunk, "wait_event", None))


def end() -> None:
    _worker.manager = _worker.chunk = None
    _worker.written = ()
    _worker.memo = {}


def memo() -> dict:
    """A dict that lives as long as this thread's current chunk (what its sends to several
    decode ranks can share)."""
    m = getattr(_worker, "memo", None)
    if m is None:
        m = _worker.memo = {}
    return m


def chunk_of(manager):
    """The chunk this thread sends for ``manager``, or None outside a worker chunk."""
    chunk = getattr(_worker, "chunk", None)
    if chunk is None or getattr(_worker, "manager", None) is not manager:
        return None
    return chunk


def chunk_manager():
    """The manager this thread's current chunk belongs to, or None."""
    if getattr(_worker, "chunk", None) is None:
        return None
    return getattr(_worker, "manager", None)


def room_of(manager) -> Optional[int]:
    chunk = chunk_of(manager)
    return None if chunk is None else chunk.room


def written() -> Tuple:
    """The CUDA events after which this thread's chunk's KV is written (empty on CPU)."""
    return getattr(_worker, "written", ())
