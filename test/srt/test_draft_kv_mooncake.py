"""The Mooncake glue on sglang 0.5.23's real ``MooncakeKVManager``: registration verdicts and sends.

A prefill manager shell (no engine, no sockets; ``object.__new__`` plus the attributes the code
reads) runs the real, hooked ``_publish_peer_registration``, ``transfer_worker`` and
``send_kvcache``, with ``_transfer_data`` replaced by a recorder that also copies the source
bytes of every draft descriptor at send time. Draft pools are real CPU ``MHATokenToKVPool``s
filled with random bf16, target MLA entries fake pointers. The recorded draft writes are replayed
into decode pool images and compared, byte for byte, with the heads each decode rank owns.

The helpers here are reused by test_draft_kv_loopback.py, which moves the same bytes through a
real Mooncake engine.
"""

from __future__ import annotations

import ctypes
import threading
from collections import defaultdict
from typing import Dict, List

import numpy as np
import pytest
import torch

from sglang_dflash_pp.tools.qkv_kv_heads import kv_heads_by_rank

H, HEAD_DIM, PAGE, DRAFT_LAYERS = 8, 128, 64, 6
NUM_HIDDEN_LAYERS = 16
TARGET_LAYER_IDS = [3, 7, 11, 15]
MLA_ITEM = PAGE * 576 * 2
DRAFT_LAYER_IDS = [NUM_HIDDEN_LAYERS + i for i in range(DRAFT_LAYERS)] * 2
N_TARGET, N_DRAFT = len(TARGET_LAYER_IDS), 2 * DRAFT_LAYERS
DECODE_DRAFT_BASE = 2_000_000  # the design note's decode base for draft K0
TARGET_BASE = 900_000_000  # fake decode target entries live above every draft entry
ENTRY_STRIDE = 10_000_000
POOL_PAGES = 24


def innermost(fn):
    while getattr(fn, "__wrapped__", None) is not None:
        fn = fn.__wrapped__
    return fn


def owned_heads(tp_size: int, tp_rank: int) -> range:
    """The draft KV heads a rank holds, read from sglang's ``QKVParallelLinear`` (the oracle the
    geometry under test is checked against, not a restatement of it)."""
    return kv_heads_by_rank(H, tp_size)[tp_rank]


def heads_per_rank(tp: int) -> int:
    return len(owned_heads(tp, 0))


def make_draft_pool(
    tp_size: int, tp_rank: int, *, head_dim: int = HEAD_DIM, pages: int = POOL_PAGES
):
    """A real sglang draft pool on CPU, each rank's owned heads holding their global values."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    heads = owned_heads(tp_size, tp_rank)
    pool = MHATokenToKVPool(
        size=pages * PAGE,
        page_size=PAGE,
        dtype=torch.bfloat16,
        head_num=len(heads),
        head_dim=head_dim,
        layer_num=DRAFT_LAYERS,
        device="cpu",
        enable_memory_saver=False,
    )
    for q, buf in enumerate(list(pool.k_buffer) + list(pool.v_buffer)):
        buf.copy_(global_draft_kv(q, buf.shape[0], head_dim)[:, heads.start : heads.stop])
    return pool


def global_draft_kv(entry: int, rows: int, head_dim: int = HEAD_DIM) -> torch.Tensor:
    """The whole model's draft KV of one entry, [token slots, H, head_dim], identical on every rank."""
    g = torch.Generator().manual_seed(1000 + entry)
    return torch.randn(rows, H, head_dim, generator=g).to(torch.bfloat16)


class Recorder:
    """Stands in for ``MooncakeKVManager._transfer_data``; snapshots source bytes of real memory."""

    def __init__(self, real_regions=()):
        self.calls: List[tuple] = []
        self.real_regions = list(real_regions)  # (ptr, nbytes) we may read
        self.lock = threading.Lock()

    def _real(self, addr: int, n: int) -> bool:
        return any(p <= addr and addr + n <= p + size for p, size in self.real_regions)

    def __call__(self, session, blocks):
        blocks = list(blocks)
        snaps = [ctypes.string_at(s, n) if self._real(s, n) else None for s, _, n in blocks]
        with self.lock:
            self.calls.append((session, blocks, snaps))
        return 0

    def blocks(self):
        return [b for _, blocks, _ in self.calls for b in blocks]

    def writes(self):
        return [(b, s) for _, blocks, snaps in self.calls for b, s in zip(blocks, snaps)]


class FakeEngine:
    def __init__(self):
        self.registered = []

    def batch_register(self, ptrs, lens):
        self.registered += list(zip(ptrs, lens))
        return 0

    def batch_deregister(self, ptrs):
        self.registered = [r for r in self.registered if r[0] not in set(ptrs)]
        return 0


