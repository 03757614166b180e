"""The draft KV pack staging of one prefill rank: sized, allocated, compiled and registered at
startup, deregistered with the KV manager's buffers.

The patch to ``sglang/srt/disaggregation/mooncake/conn.py`` (sglang 0.5.23) for it:

* AROUND ``MooncakeKVManager.register_buffer_to_engine`` (the manager's ``__init__`` calls it,
  and ``PrefillBootstrapQueue.resume_memory_occupation``): after sglang's own regions, register
  the pack buffer of the rank's draft entries with the transfer engine;
* AROUND ``MooncakeKVManager.deregister_buffer_to_engine`` (``teardown`` and
  ``release_memory_occupation`` call it): deregister it too.

Why at startup (``prefill_draft_kv`` builds it before sglang builds the KV manager): a buffer
allocated at the first request lands after the KV pool took its share of the memory, fails there
instead of at startup, and a failed allocation or registration inside a decode's registration
would be taken for a layout the decode cannot be served. The same goes for the fused pack kernel:
compiling it, or capturing a graph, while serving stalls the transfer thread and (a capture)
disables the allocator's free-and-retry on the device for the scheduler's forward. So everything
a pack uses exists before the server reports ready: the buffer (from Mooncake's custom memory
pool when ``SGLANG_MOONCAKE_CUSTOM_MEM_POOL`` is set, as sglang's own staging buffers are, which
NVLink / MNNVL transports need), one slot per transfer queue with its stream and row-index
buffers, and every pack this rank can be asked for, run once and captured into CUDA graphs for
every slot and row bucket (``PreparedPacks.warm``; the eager launch costs the host more than the
kernel takes, measured on an H200).

Size: one slot packs a whole transfer chunk of ``max_prefill_buffer_tokens()`` tokens (the
``--chunked-prefill-size`` ceiling sglang sizes its prefill buffers by) in one step:
``(chunk pages + 1) x page size x`` this rank's draft KV bytes per token
(``draft_kv_pack.pack_slot_bytes``): 48.4 MiB per slot, 193.5 MiB for sglang's 4 queues, on a
Kimi-K3 TP4 prefill rank at 8192 tokens (``sglang-dflash-pp check`` prints the figure). ``SGLANG_DFLASH_DRAFT_KV_PACK_BUFFER_MB`` sets the
total instead; a slot that cannot hold a chunk's slices together is warned about at startup
(such chunks are packed one slice at a time, or per decode rank in page windows). A rank holding
one draft head per rank never packs (no decode holds fewer) and gets no buffer.

Stdlib and torch at import; the hooks and the custom pool read sglang lazily.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch

from sglang_dflash_pp.hooks import PluginHook
from sglang_dflash_pp.srt.disaggregation.draft_kv_chunk_packs import PreparedPacks
from sglang_dflash_pp.srt.disaggregation.draft_kv_geometry import (
    DraftKVGeometry,
    KVComponent,
    draft_entry_components,
)
from sglang_dflash_pp.srt.disaggregation.draft_kv_pack import PackStagingBuffer, pack_slot_bytes

logger = logging.getLogger(__name__)

PACK_BUFFER_MB_ENV = "SGLANG_DFLASH_DRAFT_KV_PACK_BUFFER_MB"


def pack_buffer_mb_override() -> Optional[int]:
    """``SGLANG_DFLASH_DRAFT_KV_PACK_BUFFER_MB`` (the whole buffer, MiB), or None when unset."""
    # the send path's switches are read alike (imported here: in-tree it sits in the mooncake
    # package, whose conn.py imports this module)
    from sglang_dflash_pp.srt.disaggregation.draft_kv_send import env_int

    return env_int(PACK_BUFFER_MB_ENV, None, 1)


@dataclass(frozen=True)
class StagingSize:
    slot_bytes: int  # what each slot gets
    chunk_slot_bytes: int  # what one slot needs to pack a whole chunk in one step
    num_slots: int
    chunk_tokens: int

    @property
    def total_bytes(self) -> int:
        return self.slot_bytes * self.num_slots

    @property
    def packs_a_chunk_at_once(self) -> bool:
        return self.slot_bytes >= self.chunk_slot_bytes


def staging_size(src: DraftKVGeometry, num_entries: int, *, chunk_tokens: int,
                 num_slots: int) -> StagingSize:  # fmt: skip
    """The slot size for rank ``src`` (``num_entries`` draft entries, K then V)."""
    row_bytes = sum(src.row_bytes(c) for c in draft_entry_components(num_entries))
    need = pack_slot_bytes(row_bytes, src.page_size, chunk_tokens)
    override = pack_buffer_mb_override()
    slot = need if override is None else (override << 20) // num_slots
    return StagingSize(slot, need, num_slots, chunk_tokens)


@dataclass
class DraftKVStaging:
    """A prefill rank's pack buffer and the packs prepared for it."""

    buffer: PackStagingBuffer
    prepared: PreparedPacks
    size: StagingSize
    warmed: int  # packs prepared and run once at startup
    graphs: int  # CUDA graphs captured for them at startup (every slot, every row bucket)
    registered_engine: object = None  # the transfer engine it is registered with, if any

    def describe(self) -> str:
        return (
            f"{self.buffer.nbytes / (1 << 20):.1f} MiB on {self.buffer.device}, "
            f"{len(self.buffer.slots)} slot(s) of {self.buffer.slot_bytes / (1 << 20):.1f} MiB "
            f"(a {self.size.chunk_tokens}-token chunk needs "
            f"{self.size.chunk_slot_bytes / (1 << 20):.1f} MiB), {self.warmed} packs prepared, "
            f"{self.graphs} CUDA graphs captured"
        )


