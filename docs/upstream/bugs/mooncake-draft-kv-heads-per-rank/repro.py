"""Stock 0.5.23: the hybrid-MLA Mooncake send path writes DFLASH draft KV with the prefill's item length.

Setup (the design numbers of a Kimi-K3 deployment): prefill P = attention TP4, decode D = TP32,
DFlash draft with 8 KV heads (head_dim 128, bf16, 6 layers), page size 64, target = 16 MLA layers.
P rank 1 holds draft heads 2 and 3 (2 per rank, 32768 B per page); D rank 12 holds head 3 only
(1 per rank, 16384 B per page). One request: P pages [5, 6, 7, 20] -> D pages [2, 3, 4, 9].

What runs: a real prefill ``MooncakeKVManager`` (built with ``object.__new__`` and the attributes
its registration and send path read; no transfer engine, no sockets), a real CPU
``MHATokenToKVPool`` as the draft pool, the real registration (``_publish_peer_registration``)
and the real ``send_kvcache`` that the transfer worker picks for a hybrid-MLA target
(``disaggregation/mooncake/conn.py:2690-2705``). ``_transfer_data`` is replaced by a recorder
that copies the source bytes of every descriptor at send time; the recorded draft writes are then
replayed into images of the decode rank's draft entries and compared with the head it owns.

Run: ``python repro.py`` (stock sglang 0.5.23; no plugin is loaded, see ../stock_sglang.py).
Takes a few seconds, mostly importing sglang.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import stock_sglang  # noqa: E402

stock_sglang.stock_only()

import numpy as np  # noqa: E402
import torch  # noqa: E402

CONN = "sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager"
TARGETS = [
    f"{CONN}.send_kvcache",
    f"{CONN}._validate_peer_state_layout",
    f"{CONN}._publish_peer_registration",
]

H, HEAD_DIM, PAGE, DRAFT_LAYERS, DTYPE_BYTES = 8, 128, 64, 6, 2
NUM_TARGET_LAYERS = 16  # MLA: one entry per layer
MLA_ITEM = PAGE * 576 * 2  # kv_lora_rank 512 + rope 64, bf16, one page
POOL_PAGES = 24
P_TP, P_RANK, D_TP, D_RANK = 4, 1, 32, 12
SRC_PAGES, DST_PAGES = [5, 6, 7, 20], [2, 3, 4, 9]
DECODE_DRAFT_BASE = 2_000_000  # decode address of draft K0 (the design note's number)
DECODE_ENTRY_STRIDE = 10_000_000
DECODE_TARGET_BASE = 900_000_000
N_DRAFT = 2 * DRAFT_LAYERS  # K0..K5, V0..V5


def heads_of(tp: int, rank: int) -> range:
    """Global draft KV heads a rank holds (QKVParallelLinear sharding: replicas when tp > H)."""
    per_rank = max(1, H // tp)
    start = (rank // max(1, tp // H)) * per_rank
    return range(start, start + per_rank)


def page_bytes(tp: int) -> int:
    return PAGE * max(1, H // tp) * HEAD_DIM * DTYPE_BYTES


def global_draft_kv(entry: int, rows: int) -> torch.Tensor:
    """Whole-model draft KV of one entry, [token slots, H, head_dim], the same on every rank."""
    g = torch.Generator().manual_seed(1000 + entry)
    return torch.randn(rows, H, HEAD_DIM, generator=g).to(torch.bfloat16)


def prefill_draft_pool():
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    heads = heads_of(P_TP, P_RANK)
    pool = MHATokenToKVPool(
        size=POOL_PAGES * PAGE,
        page_size=PAGE,
        dtype=torch.bfloat16,
        head_num=len(heads),
        head_dim=HEAD_DIM,
        layer_num=DRAFT_LAYERS,
        device="cpu",
        enable_memory_saver=False,
    )
    for q, buf in enumerate(list(pool.k_buffer) + list(pool.v_buffer)):
        buf.copy_(global_draft_kv(q, buf.shape[0])[:, heads.start : heads.stop])
    return pool


class Recorder:
    """Stands in for ``MooncakeKVManager._transfer_data``: records (src, dst, length) and copies
    the source bytes at send time when they lie in memory this process owns."""

    def __init__(self, regions):
        self.regions = list(regions)
        self.writes = []
        self.lock = threading.Lock()

    def _readable(self, addr: int, n: int) -> bool:
        return any(p <= addr and addr + n <= p + size for p, size in self.regions)

    def __call__(self, session, blocks):
        for src, dst, n in blocks:
            snap = ctypes.string_at(src, n) if self._readable(src, n) else None
            with self.lock:
                self.writes.append((src, dst, n, snap))
        return 0


class NoEngine:
    """No transfer engine: registration of extra buffers (none on the stock path) is a no-op."""

    def batch_register(self, ptrs, lens):
        return 0


def prefill_manager(pool, target_buffers):
    from sglang.srt.disaggregation.base.conn import KVArgs
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager
    from sglang.srt.disaggregation.utils import DisaggregationMode

    kv_args = KVArgs()
    d_ptrs, d_lens, d_items = pool.get_contiguous_buf_infos()
    kv_args.engine_rank = P_RANK
    kv_args.kv_data_ptrs = [t.data_ptr() for t in target_buffers] + list(d_ptrs)
    kv_args.kv_data_lens = [t.numel() for t in target_buffers] + list(d_lens)
    kv_args.kv_item_lens = [MLA_ITEM] * NUM_TARGET_LAYERS + list(d_items)
    # Draft entries carry layer ids L..L+5 (K then V), after the target's (utils.build_kv_layer_ids).
    kv_args.kv_layer_ids = list(range(NUM_TARGET_LAYERS)) + [
        NUM_TARGET_LAYERS + i for i in range(DRAFT_LAYERS)
    ] * 2
    kv_args.num_draft_entries = N_DRAFT
    kv_args.page_size = PAGE
    kv_args.aux_data_ptrs, kv_args.aux_data_lens, kv_args.aux_item_lens = [], [], []
    kv_args.state_types, kv_args.state_data_ptrs, kv_args.state_data_lens = [], [], []
    kv_args.state_item_lens, kv_args.state_layer_ids = [], []
    kv_args.mla_compression_ratios = None
    kv_args.prefill_start_layer, kv_args.pp_rank = 0, 0

    m = object.__new__(MooncakeKVManager)
    m.kv_args = kv_args
    m.disaggregation_mode = DisaggregationMode.PREFILL
    # Kimi-K3's pool is HybridLinearKVPool: is_mla_backend False, is_hybrid_mla_backend True.
    m.is_mla_backend, m.is_hybrid_mla_backend = False, True
    m.attn_tp_size, m.attn_tp_rank, m.state_tp_size = P_TP, P_RANK, P_TP
    m.attn_cp_size, m.attn_cp_rank = 1, 0
    m.pp_size, m.pp_rank = 1, 0
    m.engine = NoEngine()
    m.decode_kv_args_table, m.transfer_infos, m.request_status = {}, {}, {}
    m.session_lock = threading.Lock()
    m.state_layout_rejections, m.state_strides_validated = {}, set()
    m.failed_sessions, m.session_failures, m.failed_session_probes = set(), defaultdict(int), {}
    m.max_transfer_batch_indices = 0
    m.enable_custom_mem_pool, m.custom_mem_pool_type = False, None
    m.transfer_queues = [None]
    m.enable_trace = m.enable_staging = m.enable_deferred_decode_kv_release = False
    m._staging_outstanding = defaultdict(int)
    m.req_to_decode_prefix_len = {}
    m._dcp_pack_buffers = None
    m.bootstrap_port = 0
    return m


def decode_registration():
    """What decode rank 12 of TP32 publishes (``build_receiver_registration_message``)."""
    from sglang.srt.disaggregation.mooncake.conn import KVArgsRegisterInfo

    d_page = page_bytes(D_TP)
    return KVArgsRegisterInfo(
        room="None",
        endpoint="127.0.0.1",
        dst_port=1,
        mooncake_session_id="decode-tp32-rank12",
        dst_kv_ptrs=[DECODE_TARGET_BASE + i * DECODE_ENTRY_STRIDE for i in range(NUM_TARGET_LAYERS)]
        + [DECODE_DRAFT_BASE + q * DECODE_ENTRY_STRIDE for q in range(N_DRAFT)],
        dst_aux_ptrs=[],
        dst_state_data_ptrs=[],
        dst_tp_rank=D_RANK,
        dst_attn_tp_size=D_TP,
        dst_kv_item_len=MLA_ITEM,
        dst_state_item_lens=[],
        dst_state_dim_per_tensor=[],
        dst_kv_layer_ids=list(range(NUM_TARGET_LAYERS))
        + [NUM_TARGET_LAYERS + i for i in range(DRAFT_LAYERS)] * 2,
        dst_state_layer_ids=[],
        dst_kv_item_lens=[MLA_ITEM] * NUM_TARGET_LAYERS + [d_page] * N_DRAFT,
    )


def runs(src_pages, dst_pages):
    """Page runs contiguous on the decode side (the coalescing stock applies)."""
    out, start = [], 0
    for i in range(1, len(dst_pages) + 1):
        if i == len(dst_pages) or dst_pages[i] != dst_pages[i - 1] + 1:
            out.append((dst_pages[start], i - start))
            start = i
    return out


def expected_k0_descriptors():
    """Independent oracle: decode rank 12 receives its one head, 16384 B per decode page."""
    d_page = page_bytes(D_TP)
    return [[DECODE_DRAFT_BASE + d0 * d_page, n * d_page] for d0, n in runs(SRC_PAGES, DST_PAGES)]


def replay(writes, registration):
    """Apply the recorded draft writes to images of the decode rank's 12 draft entries."""
    d_page = page_bytes(D_TP)
    size = POOL_PAGES * d_page
    bases = registration.dst_kv_ptrs[NUM_TARGET_LAYERS:]
    images = [np.zeros(size, np.uint8) for _ in bases]
    written = [np.zeros(size, np.int32) for _ in bases]
    for _src, dst, n, snap in writes:
        hit = [q for q, b in enumerate(bases) if b <= dst < b + DECODE_ENTRY_STRIDE]
        if not hit:
            continue  # a target MLA entry
        q = hit[0]
        off = dst - bases[q]
        n = max(0, min(n, size - off))  # the decode registered no more than this
        if snap is not None and n:
            images[q][off : off + n] = np.frombuffer(snap[:n], np.uint8)
        written[q][off : off + n] += 1
    return images, written