def prefill_kv_args(pool, *, tp_rank: int, target_ptrs=None, with_draft=True, layer_ids=True):
    from sglang.srt.disaggregation.base.conn import KVArgs

    kv_args = KVArgs()
    target_ptrs = list(target_ptrs or [10_000_000 + i * 1_000_000 for i in range(N_TARGET)])
    ptrs, lens, items = list(target_ptrs), [MLA_ITEM * POOL_PAGES] * N_TARGET, [MLA_ITEM] * N_TARGET
    ids = list(TARGET_LAYER_IDS)
    if with_draft:
        d_ptrs, d_lens, d_items = pool.get_contiguous_buf_infos()
        ptrs, lens, items, ids = (
            ptrs + d_ptrs,
            lens + d_lens,
            items + d_items,
            ids + DRAFT_LAYER_IDS,
        )
    kv_args.engine_rank = tp_rank
    kv_args.kv_data_ptrs, kv_args.kv_data_lens, kv_args.kv_item_lens = ptrs, lens, items
    kv_args.kv_layer_ids = ids if layer_ids else []
    kv_args.num_draft_entries = N_DRAFT if with_draft else 0
    kv_args.page_size = PAGE
    kv_args.aux_data_ptrs, kv_args.aux_data_lens, kv_args.aux_item_lens = [], [], []
    kv_args.state_types, kv_args.state_data_ptrs, kv_args.state_data_lens = [], [], []
    kv_args.state_item_lens, kv_args.state_layer_ids = [], []
    kv_args.mla_compression_ratios = None
    kv_args.prefill_start_layer = 0
    kv_args.pp_rank = 0
    return kv_args


def prefill_manager(
    kv_args, *, tp_size: int, tp_rank: int, engine=None, pp_size=1, pp_rank=0, hybrid=True, queues=2
):
    """A prefill MooncakeKVManager shell: the attributes registration, worker and send read."""
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager
    from sglang.srt.disaggregation.utils import DisaggregationMode

    m = object.__new__(MooncakeKVManager)
    m.kv_args = kv_args
    m.disaggregation_mode = DisaggregationMode.PREFILL
    m.is_mla_backend, m.is_hybrid_mla_backend = False, hybrid
    m.attn_tp_size, m.attn_tp_rank, m.state_tp_size = tp_size, tp_rank, tp_size
    m.attn_cp_size, m.attn_cp_rank = 1, 0
    m.pp_size, m.pp_rank = pp_size, pp_rank
    m.engine = engine if engine is not None else FakeEngine()
    m.decode_kv_args_table, m.transfer_infos, m.request_status = {}, {}, {}
    m.session_lock = threading.Lock()
    m.state_layout_rejections, m.state_strides_validated = {}, set()
    m.failed_sessions, m.session_failures, m.failed_session_probes = set(), defaultdict(int), {}
    m.max_transfer_batch_indices = 0
    m.enable_custom_mem_pool, m.custom_mem_pool_type = False, None
    m.transfer_queues = [None] * queues
    m.enable_trace = m.enable_staging = m.enable_deferred_decode_kv_release = False
    m._staging_outstanding = defaultdict(int)
    m.req_to_decode_prefix_len = {}
    m._dcp_pack_buffers = None
    m.bootstrap_port = 0
    m.failures = []

    def conclude_failure(bootstrap_room, failure_reason, targets=None):
        # sglang's conclude_failure records the reason, tells the decode and marks the room.
        from sglang.srt.disaggregation.base.conn import KVPoll

        m.failures.append((bootstrap_room, failure_reason))
        if bootstrap_room in m.request_status:
            m.request_status[bootstrap_room] = KVPoll.Failed

    m.conclude_failure = conclude_failure
    return m


def record_source(pool, tp_size=None, tp_rank=None, *, queues=2, chunk_tokens=POOL_PAGES * PAGE):
    """What the prefill's startup records for its draft pool (``prefill_draft_kv``): the pool,
    and, given the rank, its pack staging built by the product's own ``build_staging``."""
    from dataclasses import replace

    from sglang_dflash_pp.srt.disaggregation.draft_kv_geometry import DraftKVGeometry
    from sglang_dflash_pp.srt.disaggregation.draft_kv_source import (
        describe_draft_pool,
        record_draft_kv_source,
    )
    from sglang_dflash_pp.srt.disaggregation.draft_kv_staging import build_staging

    source = describe_draft_pool(pool, H)
    assert source.shape is not None, source.shape_unknown_reason
    if tp_size is not None:
        src = DraftKVGeometry.for_rank(
            source.shape, side="prefill", tp_size=tp_size, tp_rank=tp_rank, page_size=PAGE
        )
        staging = build_staging(source, src, chunk_tokens=chunk_tokens, num_slots=queues)
        source = replace(source, staging=staging)
    record_draft_kv_source(source)
    return source


