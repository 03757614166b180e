"""The DFLASH draft KV pool behind a prefill rank's draft transfer entries: recorded by the
prefill setup (``prefill_draft_kv``, and ``preflight``), read by the send path
(``mooncake_draft_kv``), keyed by the entries' registered pointers.

``KVArgs`` carries the entries' pointers and item lengths but not the draft's geometry (total KV
heads, head dims, element size) nor the pool itself, which packing head slices reads, nor the
staging the packs write into (allocated, compiled and registered at startup).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from threading import Lock
from typing import Any, Dict, Optional, Tuple

import torch

from sglang_dflash_pp.srt.disaggregation.draft_kv_geometry import (
    DraftKVLayoutError,
    DraftKVShape,
)


@dataclass(frozen=True)
class DraftKVSource:
    """This prefill rank's draft KV pool, as the transfer layer needs it."""

    entry_ptrs: Tuple[int, ...]  # the draft entries' registered pointers, K0..K(L-1), V0..V(L-1)
    shape: Optional[DraftKVShape]
    shape_unknown_reason: Optional[str]
    pool_ref: Any  # weakref to the pool (the registry must not keep a torn-down pool alive)
    staging: Any = None  # draft_kv_staging.DraftKVStaging: built at startup where this rank packs

    def entry_rows(self, q: int):
        """Draft entry ``q``'s buffer as ``uint8 [token slots, row bytes]``."""
        pool = self.pool_ref()
        if pool is None:
            raise RuntimeError("the draft KV pool behind these transfer entries was released")
        buffers = list(pool.k_buffer) + list(pool.v_buffer)
        return as_byte_rows(buffers[q])


def as_byte_rows(t: torch.Tensor) -> torch.Tensor:
    """View a pool buffer ``[rows, ...]`` as ``uint8 [rows, row_bytes]`` without copying."""
    if not t.is_contiguous():
        raise ValueError("draft KV buffers must be contiguous to be packed by byte offset")
    return t.view(torch.uint8).reshape(t.shape[0], -1)


_sources: Dict[int, DraftKVSource] = {}
_sources_lock = Lock()


def record_draft_kv_source(source: DraftKVSource) -> None:
    with _sources_lock:
        _sources[source.entry_ptrs[0]] = source


def draft_kv_source_for(kv_args) -> Optional[DraftKVSource]:
    """The recorded source behind ``kv_args``' draft entries, or None (no DFLASH draft here)."""
    n = int(getattr(kv_args, "num_draft_entries", 0) or 0)
    if n <= 0:
        return None
    ptrs = tuple(kv_args.kv_data_ptrs[-n:])
    with _sources_lock:
        source = _sources.get(ptrs[0])
    if source is None or source.entry_ptrs != ptrs or source.pool_ref() is None:
        return None
    return source


def describe_draft_pool(pool, total_heads: Optional[int]) -> DraftKVSource:
    """Read the draft geometry off an sglang draft KV pool; say why when it cannot be read."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    ptrs, _, _ = pool.get_contiguous_buf_infos()
    reason = None
    if type(pool) is not MHATokenToKVPool:
        reason = f"the draft KV pool is a {type(pool).__name__}, not a plain MHATokenToKVPool"
    elif getattr(pool, "kv_cache_layout", "nhd") != "nhd":
        reason = f"the draft KV pool uses the {pool.kv_cache_layout!r} layout, not NHD"
    elif [t.data_ptr() for t in list(pool.k_buffer) + list(pool.v_buffer)] != list(ptrs):
        reason = "the draft KV pool registers buffers other than its K and V buffers"
    elif not total_heads:
        reason = "the draft model's total KV head count could not be found"
    shape = None
    if reason is None:
        try:
            shape = DraftKVShape(
                total_heads=int(total_heads),
                k_head_dim=int(pool.head_dim),
                v_head_dim=int(pool.v_head_dim),
                dtype_bytes=int(pool.store_dtype.itemsize),
            )
        except DraftKVLayoutError as e:
            reason = str(e)
    return DraftKVSource(tuple(ptrs), shape, reason, weakref.ref(pool))


def draft_total_kv_heads(scheduler, pool) -> Optional[int]:
    """Total KV heads of the draft model whose runner owns ``pool``."""
    worker = getattr(scheduler, "draft_worker", None)
    if worker is None:
        return None
    runners = [getattr(worker, "draft_model_runner", None)]
    try:
        runners += [runner for _, runner in worker.weight_update_runners()]
    except Exception:  # a worker without draft weights
        pass
    for runner in runners:
        if runner is not None and getattr(runner, "token_to_kv_pool", None) is pool:
            return int(runner.model_config.get_total_num_kv_heads())
    return None