def main() -> None:
    from sglang.srt.runtime_context import get_context

    mode = stock_sglang.begin(TARGETS)
    get_context().override_server_args(speculative_algorithm="DFLASH").install()

    pool = prefill_draft_pool()
    target_buffers = [torch.zeros(POOL_PAGES * MLA_ITEM, dtype=torch.uint8) for _ in range(NUM_TARGET_LAYERS)]
    m = prefill_manager(pool, target_buffers)
    pack = None
    if mode == "with-plugins":
        # What the plugin's PrefillBootstrapQueue._init_kv_manager hook records at startup:
        # the draft pool, and the pack staging it builds for this rank.
        from dataclasses import replace

        from sglang_dflash_pp.srt.disaggregation.draft_kv_geometry import DraftKVGeometry
        from sglang_dflash_pp.srt.disaggregation.draft_kv_source import (
            describe_draft_pool,
            record_draft_kv_source,
        )
        from sglang_dflash_pp.srt.disaggregation.draft_kv_staging import build_staging

        source = describe_draft_pool(pool, H)
        geometry = DraftKVGeometry.for_rank(
            source.shape, side="prefill", tp_size=P_TP, tp_rank=P_RANK, page_size=PAGE
        )
        staging = build_staging(source, geometry, chunk_tokens=POOL_PAGES * PAGE, num_slots=1)
        record_draft_kv_source(replace(source, staging=staging))
        pack = staging.buffer
    reg = decode_registration()
    rejection = m._publish_peer_registration(reg.mooncake_session_id, reg)

    regions = [(t.data_ptr(), t.numel()) for t in target_buffers]
    regions += [(t.data_ptr(), t.numel() * t.element_size()) for t in list(pool.k_buffer) + list(pool.v_buffer)]
    if pack is not None:  # the plugin's staging buffer
        regions.append((pack.ptr, pack.nbytes))
    m._transfer_data = Recorder(regions)
    m.send_kvcache(
        reg.mooncake_session_id,
        np.asarray(SRC_PAGES, np.int32),
        reg.dst_kv_ptrs,
        np.asarray(DST_PAGES, np.int32),
        None,
        dst_layer_ids=reg.dst_kv_layer_ids,
        dst_kv_item_len=reg.dst_kv_item_len,
        dst_attn_tp_size=reg.dst_attn_tp_size,
    )

    k0_base = reg.dst_kv_ptrs[NUM_TARGET_LAYERS]
    k0 = [[dst, n] for _s, dst, n, _ in m._transfer_data.writes if k0_base <= dst < k0_base + DECODE_ENTRY_STRIDE]
    images, written = replay(m._transfer_data.writes, reg)

    d_page = page_bytes(D_TP)
    (head,) = heads_of(D_TP, D_RANK)
    pages_ok = 0
    for q in range(N_DRAFT):
        full = global_draft_kv(q, POOL_PAGES * PAGE)
        for sp, dp in zip(SRC_PAGES, DST_PAGES):
            want = full[sp * PAGE : (sp + 1) * PAGE, head : head + 1].contiguous()
            got = images[q][dp * d_page : (dp + 1) * d_page]
            pages_ok += bool(np.array_equal(got, want.view(torch.uint8).reshape(-1).numpy()))
    pages_written = sorted({int(p) for p in np.nonzero(written[0].reshape(POOL_PAGES, d_page).any(axis=1))[0]})
    draft_bytes = sum(n for _s, dst, n, _ in m._transfer_data.writes if dst < DECODE_TARGET_BASE)

    observed = {
        "registration_rejection": rejection,
        "k0_descriptors": k0,
        "k0_decode_pages_written": pages_written,
        "request_pages_with_the_right_head": pages_ok,
        "draft_bytes_sent": draft_bytes,
    }
    expected = {
        "registration_rejection": None,
        "k0_descriptors": expected_k0_descriptors(),
        "k0_decode_pages_written": sorted(DST_PAGES),
        "request_pages_with_the_right_head": N_DRAFT * len(DST_PAGES),
        "draft_bytes_sent": N_DRAFT * len(DST_PAGES) * d_page,
    }
    print(f"P TP{P_TP} rank {P_RANK} (draft heads {list(heads_of(P_TP, P_RANK))}, "
          f"{page_bytes(P_TP)} B/page) -> D TP{D_TP} rank {D_RANK} (head {head}, {d_page} B/page)")
    print(f"request pages P {SRC_PAGES} -> D {DST_PAGES}; decode draft K0 at {k0_base}")
    stock_sglang.compare(
        mode, TARGETS, "mooncake-draft-kv-heads-per-rank", observed, expected,
    )


if __name__ == "__main__":
    main()