def staging_of(m):
    from sglang_dflash_pp.srt.disaggregation.draft_kv_source import draft_kv_source_for

    source = draft_kv_source_for(m.kv_args)
    return None if source is None else source.staging


def decode_item_lens(
    tp_size: int, *, page=PAGE, k_dim=HEAD_DIM, v_dim=HEAD_DIM, dtype_bytes=2, target=MLA_ITEM
):
    h = heads_per_rank(tp_size)
    return (
        [target] * N_TARGET
        + [page * h * k_dim * dtype_bytes] * DRAFT_LAYERS
        + [page * h * v_dim * dtype_bytes] * DRAFT_LAYERS
    )


def decode_registration(
    session: str, *, tp_size: int, tp_rank: int, kv_ptrs=None, item_lens="default", layer_ids=True
):
    from sglang.srt.disaggregation.mooncake.conn import KVArgsRegisterInfo

    if kv_ptrs is None:
        kv_ptrs = [TARGET_BASE + i * ENTRY_STRIDE for i in range(N_TARGET)] + [
            DECODE_DRAFT_BASE + q * ENTRY_STRIDE for q in range(N_DRAFT)
        ]
    lens = decode_item_lens(tp_size) if item_lens == "default" else item_lens
    return KVArgsRegisterInfo(
        room="None",
        endpoint="127.0.0.1",
        dst_port=1,
        mooncake_session_id=session,
        dst_kv_ptrs=list(kv_ptrs),
        dst_aux_ptrs=[],
        dst_state_data_ptrs=[],
        dst_tp_rank=tp_rank,
        dst_attn_tp_size=tp_size,
        dst_kv_item_len=MLA_ITEM,
        dst_state_item_lens=[],
        dst_state_dim_per_tensor=[],
        dst_kv_layer_ids=(TARGET_LAYER_IDS + DRAFT_LAYER_IDS) if layer_ids else [],
        dst_state_layer_ids=[],
        dst_kv_item_lens=list(lens),
    )


def register_decode_ranks(m, ranks, *, tp_size=32):
    """Decode ranks of one TP ``tp_size`` instance registered with ``m`` through sglang's (hooked)
    ``_publish_peer_registration``, each with its own buffers; none refused."""
    regs = []
    for r in ranks:
        reg = decode_registration(f"d:{r}", tp_size=tp_size, tp_rank=r)
        reg.dst_kv_ptrs = [p + r * 50_000_000 for p in reg.dst_kv_ptrs]
        assert m._publish_peer_registration(reg.mooncake_session_id, reg) is None
        regs.append(reg)
    with_pack_regions(m)
    return regs


def run_rooms(manager, registrations, rooms, *, dst_device_pages=None):
    """One non-final chunk per room (``{room: (src_pages, dst_pages)}``), each room sent to every
    registration, through the real transfer worker loop, as the scheduler enqueues them."""
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.common.utils import FastQueue, TransferKVChunk
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager, TransferInfo

    device_pages = None if dst_device_pages is None else np.asarray(dst_device_pages, np.int32)
    queue = FastQueue()
    for room, (src_pages, dst_pages) in rooms.items():
        manager.request_status[room] = KVPoll.WaitingForInput
        manager.transfer_infos[room] = {
            reg.mooncake_session_id: TransferInfo(
                room=room,
                endpoint="127.0.0.1",
                dst_port=1,
                mooncake_session_id=reg.mooncake_session_id,
                dst_kv_indices=np.asarray(dst_pages, np.int32),
                dst_aux_index=0,
                dst_state_indices=[],
                required_dst_info_num=len(registrations),
                is_dummy=False,
                dst_device_kv_indices=device_pages,
            )
            for reg in registrations
        }
        queue.put(
            TransferKVChunk(
                room=room,
                prefill_kv_indices=np.asarray(src_pages, np.int32),
                index_slice=slice(0, len(src_pages)),
                is_last_chunk=False,
                prefill_aux_index=None,
                state_indices=None,
            )
        )
    queue.put(None)
    MooncakeKVManager.transfer_worker(manager, queue, None)


def run_worker(manager, registration, src_pages, dst_pages, *, room=7, dst_device_pages=None):
    """One non-final chunk to one decode rank through the real transfer worker loop."""
    run_rooms(manager, [registration], {room: (src_pages, dst_pages)},
              dst_device_pages=dst_device_pages)