def build_staging(source, src: DraftKVGeometry, *, chunk_tokens: int, num_slots: int,
                  allocate: Optional[Callable] = None) -> Optional[DraftKVStaging]:  # fmt: skip
    """The rank's staging for ``source`` (a ``DraftKVSource`` with a known shape), or None when
    this rank never packs. Raises if the memory cannot be had: the server must not start."""
    if src.heads_per_rank <= 1:
        return None
    entries = [source.entry_rows(q) for q in range(len(source.entry_ptrs))]
    size = staging_size(src, len(entries), chunk_tokens=chunk_tokens, num_slots=num_slots)
    narrowest = min(src.head_bytes(c) for c in KVComponent) * len(entries)
    kwargs = {} if allocate is None else {"allocate": allocate}
    buffer = PackStagingBuffer(
        size.slot_bytes,
        num_slots,
        entries[0].device,
        max_rows=max(1, size.slot_bytes // narrowest),
        **kwargs,
    )
    prepared = PreparedPacks(entries, src, buffer.slots[0].buffer)
    graphs = prepared.warm(buffer)
    staging = DraftKVStaging(buffer, prepared, size, prepared.count, graphs)
    if not size.packs_a_chunk_at_once:
        logger.warning(
            "%s=%s gives %d B per draft KV pack slot; packing every head slice of a %d-token "
            "chunk at once needs %d B: such chunks are packed in several steps. Unset it to "
            "size the buffer from the chunk.",
            PACK_BUFFER_MB_ENV,
            os.environ.get(PACK_BUFFER_MB_ENV),
            size.slot_bytes,
            chunk_tokens,
            size.chunk_slot_bytes,
        )
    return staging


def allocate_for_mooncake(device: torch.device) -> Optional[Callable]:
    """The allocation sglang's own Mooncake staging buffers use: Mooncake's custom memory pool
    when ``SGLANG_MOONCAKE_CUSTOM_MEM_POOL`` is set, else None (the default allocator)."""
    if device.type != "cuda":
        return None
    from sglang.srt.disaggregation.mooncake.utils import init_mooncake_custom_mem_pool

    enabled, pool, pool_type = init_mooncake_custom_mem_pool(str(device))
    if not enabled or pool is None:
        return None

    def allocate(nbytes: int, dev: torch.device) -> torch.Tensor:
        with torch.cuda.device(dev), torch.cuda.use_mem_pool(pool):
            return torch.empty(nbytes, dtype=torch.uint8, device=dev)

    logger.info("DFlash draft KV pack buffer from Mooncake's %s memory pool", pool_type)
    return allocate


def build_rank_staging(source, page_size: int, tp_size: int, tp_rank: int):
    """The pack staging of attention TP rank ``tp_rank`` of ``tp_size`` for ``source`` (a
    ``DraftKVSource`` with a known shape), or None where it never packs, built before sglang
    builds the KV manager (which registers it), sized from the chunk sglang's prefill buffers
    are sized by and one slot per transfer queue. Raises where it cannot be set up."""
    from sglang.srt.environ import envs
    from sglang.srt.runtime_context import get_schedule, max_prefill_buffer_tokens

    src = DraftKVGeometry.for_rank(
        source.shape, side="prefill", tp_size=tp_size, tp_rank=tp_rank, page_size=page_size
    )
    device = source.entry_rows(0).device
    try:
        staging = build_staging(
            source,
            src,
            chunk_tokens=max_prefill_buffer_tokens() or get_schedule().max_prefill_tokens,
            num_slots=max(1, int(envs.SGLANG_DISAGGREGATION_QUEUE_SIZE.get())),
            allocate=allocate_for_mooncake(device),
        )
    except (RuntimeError, ValueError) as e:  # out of memory, a bad size
        raise RuntimeError(
            f"DFLASH draft KV pack staging could not be set up on {device}: {e}. Lower "
            f"--mem-fraction-static or set {PACK_BUFFER_MB_ENV} smaller."
        ) from e
    if staging is not None:
        logger.info("DFLASH draft KV pack staging: %s", staging.describe())
    return staging


def with_pack_staging(source, page_size: int, tp_size: int, tp_rank: int):
    """``source`` (a ``DraftKVSource``, or None) with its rank's pack staging, where its
    geometry is known and the rank packs."""
    if source is None or source.shape is None:
        return source
    return replace(source, staging=build_rank_staging(source, page_size, tp_size, tp_rank))


# -- the KV manager's registrations -----------------------------------------------------------


def _staging_of(manager) -> Optional[DraftKVStaging]:
    from sglang_dflash_pp.srt.disaggregation.draft_kv_source import draft_kv_source_for

    source = draft_kv_source_for(getattr(manager, "kv_args", None))
    return None if source is None else source.staging


def register_staging(engine, staging: Optional[DraftKVStaging]) -> None:
    """Register ``staging``'s pack buffer with ``engine`` (sglang's transfer engine wrapper)
    once, after the KV manager's own regions; nothing without a staging."""
    if staging is None or staging.registered_engine is not None:
        return
    buffer = staging.buffer
    rc = engine.batch_register([buffer.ptr], [buffer.nbytes])
    if rc not in (0, None):
        raise RuntimeError(
            f"Mooncake refused to register the {buffer.nbytes}-byte DFlash draft KV pack "
            f"buffer (rc={rc}); lower {PACK_BUFFER_MB_ENV} or check the transfer engine."
        )
    staging.registered_engine = engine
    logger.info("DFlash draft KV pack buffer registered with Mooncake: %s", staging.describe())


def deregister_staging(staging: Optional[DraftKVStaging]) -> None:
    """Deregister ``staging``'s pack buffer where it is registered."""
    if staging is not None and staging.registered_engine is not None:
        staging.registered_engine.batch_deregister([staging.buffer.ptr])
        staging.registered_engine = None


def register_buffer_to_engine_around(original, self, *args, **kwargs):
    out = original(self, *args, **kwargs)
    register_staging(self.engine, _staging_of(self))
    return out


def deregister_buffer_to_engine_around(original, self, *args, **kwargs):
    try:
        return original(self, *args, **kwargs)
    finally:
        deregister_staging(_staging_of(self))


_MANAGER = "sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager"

HOOKS = (
    PluginHook(
        f"{_MANAGER}.register_buffer_to_engine",
        register_buffer_to_engine_around,
        "around",
        "register the DFlash draft KV pack buffer (allocated at startup) with the KV manager's",
    ),
    PluginHook(
        f"{_MANAGER}.deregister_buffer_to_engine",
        deregister_buffer_to_engine_around,
        "around",
        "deregister the DFlash draft KV pack buffer with the KV manager's buffers",
    ),
)