def decode_images_from(writes, registration, tp_size: int, *, pages=POOL_PAGES, head_dim=HEAD_DIM):
    """Replay recorded draft writes into decode pool images; returns {entry: (bytes, write counts)}."""
    h = heads_per_rank(tp_size)
    page_bytes = PAGE * h * head_dim * 2
    images = {
        q: (np.zeros(pages * page_bytes, np.uint8), np.zeros(pages * page_bytes, np.int32))
        for q in range(N_DRAFT)
    }
    bases = registration.dst_kv_ptrs[N_TARGET:]
    for (src, dst, n), snap in writes:
        hit = [q for q, b in enumerate(bases) if b <= dst < b + pages * page_bytes]
        if not hit:
            continue
        assert snap is not None, f"draft write from unreadable source {src:#x}"
        img, cnt = images[hit[0]]
        off = dst - bases[hit[0]]
        assert off + n <= img.size, "draft write runs past the decode entry"
        img[off : off + n] = np.frombuffer(snap, np.uint8)
        cnt[off : off + n] += 1
    return images


def assert_decode_holds_its_heads(
    images, tp_size: int, tp_rank: int, src_pages, dst_pages, *, head_dim=HEAD_DIM
):
    heads = owned_heads(tp_size, tp_rank)
    for q, (img, cnt) in images.items():
        full = global_draft_kv(q, POOL_PAGES * PAGE + PAGE, head_dim)
        want = np.zeros_like(img)
        wcnt = np.zeros_like(cnt)
        rows = img.size // (POOL_PAGES * PAGE)
        for sp, dp in zip(src_pages, dst_pages):
            tok = full[sp * PAGE : (sp + 1) * PAGE, heads.start : heads.stop].contiguous()
            want[dp * PAGE * rows : (dp + 1) * PAGE * rows] = (
                tok.view(torch.uint8).reshape(-1).numpy()
            )
            wcnt[dp * PAGE * rows : (dp + 1) * PAGE * rows] = 1
        np.testing.assert_array_equal(cnt, wcnt, err_msg=f"write counts of draft entry {q}")
        np.testing.assert_array_equal(img, want, err_msg=f"bytes of draft entry {q}")


# -- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pools(dflash_runtime_config):
    cache: Dict[tuple, object] = {}

    def get(tp_size: int, tp_rank: int, head_dim: int = HEAD_DIM):
        key = (tp_size, tp_rank, head_dim)
        if key not in cache:
            cache[key] = make_draft_pool(tp_size, tp_rank, head_dim=head_dim)
        return cache[key]

    return get


def setup_prefill(pools, tp_size, tp_rank, *, register=True, **kw):
    """A prefill rank as its startup leaves it: the draft pool recorded with its staging, the
    manager shell built, and sglang's (hooked) ``register_buffer_to_engine`` run."""
    pool = pools(tp_size, tp_rank)
    if register:
        record_source(pool, tp_size, tp_rank, queues=kw.get("queues", 2))
    kv_args = prefill_kv_args(pool, tp_rank=tp_rank, layer_ids=kw.pop("layer_ids", True))
    m = prefill_manager(kv_args, tp_size=tp_size, tp_rank=tp_rank, **kw)
    m.register_buffer_to_engine()
    real = [(t.data_ptr(), t.numel() * 2) for t in list(pool.k_buffer) + list(pool.v_buffer)]
    m._transfer_data = Recorder(real)
    return m, pool


def with_pack_regions(m):
    staging = staging_of(m)
    if staging is not None:
        m._transfer_data.real_regions.append((staging.buffer.ptr, staging.buffer.nbytes))


def plan_of(registration):
    return getattr(registration, "dflash_draft_kv_plan")


SRC_PAGES, DST_PAGES = [5, 6, 7, 20, 11], [2, 3, 4, 9, 15]


# -- stock equivalence ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tp_p, rank_p, tp_d, rank_d", [(4, 2, 4, 2), (8, 5, 8, 5), (16, 5, 32, 11), (32, 6, 8, 1)]
)
@pytest.mark.parametrize("variant", ["plain", "index_batches", "hisparse"])
def test_equal_heads_send_exactly_what_stock_sends(pools, tp_p, rank_p, tp_d, rank_d, variant):
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager
    from sglang_dflash_pp.srt.disaggregation.draft_kv_peer import PeerAction

    m, _ = setup_prefill(pools, tp_p, rank_p)
    reg = decode_registration("d:eq", tp_size=tp_d, tp_rank=rank_d)
    assert m._publish_peer_registration("d:eq", reg) is None
    assert plan_of(reg).action is PeerAction.STOCK
    device = [p + 100 for p in DST_PAGES] if variant == "hisparse" else None
    m.max_transfer_batch_indices = 2 if variant == "index_batches" else 0
    args = (
        "d:eq",
        np.asarray(SRC_PAGES, np.int32),
        reg.dst_kv_ptrs,
        np.asarray(DST_PAGES, np.int32),
        None,
    )
    kwargs = dict(
        dst_layer_ids=reg.dst_kv_layer_ids, dst_kv_item_len=MLA_ITEM, dst_attn_tp_size=tp_d
    )
    if device is not None:
        kwargs["dst_device_kv_indices"] = np.asarray(device, np.int32)
    assert MooncakeKVManager.send_kvcache(m, *args, **kwargs) == 0
    hooked = m._transfer_data.calls
    m._transfer_data = Recorder()
    assert innermost(MooncakeKVManager.send_kvcache)(m, *args, **kwargs) == 0
    stock = m._transfer_data.calls
    assert [(s, b) for s, b, _ in hooked] == [(s, b) for s, b, _ in stock]
    assert len(m._transfer_data.blocks()) > 0


def send_kvcache(m, reg, **kwargs) -> int:
    """The real ``send_kvcache`` for one decode registration, as the transfer worker calls it."""
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager

    return MooncakeKVManager.send_kvcache(
        m,
        reg.mooncake_session_id,
        np.asarray(SRC_PAGES, np.int32),
        reg.dst_kv_ptrs,
        np.asarray(DST_PAGES, np.int32),
        None,
        dst_layer_ids=reg.dst_kv_layer_ids,
        **kwargs,
    )


def test_tp4_to_tp32_lands_on_the_decode_rank_own_head(pools):
    """The seed's regression through the real send_kvcache: page 2 -> 2032768, 16384 B per page."""
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager
    from sglang_dflash_pp.srt.disaggregation.draft_kv_peer import PeerAction
    from sglang_dflash_pp.srt.disaggregation.draft_kv_plan import Regime

    m, pool = setup_prefill(pools, 4, 1)
    reg = decode_registration("d:12", tp_size=32, tp_rank=12)
    assert m._publish_peer_registration("d:12", reg) is None
    plan = plan_of(reg)
    assert (plan.action, plan.pair.regime, plan.pair.heads) == (
        PeerAction.HEAD_AWARE,
        Regime.PACK_SOURCE,
        range(3, 4),
    )
    with_pack_regions(m)
    src, dst = [5, 6, 7, 20], [2, 3, 4, 9]
    args = ("d:12", np.asarray(src, np.int32), reg.dst_kv_ptrs, np.asarray(dst, np.int32), None)
    kwargs = dict(dst_layer_ids=reg.dst_kv_layer_ids, dst_kv_item_len=MLA_ITEM, dst_attn_tp_size=32)
    assert MooncakeKVManager.send_kvcache(m, *args, **kwargs) == 0
    ours = m._transfer_data.blocks()
    k0 = [(d, n) for _, d, n in ours if DECODE_DRAFT_BASE <= d < DECODE_DRAFT_BASE + ENTRY_STRIDE]
    assert k0 == [(2_032_768, 3 * 16384), (2_000_000 + 9 * 16384, 16384)]
    images = decode_images_from(m._transfer_data.writes(), reg, 32)
    assert_decode_holds_its_heads(images, 32, 12, src, dst)

    m._transfer_data = Recorder()
    assert innermost(MooncakeKVManager.send_kvcache)(m, *args, **kwargs) == 0
    stock = m._transfer_data.blocks()
    stock_k0 = [
        (d, n) for _, d, n in stock if DECODE_DRAFT_BASE <= d < DECODE_DRAFT_BASE + ENTRY_STRIDE
    ]
    assert stock_k0 == [
        (2_065_536, 98_304),
        (2_000_000 + 9 * 32768, 32768),
    ]  # 0.5.23: wrong place, 2x bytes
    # Target MLA entries: identical descriptors on both paths.
    target = lambda blocks: [b for b in blocks if b[1] >= TARGET_BASE]  # noqa: E731
    assert target(ours) == target(stock) and len(target(ours)) == N_TARGET * 2  # 2 page runs


def test_head_aware_send_keeps_the_bounded_index_batches(pools):
    """SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES=2: target entries take sglang's bounded branch
    unchanged, draft pages go in chunks of the same size."""
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager

    m, _ = setup_prefill(pools, 4, 1)
    m.max_transfer_batch_indices = 2
    reg = decode_registration("d:b", tp_size=32, tp_rank=9)
    assert m._publish_peer_registration("d:b", reg) is None
    with_pack_regions(m)
    args = (
        "d:b",
        np.asarray(SRC_PAGES, np.int32),
        reg.dst_kv_ptrs,
        np.asarray(DST_PAGES, np.int32),
        None,
    )
    assert MooncakeKVManager.send_kvcache(m, *args, dst_layer_ids=reg.dst_kv_layer_ids) == 0
    ours = m._transfer_data.calls
    assert_decode_holds_its_heads(
        decode_images_from(m._transfer_data.writes(), reg, 32), 32, 9, SRC_PAGES, DST_PAGES
    )
    draft_calls = [
        [b for b in blocks] for _, blocks, _ in ours if all(d < TARGET_BASE for _, d, _ in blocks)
    ]
    assert [len(c) for c in draft_calls] == [12, 24, 12]  # pages [2,3] | [4,9] | [15]

    m._transfer_data = Recorder()
    innermost(MooncakeKVManager.send_kvcache)(m, *args, dst_layer_ids=reg.dst_kv_layer_ids)
    stock_target = [
        [b for b in blocks if b[1] >= TARGET_BASE] for _, blocks, _ in m._transfer_data.calls
    ]
    our_target = [blocks for _, blocks, _ in ours if all(d >= TARGET_BASE for _, d, _ in blocks)]
    assert our_target == stock_target and len(our_target) == 3


def test_pack_chunks_and_batches_and_concurrent_workers(pools, monkeypatch):
    """A 2 MB pack buffer in 4 slots, one per thread as sglang runs one worker per queue (5 pages
    need 3 windows), 5-descriptor batches, 4 threads at once."""

    monkeypatch.setenv("SGLANG_DFLASH_DRAFT_KV_PACK_BUFFER_MB", "2")
    monkeypatch.setenv("SGLANG_DFLASH_DRAFT_KV_MAX_BATCH_DESCRIPTORS", "5")
    m, _ = setup_prefill(pools, 4, 1, queues=4)
    regs = [
        decode_registration(f"d:{r}", tp_size=32, tp_rank=r, kv_ptrs=None) for r in range(8, 16)
    ]
    for reg in regs:
        reg.dst_kv_ptrs = [p + reg.dst_tp_rank * 50_000_000 for p in reg.dst_kv_ptrs]
        assert m._publish_peer_registration(reg.mooncake_session_id, reg) is None
    buf = staging_of(m).buffer
    assert m.engine.registered.count((buf.ptr, 2 << 20)) == 1  # registered once, at startup
    assert buf.slot_bytes == 1 << 19 and buf.slot_bytes // (12 * 16384) == 2
    with_pack_regions(m)

    def send(reg):
        assert send_kvcache(m, reg) == 0

    threads = [
        threading.Thread(target=lambda rs=regs[i::4]: [send(r) for r in rs]) for i in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for reg in regs:
        calls = [c for c in m._transfer_data.calls if c[0] == reg.mooncake_session_id]
        draft_calls = [c for c in calls if all(d < TARGET_BASE for _, d, _ in c[1])]
        # chunks of 2 pages: [2,3] -> 12 descriptors, [4,9] -> 24, [15] -> 12; batches of 5
        assert [len(blocks) for _, blocks, _ in draft_calls] == [5, 5, 2, 5, 5, 5, 5, 4, 5, 5, 2]
        writes = [w for c in calls for w in zip(c[1], c[2])]
        images = decode_images_from(writes, reg, 32)
        assert_decode_holds_its_heads(images, 32, reg.dst_tp_rank, SRC_PAGES, DST_PAGES)


def test_decode_with_smaller_tp_through_the_worker(pools):
    """TP2 -> TP1: rank 0 sends target + its 4 heads; rank 1, which sglang skips for the replicated
    target, still sends its 4 heads, one descriptor per token row, and nothing else."""
    from sglang_dflash_pp.srt.disaggregation.draft_kv_peer import PeerAction

    writes, calls = [], {}
    reg = None
    for p in (0, 1):
        m, _ = setup_prefill(pools, 2, p)
        reg = decode_registration("d:0", tp_size=1, tp_rank=0)
        assert m._publish_peer_registration("d:0", reg) is None
        assert plan_of(reg).action is (PeerAction.HEAD_AWARE if p == 0 else PeerAction.DRAFT_ONLY)
        run_worker(m, reg, SRC_PAGES, DST_PAGES)
        assert m.failures == []
        calls[p] = m._transfer_data.blocks()
        writes += m._transfer_data.writes()
    targets = {p: [b for b in calls[p] if b[1] >= TARGET_BASE] for p in calls}
    assert len(targets[0]) == N_TARGET * 3 and targets[1] == []
    for p in (0, 1):
        drafts = [b for b in calls[p] if b[1] < TARGET_BASE]
        assert len(drafts) == N_DRAFT * len(SRC_PAGES) * PAGE
        assert {n for _, _, n in drafts} == {4 * HEAD_DIM * 2}
    assert_decode_holds_its_heads(decode_images_from(writes, reg, 1), 1, 0, SRC_PAGES, DST_PAGES)


def test_replicated_prefill_rank_sends_nothing_twice(pools):
    """TP32 -> TP16 (8 heads): prefill ranks 2r and 2r+1 hold the same head; only 2r sends, as stock."""
    from sglang_dflash_pp.srt.disaggregation.draft_kv_peer import PeerAction

    sent = {}
    for p in (2, 3):
        m, _ = setup_prefill(pools, 32, p)
        reg = decode_registration("d:1", tp_size=16, tp_rank=1)
        assert m._publish_peer_registration("d:1", reg) is None
        assert plan_of(reg).action is PeerAction.STOCK and plan_of(reg).pair.writer == (p == 2)
        run_worker(m, reg, SRC_PAGES, DST_PAGES)
        sent[p] = m._transfer_data.blocks()
    assert len(sent[2]) == (N_TARGET + N_DRAFT) * 3 and sent[3] == []


def test_hisparse_draft_goes_to_device_pages(pools):

    m, _ = setup_prefill(pools, 4, 1)
    reg = decode_registration("d:hs", tp_size=32, tp_rank=13)
    assert m._publish_peer_registration("d:hs", reg) is None
    with_pack_regions(m)
    device = [10, 11, 12, 1, 0]
    assert send_kvcache(m, reg, dst_device_kv_indices=np.asarray(device, np.int32)) == 0
    images = decode_images_from(m._transfer_data.writes(), reg, 32)
    assert_decode_holds_its_heads(images, 32, 13, SRC_PAGES, device)
    target_dst_pages = {
        (d - TARGET_BASE) % ENTRY_STRIDE // MLA_ITEM
        for _, d, _ in m._transfer_data.blocks()
        if d >= TARGET_BASE
    }
    assert target_dst_pages == {2, 9, 15}  # host pages for the target, as stock


def test_non_last_pp_stage_sends_no_draft(pools):
    """Defence in depth: a non-last stage that registered draft entries anyway sends the target only."""
    from sglang_dflash_pp.srt.disaggregation.draft_kv_peer import PeerAction

    m, _ = setup_prefill(pools, 4, 2, pp_size=8, pp_rank=3)
    reg = decode_registration("d:pp", tp_size=4, tp_rank=2)
    assert m._publish_peer_registration("d:pp", reg) is None
    assert plan_of(reg).action is PeerAction.TARGET_ONLY
    assert send_kvcache(m, reg) == 0
    blocks = m._transfer_data.blocks()
    assert blocks and all(d >= TARGET_BASE for _, d, _ in blocks)


def test_inert_without_a_dflash_draft(pools):
    """No recorded DFLASH source (e.g. an EAGLE draft): no verdict, stock registration and send."""
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager

    pool = make_draft_pool(4, 1, pages=4)  # never recorded
    kv_args = prefill_kv_args(pool, tp_rank=1)
    m = prefill_manager(kv_args, tp_size=4, tp_rank=1)
    m._transfer_data = Recorder()
    reg = decode_registration("d:x", tp_size=32, tp_rank=12)
    assert m._publish_peer_registration("d:x", reg) is None
    assert plan_of(reg) is None and m.state_layout_rejections == {}
    args = (
        "d:x",
        np.asarray([1, 2], np.int32),
        reg.dst_kv_ptrs,
        np.asarray([2, 3], np.int32),
        None,
    )
    assert MooncakeKVManager.send_kvcache(m, *args, dst_layer_ids=reg.dst_kv_layer_ids) == 0
    ours = m._transfer_data.blocks()
    m._transfer_data = Recorder()
    innermost(MooncakeKVManager.send_kvcache)(m, *args, dst_layer_ids=reg.dst_kv_layer_ids)
    assert ours == m._transfer_data.blocks()


# -- registration refusals --------------------------------------------------------------------


def _lens(tp, **kw):
    return decode_item_lens(tp, **kw)


BAD_LAYOUTS = {
    "page size": (
        dict(tp_size=32, item_lens=_lens(32, page=32, target=32 * 576 * 2)),
        ["target KV entry 0", "--page-size"],
    ),
    "dtype": (
        dict(tp_size=32, item_lens=_lens(32, dtype_bytes=1)),
        ["1-byte draft KV elements", "--kv-cache-dtype", "K=8192 B (expected 16384 B)"],
    ),
    "head dim": (
        dict(tp_size=32, item_lens=_lens(32, v_dim=64)),
        ["V head_dim 64 where this prefill's has 128"],
    ),
    "heads per rank": (
        dict(tp_size=32, item_lens=_lens(4)),
        ["2 draft KV head(s) per decode rank instead of 1", "--speculative-draft-model-path"],
    ),
    "heads not dividing": (
        dict(tp_size=12, item_lens=_lens(32)),
        ["decode attention TP 12 and the draft's 8 KV heads", "multiple of it (e.g. 16)"],
    ),
    "missing item lengths": (
        dict(tp_size=32, item_lens=[]),
        ["published no per-entry KV item lengths", "attention TP 4"],
    ),
    "missing layer ids": (
        dict(tp_size=32, layer_ids=False),
        ["needs KV layer ids", "decode published none"],
    ),
    "target item length": (
        dict(tp_size=32, item_lens=_lens(32, target=MLA_ITEM // 2 * 3)),
        ["target KV entry 0 is 73728 B per page on this prefill", "--kv-cache-dtype"],
    ),
}


@pytest.mark.parametrize("name", list(BAD_LAYOUTS))
def test_registration_refuses_bad_layouts_before_any_byte(pools, name):
    kwargs, needles = BAD_LAYOUTS[name]
    m, _ = setup_prefill(pools, 4, 1)
    reg = decode_registration("d:bad", tp_rank=4 if kwargs["tp_size"] == 12 else 12, **kwargs)
    reason = m._publish_peer_registration("d:bad", reg)
    assert reason is not None, name
    assert reason.startswith("DFlash draft KV cannot be sent to decode attention TP rank")
    for needle in needles:
        assert needle in reason, reason
    assert m.state_layout_rejections["d:bad"] == reason  # cached by sglang's own table
    run_worker(m, reg, SRC_PAGES, DST_PAGES)
    assert m._transfer_data.calls == []  # not one byte
    assert m.failures == [(7, reason)]


def test_pp_prefill_refuses_a_decode_without_layer_ids(pools):
    m, _ = setup_prefill(pools, 4, 1, pp_size=8, pp_rank=7)
    reg = decode_registration("d:nolid", tp_size=32, tp_rank=12, layer_ids=False)
    reason = m._publish_peer_registration("d:nolid", reg)
    assert (
        "cannot be paired (Layer metadata must be provided by both PD peers or neither)" in reason
    )


def test_verdict_is_cached_and_replaced_on_reregistration(pools, monkeypatch):
    from sglang_dflash_pp.srt.disaggregation import draft_kv_registration

    m, _ = setup_prefill(pools, 4, 1)
    bad = decode_registration("d:re", tp_size=32, tp_rank=12, item_lens=[])
    assert m._publish_peer_registration("d:re", bad) is not None
    good = decode_registration("d:re", tp_size=32, tp_rank=12)
    assert m._publish_peer_registration("d:re", good) is None
    assert "d:re" not in m.state_layout_rejections and m.decode_kv_args_table["d:re"] is good
    with_pack_regions(m)

    def no_recheck(*a, **k):
        raise AssertionError("the send path re-validated the peer")

    monkeypatch.setattr(draft_kv_registration, "peer_verdict", no_recheck)
    for _ in range(2):
        assert send_kvcache(m, good) == 0


def test_unknown_draft_pool_serves_only_equal_tp(pools):
    from sglang_dflash_pp.srt.disaggregation.draft_kv_source import (
        describe_draft_pool,
        record_draft_kv_source,
    )

    pool = make_draft_pool(4, 1, pages=4)
    source = describe_draft_pool(pool, None)  # total heads unknown
    assert source.shape is None and "total KV head count" in source.shape_unknown_reason
    record_draft_kv_source(source)
    m = prefill_manager(prefill_kv_args(pool, tp_rank=1), tp_size=4, tp_rank=1)
    assert (
        m._publish_peer_registration("d:eq", decode_registration("d:eq", tp_size=4, tp_rank=1))
        is None
    )
    reason = m._publish_peer_registration(
        "d:ne", decode_registration("d:ne", tp_size=32, tp_rank=12)
    )
    assert "cannot describe its draft KV pool (the draft model's total KV head count" in reason
    assert "attention TP (4)" in reason


def test_bad_environment_is_refused():
    from sglang_dflash_pp.srt.disaggregation import mooncake_draft_kv

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SGLANG_DFLASH_DRAFT_KV_PACK_BUFFER_MB", "lots")
        with pytest.raises(
            ValueError, match="SGLANG_DFLASH_DRAFT_KV_PACK_BUFFER_MB='lots' must be an integer"
        ):
            mooncake_draft_kv.check_environment()
        mp.setenv("SGLANG_DFLASH_DRAFT_KV_PACK_BUFFER_MB", "8")
        mp.setenv("SGLANG_DFLASH_DRAFT_KV_MAX_BATCH_DESCRIPTORS", "0")
        with pytest.raises(ValueError, match="MAX_BATCH_DESCRIPTORS=0 must be at least 1"):
            mooncake_draft_kv.check_environment()


def test_a_decode_rank_outside_the_rank_mapping_is_refused(pools):
    """Same TP, other rank (every prefill rank sends to every decode rank under KV-cache
    sharding): stock would copy this rank's heads over the decode rank's own."""
    m, _ = setup_prefill(pools, 4, 1)
    reason = m._publish_peer_registration("d:3", decode_registration("d:3", tp_size=4, tp_rank=3))
    assert "receives from prefill ranks [3] in sglang's rank mapping" in reason
    assert "--enable-kv-cache-sharding" in reason
