"""What the composed KV digest costs a Kimi-K3 prefill rank per chunk, timed through the code that
ships (``kv_digest_send``: the send hooks' descriptor digest, ``add_blocks``, ``flush``), against
the time Mooncake takes to move the bytes it digests.

Geometry (``python/sglang_dflash_pp/examples/kimi_k3``, ``sglang-dflash-pp check --example
kimi-k3``): P = TP4 x PP8 sends to D = TP32, so each prefill rank of the last stage (layers
81..92 of the target's 93, 0-based) serves 8 decode ranks: prefill rank 3 -> decode ranks 24..31
(sglang's rank mapping, ``draft_kv_plan.prefill_ranks_for``). One chunk of
``--chunked-prefill-size`` 8192 tokens = 128 pages of 64, in runs of 16 pages contiguous on both
sides. Per decode rank:

* target MLA entries (the stage's 4 full-attention layers): the Mooncake descriptors sglang
  0.5.23's ``MooncakeKVManager._send_kvcache_generic`` builds (legacy batch path: one
  ``batch_transfer_sync`` per decode rank, one descriptor per layer per page run contiguous on
  both sides, the layers paired with the decode's entries by layer id);
* draft entries (K and V of the 6 draft layers): ``kv_digest_send.DraftPart`` of the
  ``DraftSend`` the registration hook builds from the plugin's verdict (``peer_verdict``), i.e.
  ``draft_kv_digest.digest_blocks_of``: the decode's head in strided rows, one block per entry and
  page run;
* last chunk only, the KDA state of the stage's 8 KDA layers: the descriptors sglang 0.5.23's
  ``MooncakeKVManager._send_mamba_state_slice`` builds for a prefill TP4 -> decode TP32 slice
  (``compute_mamba_state_slice_byte_blocks``; on the GPU machine, where sglang cannot be
  installed, the mirror below, checked against sglang's own function by ``--check-sglang``).
  Shapes from the example's ``linear_attn_config`` by sglang's ``KimiLinearStateShape.create``:
  ``JSON geometry.kda_state``.

What runs, per chunk (``send_path``): the worker-chunk scope (``transfer_chunk.begin`` with the
chunk's KV-written event as its ``wait_event``), then for each decode rank the MLA descriptors
through ``kv_digest_send.scope`` + ``batch_transfer_sync_around`` (the hook on Mooncake's
``batch_transfer_sync``: ``BufferTable.blocks`` resolves the destinations, ``add_blocks`` queues),
the draft's ``kv_digest_send.add_draft_blocks`` (its pages checked, the blocks built on the
digest thread) as ``_send_draft_entries`` does,
on the last chunk the state descriptors through a STATE scope; then ``flush(manager)``: one
``DigestEngine.digest`` (``DeviceDigest``, the Triton kernel) for all 8 decode ranks and the sums
added to the rooms' contributions. The manager is a ``SimpleNamespace`` holding what these
functions read; Mooncake's transfer is a no-op (the ratio's denominator is bytes / 50 GB/s).
Decode-side pointers are distinct fake bases (the digest needs only destination offsets); the
sources are real GPU memory.

Timed (L2 flushed before each sample by a 512 MiB fill on another stream, whose event is the
chunk's ``wait_event``; every variant once per repetition, in rotating order):

* ``shipped_send_path_{middle,last}_chunk``: the above, wall = ``time.perf_counter`` around it
  (split at the ``flush`` call), gpu = CUDA events on the digest engine's stream around it;
* ``shipped_add_blocks_flush_{middle,last}_chunk``: only ``add_blocks`` of the same blocks, built
  beforehand, and ``flush``;
* ``handoff_alone_{middle,last}_chunk[_digest_off]``: the send path with the digest thread given
  none of its jobs (``DigestThread.submit`` stubbed), timed to the ``flush`` call: the hooks'
  own host cost on the worker, with nothing competing for the GIL, against the same hooks with
  the digest off;
* ``direct_*`` (the earlier benchmark's variants, kept for comparison): ``DeviceDigest.digest``
  called directly on blocks this script builds by its own formula (the middle chunk's MLA and
  draft blocks): one call for the 8 decode ranks, the same through Triton's JIT launch, 8 calls,
  the MLA blocks once, an empty call; ``kernel_alone``: events around ``kv_digest_triton.launch``
  with the table on the device, for the shipped tile shape and a sweep of others;
  ``host_prep``/``host_steps``/``direct_call_steps``: the host parts of a direct call.

Over the link (``over_link_*``): the same send path, each ``batch_transfer_sync`` (and the draft's
transfer, through the same hook) taking its bytes' time at 50 GB/s in ``time.sleep`` (the GIL
released, as Mooncake's transfer releases it); a middle chunk ends as the worker's does
(``end_chunk``: its digest goes on, on the digest thread, during the next chunk), a last chunk
waits at the status (``flush``). Timed against the same sends with the digest off, in one loop:
exposed = wall(on) - wall(off), medians; the digest thread's queue is drained after each sample
(untimed: its lag) and its busy time read. A last chunk's digest runs on the digest thread
during its own transfers of at least ``kv_digest_send.EAGER_DIGEST_MIN_BYTES`` and at the status.
``_all_inline``: a chunk digested by the worker itself before the chunk ends or at the status (the
synchronous design; for a last chunk the previous shipped design; the same functions);
``_no_eager``: a last chunk on the thread, all of it at the status (the eager threshold set past
any transfer); ``_at_last_rank_only``: 012a25a's schedule (``at_last_rank_only``, restated here:
one eager call, at the last decode rank's first long transfer), against the shipped one (calls at
half the ranks, at the last rank's first long transfer and at its later ones), same run;
``_no_prepare``: e7c7ad6's code (the last rank's state digested at its send, not run dry from
the chunk's start), for a last chunk and a whole request; ``_switch_interval``: a what-if, the
shipped last chunk with ``sys.setswitchinterval(0.0005)`` (5 ms by default) around it.

Ratio: digest time / (chunk bytes / 50 GB/s), chunk bytes = the bytes of the chunk's descriptors
to the 8 decode ranks (what Mooncake moves for them; the draft's equal its digest blocks').

Checked on the GPU: the shipped path's per-decode-rank sums of the middle chunk equal the direct
formula digest; the last chunk's KV sums equal the middle chunk's; each decode rank's state sums
equal that decode rank's own digest (``kv_digest_verify.request_blocks``) of its state slot after
the state descriptors' bytes were copied into a host model of its state pool (``ctypes.memmove``;
decode rank 24 and 31); no failure concluded; the direct chunk digest equals
``kv_digest.digest_blocks_host`` over CPU copies; pieces, a flipped byte; no CUDA allocation and
no kernel compile during 100 digests (direct and shipped) after ``warm()``; sglang not imported.

    PYTHONPATH=python python3 benchmark/gpu/kv_digest_cost.py --out benchmark/gpu/results/kv_digest_cost.json
    .venv/bin/python benchmark/gpu/kv_digest_cost.py --check-sglang benchmark/gpu/results/kv_digest_cost.json   # local, sglang 0.5.23
    python3 benchmark/gpu/kv_digest_cost.py --keep-previous benchmark/gpu/results/kv_digest_cost.json EARLIER.json
    PYTHONPATH=python python3 benchmark/gpu/kv_digest_cost.py --smoke   # the shipped path on CPU, small
    python3 benchmark/gpu/kv_digest_cost.py --render benchmark/gpu/results/kv_digest_cost.json
    PYTHONPATH=python python3 benchmark/gpu/kv_digest_cost.py --geometry   # the blocks, no GPU
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import itertools
import json
import math
import os
import statistics
import sys
import time
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import link_wait  # noqa: E402

_D = "python/sglang_dflash_pp/srt/disaggregation/"
TIMED = [_D + f for f in (
    "kv_digest_send.py", "kv_digest_engine.py", "kv_digest_triton.py", "kv_digest.py",
    "kv_digest_thread.py", "transfer_chunk.py", "mooncake_draft_kv.py", "draft_kv_plan.py",
)]  # fmt: skip
PREFILL_RANK = 3
REQUEST_CHUNKS = 4  # a 32768-token prompt: 3 middle chunks and the last
STAGE = 7  # the last PP stage
# sglang's get_pp_indices for 93 layers over PP8, as ``check --example kimi-k3`` prints it
# (sglang is not installed on the GPU machine; used when it cannot be imported).
PP8_PARTITION = [11, 11, 11, 12, 12, 12, 12, 12]
RUN_PAGES = 16  # the chunk's pages lie in runs of this many, contiguous on both sides
PREFILL_POOL_PAGES = 512  # per entry, in real GPU memory
DECODE_POOL_PAGES = 8192  # decode offsets only (numbers)
STATE_SLOTS = 4  # prefill state pool slots (sglang's size + 1), real GPU memory
SRC_STATE_SLOT = 1  # the request's state slot on the prefill
DECODE_STATE_SLOTS = 8  # the host model of a decode rank's state pool (the decode-side check)
DST_STATE_SLOT = 5  # the request's state slot on the decode
LINK_BPS = 50e9
GOAL = 0.05


SWITCH_INTERVAL_WHAT_IF_S = 0.0005
# ``_busy`` variants: the GPU runs BUSY_GEMMS bf16 [BUSY_GEMM]^2 GEMMs (~1.4 ms each on an H200)
# on another stream during the chunk, as the prefill's next forward does in serving.
BUSY_GEMM = 8192
BUSY_GEMMS = 9


def stage_layers(num_layers: int, pp: int, stage: int) -> range:
    try:
        from sglang.srt.distributed.utils import get_pp_indices

        return range(*get_pp_indices(num_layers, stage, pp))
    except ImportError:
        assert pp == len(PP8_PARTITION) and sum(PP8_PARTITION) == num_layers
        start = sum(PP8_PARTITION[:stage])
        return range(start, start + PP8_PARTITION[stage])


def kda_state(lin: dict, tp: int) -> dict:
    """One KDA layer's state per slot on a rank of attention TP ``tp``, as sglang 0.5.23 lays it
    out (``configs/mamba_utils.py: KimiLinearStateShape.create`` from the config's
    ``linear_attn_config``; ``mem_cache/memory_pool.py: MambaPool`` transfer entries)."""
    heads, dim, kernel = int(lin["num_heads"]), int(lin["head_dim"]), int(lin["short_conv_kernel_size"])
    k_heads, k_dim = int(lin.get("num_k_heads", heads)), int(lin.get("head_k_dim", dim))
    groups = [heads * dim, k_heads * k_dim, k_heads * k_dim]  # q | k | v channels, each TP-sharded
    conv = (kernel - 1, sum(g // tp for g in groups))  # [K - 1, q/tp + k/tp + v/tp], bf16
    temporal = (heads // tp, dim, dim)  # the recurrent state, fp32 (SGLANG_MAMBA_SSM_DTYPE default)
    return dict(
        conv_shape=list(conv), conv_dtype="bfloat16", conv_item_bytes=math.prod(conv) * 2,
        conv_slice_dim=conv[1], conv_outer_count=conv[0], conv_shard_groups=groups,
        temporal_shape=list(temporal), temporal_dtype="float32",
        temporal_item_bytes=math.prod(temporal) * 4, temporal_slice_dim=temporal[0],
        temporal_outer_count=1,
    )  # fmt: skip


STATE_DERIVATION = (
    "sglang 0.5.23 KimiLinearStateShape.create(tp_world_size=attn TP, num_heads=linear_attn_config"
    ".num_heads, head_dim=linear_attn_config.head_dim, conv_kernel_size=linear_attn_config"
    ".short_conv_kernel_size): one conv state per layer, [K-1, (H*D + 2*Hk*Dk)/TP] (q|k|v short-conv "
    "windows concatenated, each sharded over TP; Hk, Dk = H, D when the config names none), dtype "
    "bf16 (SGLANG_MAMBA_CONV_DTYPE default); one recurrent (temporal) state per layer, [H/TP, D, D], "
    "fp32 (SGLANG_MAMBA_SSM_DTYPE default). MambaPool registers, per state field, one transfer entry "
    "per KDA layer: the decode (PP1) all 69 KDA layers' conv entries then their temporal entries, the "
    "prefill stage its 8 of each. A TP4 -> TP32 send is _send_mamba_state_slice: per layer pair "
    "(by layer id), compute_mamba_state_slice_byte_blocks with the conv slice axis 1 (outer count "
    "K-1 = 3) and conv_shard_groups [H*D, Hk*Dk, Hk*Dk], so 3 rows x 3 sub-blocks = 9 descriptors "
    "of 256 channels x 2 B per conv state, and one descriptor of 2 heads x D x D x 4 B per temporal "
    "state."
)


def geometry():
    from sglang_dflash_pp.srt.disaggregation.draft_kv_plan import prefill_ranks_for
    from sglang_dflash_pp.tools import examples

    ex = examples.load("kimi-k3")
    t = ex.config("target")["text_config"]
    d = ex.config("draft")
    p_tp, pp = int(ex.prefill_arg("--tp-size")), int(ex.prefill_arg("--pp-size"))
    d_tp, page = ex.decode_tp_size, ex.page_size
    chunk_tokens = int(ex.prefill_arg("--chunked-prefill-size"))
    kda = set(t["linear_attn_config"]["kda_layers"])  # 1-based (sglang's is_kda_layer)
    full = [i for i in range(t["num_hidden_layers"]) if (i + 1) not in kda]
    kda_all = [i for i in range(t["num_hidden_layers"]) if (i + 1) in kda]
    layers = stage_layers(t["num_hidden_layers"], pp, STAGE)
    mla_stage = [i for i in layers if i in full]
    heads, dim, draft_layers = int(d["num_key_value_heads"]), int(d["head_dim"]), int(d["num_hidden_layers"])
    p_heads, d_heads = max(1, heads // p_tp), max(1, heads // d_tp)  # replicated when TP > heads
    ranks = [r for r in range(d_tp) if PREFILL_RANK in prefill_ranks_for(r, prefill_tp=p_tp, decode_tp=d_tp)]
    lin = t["linear_attn_config"]
    return SimpleNamespace(
        p_tp=p_tp, pp=pp, d_tp=d_tp, page=page, chunk_tokens=chunk_tokens, pages=chunk_tokens // page,
        stage_layers=[layers.start, layers.stop], full_attention_layers=len(full),
        mla_stage_layers=mla_stage, mla_decode_index=[full.index(i) for i in mla_stage],
        mla_token_bytes=(int(t["kv_lora_rank"]) + int(t["qk_rope_head_dim"])) * 2,
        draft_entries=2 * draft_layers, draft_layers=draft_layers, kv_heads=heads, head_dim=dim,
        prefill_heads=p_heads, decode_heads=d_heads, decode_ranks=ranks,
        # decode rank r holds head r // (d_tp / heads); the prefill rank's local index of it
        local_head={r: r * heads // d_tp - PREFILL_RANK * p_heads for r in ranks},
        slots_per_rank=len(full) + 2 * draft_layers,
        kda_layers=kda_all, kda_stage_layers=[i for i in layers if i in kda_all],
        state_p=kda_state(lin, p_tp), state_d=kda_state(lin, d_tp), linear_attn_config=lin,
    )  # fmt: skip


def chunk_pages(g, seed=0, pages=None, pool_pages=PREFILL_POOL_PAGES):
    """Source and destination page ids of the chunk: runs of RUN_PAGES at random run slots."""
    rng = np.random.default_rng(seed)
    runs = (pages or g.pages) // RUN_PAGES
    src_runs = rng.choice(pool_pages // RUN_PAGES, runs, replace=False)
    dst_runs = rng.choice(DECODE_POOL_PAGES // RUN_PAGES, runs, replace=False)
    step = np.arange(RUN_PAGES)
    src = (src_runs[:, None] * RUN_PAGES + step).reshape(-1)
    dst = (dst_runs[:, None] * RUN_PAGES + step).reshape(-1)
    return src.astype(np.int64), dst.astype(np.int64), src_runs * RUN_PAGES, dst_runs * RUN_PAGES


def rank_blocks(g, rank, mla_bases, draft_bases, pages, slot0=0, mla=True, draft=True):
    """One decode rank's blocks of the chunk by this script's own formula (the direct variants),
    reading pools at the given base addresses."""
    from sglang_dflash_pp.srt.disaggregation.kv_digest import Blocks

    src, dst, src_starts, dst_starts = pages
    item = g.page * g.mla_token_bytes
    parts = []
    if mla:
        for base, index in zip(mla_bases, g.mla_decode_index):
            parts.append(Blocks.of(base + src_starts * item, dst_starts * item, RUN_PAGES * item,
                                   slot0 + index))  # fmt: skip
    if draft:
        row = g.head_dim * 2
        h = g.local_head[rank]
        for e, base in enumerate(draft_bases):
            parts.append(Blocks.of(
                base + (src * g.page * g.prefill_heads + h) * row, dst * g.page * g.decode_heads * row,
                row, slot0 + g.full_attention_layers + e, rows=g.page,
                src_stride=g.prefill_heads * row, dst_stride=g.decode_heads * row,
            ))  # fmt: skip
    return Blocks.concat(parts)


def keys_of(g):
    from sglang_dflash_pp.srt.disaggregation.kv_digest import BufferKind, buffer_key

    return [buffer_key(BufferKind.KV, i) for i in range(g.slots_per_rank)]


# -- sglang's descriptors ---------------------------------------------------------------------


def decode_kv_ptrs(g, r):
    """Decode rank ``r``'s registered KV entries (24 target MLA layers, then 12 draft entries):
    distinct fake bases, 8 GiB apart."""
    return [((1 + r) << 40) + (j << 33) for j in range(g.slots_per_rank)]


def decode_state_ptrs(g, r):
    """Its state entries (conv of the 69 KDA layers, then their temporal state): fake bases."""
    return [((1 + r) << 40) + (1 << 39) + (c << 30) for c in range(2 * len(g.kda_layers))]


def mla_descriptors(g, src_bases, dst_kv_ptrs, src_pages, dst_pages):
    """sglang 0.5.23 ``_send_kvcache_generic`` for a hybrid-MLA target with layer ids, legacy batch
    path: per stage layer (paired by layer id with the decode's entry), one descriptor per run of
    pages contiguous on both sides (``group_concurrent_contiguous``), as the lists it hands
    ``batch_transfer_sync``."""
    from sglang_dflash_pp.srt.disaggregation.draft_kv_plan import page_runs

    item = g.page * g.mla_token_bytes
    s0, d0, n = (a.tolist() for a in page_runs(src_pages, dst_pages))
    src, dst, length = [], [], []
    for base, j in zip(src_bases, g.mla_decode_index):
        for a, b, c in zip(s0, d0, n):
            src.append(int(base) + a * item)
            dst.append(int(dst_kv_ptrs[j]) + b * item)
            length.append(item * c)
    return src, dst, length


def entry_pairs(src_ids, dst_ids):
    """sglang's ``build_transfer_entry_pairs`` with layer ids: occurrences paired in order."""
    pos = {}
    for j, lid in enumerate(dst_ids):
        pos.setdefault(lid, []).append(j)
    return [(i, pos[lid].pop(0)) for i, lid in enumerate(src_ids)]


def mirror_slice_byte_blocks(*, src_item_len, dst_item_len, src_dim, dst_dim, outer_count,
                             src_attn_tp_size, dst_attn_tp_size, dst_tp_rank_in_group,
                             local_tp_rank_in_group, conv_shard_groups=None):  # fmt: skip
    """sglang 0.5.23 ``disaggregation/utils.py: compute_mamba_state_slice_byte_blocks`` for the
    scatter direction (one prefill rank feeds several decode ranks), the only one this geometry
    takes; ``--check-sglang`` compares it with sglang's own function."""
    if src_dim == 0 or dst_dim == 0 or src_attn_tp_size > dst_attn_tp_size:
        raise NotImplementedError("only the scatter direction of TP-sharded state is mirrored")
    src_b = src_item_len // (src_dim * outer_count)
    dst_b = dst_item_len // (dst_dim * outer_count)
    if conv_shard_groups is not None and sum(conv_shard_groups) == src_dim * src_attn_tp_size:
        logical, s_off, d_off = [], 0, 0
        for full in conv_shard_groups:
            s_sub, d_sub = full // src_attn_tp_size, full // dst_attn_tp_size
            logical.append((s_off + (dst_tp_rank_in_group * d_sub) % s_sub, d_off, d_sub))
            s_off, d_off = s_off + s_sub, d_off + d_sub
    else:
        logical = [((dst_tp_rank_in_group * dst_dim) % src_dim, 0, dst_dim)]
    return [(o * src_dim * src_b + s * src_b, o * dst_dim * dst_b + d * dst_b, n * src_b)
            for o in range(outer_count) for s, d, n in logical]  # fmt: skip


def slice_byte_blocks():
    """sglang's function where sglang is installed, else the mirror (the GPU machine)."""
    try:
        from sglang.srt.disaggregation.utils import compute_mamba_state_slice_byte_blocks

        return compute_mamba_state_slice_byte_blocks, "sglang"
    except ImportError:
        return mirror_slice_byte_blocks, "mirror (sglang not installed)"


def state_entries(g, s):
    """Per-entry (item bytes, slice dim, outer count, conv shard groups) of ``n`` layers' conv
    entries then their temporal entries."""
    conv = (s["conv_item_bytes"], s["conv_slice_dim"], s["conv_outer_count"], s["conv_shard_groups"])
    temporal = (s["temporal_item_bytes"], s["temporal_slice_dim"], s["temporal_outer_count"], None)
    return conv, temporal


def state_descriptors(g, r, src_ptrs, dst_ptrs, slice_fn=mirror_slice_byte_blocks):
    """sglang 0.5.23 ``_send_mamba_state_slice`` of the request's state slot to decode rank ``r``:
    ``src_ptrs`` the stage's 8 conv then 8 temporal entries, ``dst_ptrs`` the decode's 69 + 69."""
    n_p, n_d = len(g.kda_stage_layers), len(g.kda_layers)
    (pc, pt), (dc, dt) = state_entries(g, g.state_p), state_entries(g, g.state_d)
    src_meta, dst_meta = [pc] * n_p + [pt] * n_p, [dc] * n_d + [dt] * n_d
    src, dst, length = [], [], []
    for i, j in entry_pairs(g.kda_stage_layers * 2, g.kda_layers * 2):
        (s_item, s_dim, outer, groups), (d_item, d_dim, _, _) = src_meta[i], dst_meta[j]
        for so, do, nb in slice_fn(
            src_item_len=s_item, dst_item_len=d_item, src_dim=s_dim, dst_dim=d_dim,
            outer_count=outer, src_attn_tp_size=g.p_tp, dst_attn_tp_size=g.d_tp,
            dst_tp_rank_in_group=r % g.d_tp, local_tp_rank_in_group=PREFILL_RANK % g.p_tp,
            conv_shard_groups=groups,
        ):  # fmt: skip
            src.append(int(src_ptrs[i]) + s_item * SRC_STATE_SLOT + so)
            dst.append(int(dst_ptrs[j]) + d_item * DST_STATE_SLOT + do)
            length.append(nb)
    return src, dst, length


def draft_verdict(g, r):
    """The plugin's registration verdict on decode rank ``r`` (``draft_kv_peer.peer_verdict``, as
    the registration hook computes it): prefill entries = the stage's 4 MLA layers then the 12
    draft entries, decode entries = 24 MLA layers then the 12 draft entries, paired by layer id."""
    from sglang_dflash_pp.srt.disaggregation.draft_kv_geometry import DraftKVShape
    from sglang_dflash_pp.srt.disaggregation.draft_kv_peer import DecodePeer, PrefillSide, peer_verdict

    mla_item = g.page * g.mla_token_bytes
    p_draft, d_draft = g.page * g.prefill_heads * g.head_dim * 2, g.page * g.decode_heads * g.head_dim * 2
    n_mla = len(g.mla_stage_layers)
    prefill = PrefillSide(
        tp_size=g.p_tp, tp_rank=PREFILL_RANK, page_size=g.page,
        item_lens=[mla_item] * n_mla + [p_draft] * g.draft_entries,
        num_draft_entries=g.draft_entries, has_layer_ids=True, pp_size=g.pp, pp_rank=STAGE,
        shape=DraftKVShape(total_heads=g.kv_heads, k_head_dim=g.head_dim, v_head_dim=g.head_dim,
                           dtype_bytes=2),
    )  # fmt: skip
    decode = DecodePeer(
        tp_size=g.d_tp, tp_rank=r, item_lens=[mla_item] * g.full_attention_layers + [d_draft] * g.draft_entries,
        num_entries=g.slots_per_rank, has_layer_ids=True,
    )  # fmt: skip
    pairs = list(zip(range(n_mla), g.mla_decode_index)) + [
        (n_mla + e, g.full_attention_layers + e) for e in range(g.draft_entries)]
    return peer_verdict(prefill, decode, pairs)


def _moved(engine, session_id, buffers, peer_buffer_addresses, lengths, *args, **kwargs):
    """Mooncake's ``batch_transfer_sync`` under the digest hook: moves nothing here."""
    return 0


TRANSFERS = None  # a list: each emulated transfer's (requested s, start, end) is appended
# How an emulated transfer waits out its time, the GIL released (``link_wait``): asleep (every
# run before 2026-12-03), or spinning on its core as Mooncake's polling wait does (variants
# ``*_spin``). Switched per variant.
WAIT_UNTIL = link_wait.sleep_until
WAITS = {"sleep": link_wait.sleep_until, "spin": link_wait.spin_until}


def _over_link(nbytes, link_bps):
    """The time Mooncake's ``batch_transfer_sync`` holds the worker for ``nbytes`` at the
    link's rate, with the GIL released as Mooncake releases it (``WAIT_UNTIL``)."""
    t0 = time.perf_counter()
    WAIT_UNTIL(t0 + nbytes / link_bps)
    if TRANSFERS is not None:
        TRANSFERS.append((nbytes / link_bps, t0, time.perf_counter()))  # end: the GIL taken back


class EmulatedLink:
    """Mooncake's ``TransferEngine`` asynchronous batch API (what ``kv_digest_send`` submits a
    worker's transfer to when it digests in the transfer's window) over the emulated link: the
    submit starts the bytes' time at ``bps``, the status waits, the GIL released
    (``WAIT_UNTIL``), for what is left of it; each transfer recorded as ``_over_link`` records
    it. ``bps`` None: the bytes take no time."""

    def __init__(self):
        self.bps = None
        self._ids = itertools.count(1)
        self._due = {}

    def batch_transfer_async_write(self, session_id, buffers, peer_buffer_addresses, lengths):
        i = next(self._ids)
        self._due[i] = (time.perf_counter(), sum(lengths) / self.bps if self.bps else 0.0)
        return i

    def get_batch_transfer_status(self, batch_ids):
        for i in batch_ids:
            t0, want = self._due.pop(i)
            WAIT_UNTIL(t0 + want)
            if TRANSFERS is not None:
                TRANSFERS.append((want, t0, time.perf_counter()))
        return 0


def _wait_of(mode: str) -> str:
    """The suffix of the digest-off variant a variant is compared with: the one whose emulated
    transfers wait the same way (``_spin``: on their core) and whose GPU is as busy (``_busy``:
    the next chunk's forward running meanwhile)."""
    return next((sfx for sfx in ("_busy_spin", "_spin", "_busy") if mode.endswith(sfx)), "")


def _link_parts(moved, t0, t_flush, t1) -> dict:
    """One over-link chunk's wall split: the worker's wait at the status (``flush``), its time
    outside the transfers before it (the hooks, and the GIL when the digest thread holds it),
    and how much later than requested its transfers returned (the GIL taken back)."""
    return dict(flush_wait=t1 - t_flush,
                worker_outside_transfers=(t_flush - t0) - sum(b - a for _, a, b in moved),
                transfers_late=sum((b - a) - want for want, a, b in moved))  # fmt: skip


def _parts_summary(samples, reps) -> dict:
    samples = samples[-reps:]
    return {k: summary([s[k] for s in samples]) for k in (samples[0] if samples else {})}


def _moving(link_bps):
    """Mooncake's ``batch_transfer_sync`` under the digest hook, taking the link's time."""

    def moved(engine, session_id, buffers, peer_buffer_addresses, lengths, *args, **kwargs):
        _over_link(sum(lengths), link_bps)
        return 0

    return moved


class _EveryRoom(dict):
    """``transfer_infos`` for rooms made on the fly: each room's decode requests are ``infos``."""

    def __init__(self, infos):
        super().__init__()
        self._infos = infos

    def get(self, room, default=None):
        return self._infos


class SendPath:
    """One prefill rank's composed-digest send state as the hooks see it: the manager (a
    ``SimpleNamespace`` with what ``kv_digest_send`` and the draft send read), its 8 decode
    registrations, and the chunk's descriptors per decode rank."""

    def __init__(self, g, device, mla_bases, draft_bases, conv_ptrs, temporal_ptrs, pool_lens, pages,
                 slice_fn=mirror_slice_byte_blocks):  # fmt: skip
        from sglang_dflash_pp.srt.disaggregation import kv_digest_send as kds
        from sglang_dflash_pp.srt.disaggregation import mooncake_draft_kv as mdk
        from sglang_dflash_pp.srt.disaggregation.kv_digest import Sender
        from sglang_dflash_pp.srt.disaggregation.kv_digest_engine import DigestEngine

        self.g, self.kds, self.mdk = g, kds, mdk
        self.src_pages, self.dst_pages = pages[0], pages[1]
        self.failures = []
        t0 = time.perf_counter()
        engine = DigestEngine(device, lanes=kds.SEND_LANES)  # as start_send_digest builds it
        self.startup_s = time.perf_counter() - t0
        self.mooncake = SimpleNamespace(name="the manager's MooncakeTransferEngine",
                                        engine=EmulatedLink())  # fmt: skip
        entries = list(mla_bases) + list(draft_bases)
        self.manager = SimpleNamespace(
            # sglang's _prefill_unique_rank: attn_tp_rank * pp_size * cp + pp_rank * cp + cp_rank
            _dflash_kv_digest=kds.SendDigest(engine, Sender(STAGE, PREFILL_RANK, PREFILL_RANK * g.pp + STAGE)),
            engine=self.mooncake, decode_kv_args_table={}, attn_tp_rank=PREFILL_RANK, pp_rank=STAGE,
            conclude_failure=lambda **kw: self.failures.append(kw),
            kv_args=SimpleNamespace(
                kv_data_ptrs=entries, kv_data_lens=list(pool_lens), num_draft_entries=len(draft_bases),
                kv_item_lens=[g.page * g.mla_token_bytes] * len(mla_bases)
                + [g.page * g.prefill_heads * g.head_dim * 2] * len(draft_bases),
                page_size=g.page,
            ),
        )  # fmt: skip
        self.sessions, self.regs, self.sends, self.mla, self.state = {}, {}, {}, {}, {}
        state_src = list(conv_ptrs) + list(temporal_ptrs)
        for r in g.decode_ranks:
            s = self.sessions[r] = f"decode-rank-{r}"
            reg = self.regs[r] = SimpleNamespace(dst_kv_ptrs=decode_kv_ptrs(g, r),
                                                 dst_state_data_ptrs=[decode_state_ptrs(g, r)])  # fmt: skip
            self.manager.decode_kv_args_table[s] = reg
            self.sends[r] = mdk.DraftSend.of(self.manager, draft_verdict(g, r), reg.dst_kv_ptrs)
            self.mla[r] = mla_descriptors(g, mla_bases, reg.dst_kv_ptrs, *pages[:2])
            self.state[r] = state_descriptors(g, r, state_src, reg.dst_state_data_ptrs[0], slice_fn)
        # sglang's transfer_infos: every room goes to the 8 decode ranks (begin_chunk counts them)
        self.manager.transfer_infos = _EveryRoom(
            {s: SimpleNamespace(is_dummy=False, mooncake_session_id=s) for s in self.sessions.values()})
        rank_of = {s: r for r, s in self.sessions.items()}

        def maybe_send_extra(req, state_indices, executor, registration=None):
            """sglang's state send to one decode rank as the hooked engine sees it (what
            ``kv_digest_send.prepare_states`` runs dry on the digest thread): its descriptors
            built as sglang's ``_send_mamba_state_slice`` builds them (``state_descriptors``),
            so the dry run's host work is in the timing."""
            s, r = req.mooncake_session_id, rank_of[req.mooncake_session_id]
            lists = state_descriptors(g, r, state_src, self.regs[r].dst_state_data_ptrs[0], slice_fn)
            return kds.batch_transfer_sync_around(_moved, self.mooncake, s, *lists)

        self.manager.maybe_send_extra = maybe_send_extra
        self.rooms = itertools.count(1000)
        self.popped = {}
        # The same rank with the digest off (what every hook sees when the flag is not given).
        self.manager_off = SimpleNamespace(**{**vars(self.manager), "_dflash_kv_digest": None})
        # as start_send_digest decides it for this engine (True: the worker digests in windows)
        self.manager._dflash_kv_digest.windows = kds.transfer_windows(self.mooncake)

    @property
    def engine(self):
        return self.manager._dflash_kv_digest.engine

    @property
    def windows(self):
        """Whether the worker digests in its transfers' windows (``SendDigest.windows``)."""
        return self.manager._dflash_kv_digest.windows

    @windows.setter
    def windows(self, on):
        self.manager._dflash_kv_digest.windows = bool(on)

    @property
    def stream(self):
        return self.engine._gpu.stream if self.engine.on_gpu else None

    def chunk(self, room, wait_event, last, link_bps=None, digest=True, inline=False):
        """One chunk's sends to the 8 decode ranks as the hooks see them; returns the host clock
        at the ``flush`` call. Without ``link_bps`` the transfers take no time and the flush
        waits for every digest of the chunk (what the digest costs when nothing hides it); with
        it each transfer takes its bytes' time at that rate, the worker waits for the digest
        thread only on the last chunk (``send_aux_around``), and a middle chunk ends as the
        worker's does (``end_chunk``: the thread goes on while the next chunk is sent)."""
        kds, mdk = self.kds, self.mdk
        m = self.manager if digest else self.manager_off
        move = _moved if link_bps is None else _moving(link_bps)
        self.mooncake.engine.bps = link_bps
        # the transfer worker hook's begin_chunk / end_chunk (the chunk's _Pending)
        mdk.begin_chunk(m, SimpleNamespace(room=room, wait_event=wait_event, is_last_chunk=last,
                                           state_indices=[[SRC_STATE_SLOT]] if last else None))
        if inline and digest:  # the synchronous variant: this chunk digested by the worker
            kds._pending().inline = True
        try:
            for r in self.g.decode_ranks:
                session = self.sessions[r]
                with kds.scope(m, session, None):  # send_kvcache_around's stock target send
                    kds.batch_transfer_sync_around(move, self.mooncake, session, *self.mla[r])
                send = self.sends[r]
                # _send_draft_entries' digest part
                kds.add_draft_blocks(m, session, send, self.src_pages, self.dst_pages, send.digest)
                if link_bps is not None:  # the draft's own transfer (no digest scope)
                    kds.batch_transfer_sync_around(move, self.mooncake, session, [0], [0],
                                                   [self.draft_bytes[r]])  # fmt: skip
                if last:  # maybe_send_extra_around
                    with kds.scope(m, session, None, kds.BufferKind.STATE):
                        kds.batch_transfer_sync_around(move, self.mooncake, session, *self.state[r])
            t_flush = time.perf_counter()
            if link_bps is None or last or inline:
                kds.flush(m)  # send_aux_around's wait for the digest thread
            return t_flush
        finally:
            mdk.end_chunk()

    def drain(self):
        """Wait for the digest thread's queue and read the sums still on the GPU (untimed,
        between samples: what a room's status does before its sums are sent); its seconds."""
        t0 = time.perf_counter()
        assert self.manager._dflash_kv_digest.thread.wait(60)
        self.manager._dflash_kv_digest.settle_parked(block=True)
        return time.perf_counter() - t0

    @property
    def draft_bytes(self):
        if not hasattr(self, "_draft_bytes"):
            self._draft_bytes = {
                r: self._draft_blocks(r).total_bytes
                for r in self.g.decode_ranks}  # fmt: skip
        return self._draft_bytes

    def _draft_blocks(self, r):
        """Decode rank ``r``'s draft blocks as the draft send's digest builds them."""
        return self.kds.DraftPart(self.sends[r].digest, self.src_pages, self.dst_pages, {}).blocks()

    def blocks(self, last):
        """The blocks the hooks queue per decode rank (as ``_Scope.add`` and the draft send
        build them), built once for the add_blocks + flush variant."""
        out = {}
        for r in self.g.decode_ranks:
            kv, state = self.kds.tables_of(self.regs[r])
            parts = [kv.blocks(*(np.asarray(a, np.int64) for a in self.mla[r])),
                     self._draft_blocks(r)]
            if last:
                parts.append(state.blocks(*(np.asarray(a, np.int64) for a in self.state[r])))
            out[r] = parts
        return out

    def add_and_flush(self, room, wait_event, blocks):
        kds, m = self.kds, self.manager
        self.mdk.begin_chunk(m, SimpleNamespace(room=room, wait_event=wait_event, is_last_chunk=False))
        try:
            for r in self.g.decode_ranks:
                for b in blocks[r]:
                    kds.add_blocks(m, room, self.sessions[r], self.regs[r], b)
            t_flush = time.perf_counter()
            kds.flush(m)
            return t_flush
        finally:
            self.mdk.end_chunk()

    def pop(self, room):
        """The room's contributions per decode rank (what ``send_aux_around`` sends)."""
        digest = self.manager._dflash_kv_digest
        self.popped = {r: digest.pop(room, self.sessions[r]) for r in self.g.decode_ranks}
        return self.popped

    def bytes(self, last):
        n = sum(sum(self.mla[r][2]) for r in self.g.decode_ranks)
        n += sum(b.total_bytes for parts in self.blocks(False).values() for b in parts[1:])
        if last:
            n += sum(sum(self.state[r][2]) for r in self.g.decode_ranks)
        return n


def no_prepare(manager, chunk, reqs):
    """``kv_digest_send.prepare_states`` off (modes ``_no_prepare``, ``_at_last_rank_only``: the
    code before it, where a last chunk's state is digested at its send)."""


def at_last_rank_only(self, session, handed_before):
    """012a25a's ``_Pending.digest_during``, restated for the same-run comparison (mode
    ``_at_last_rank_only``; not shipped): on a last chunk with its decode ranks known, one engine
    call, at the last rank's first long transfer, over the ranks before it; the rest at the
    status."""
    if not self.last or self.inline:
        return False
    others = len(handed_before - {session})
    if self.ranks > 1:
        return others >= self.ranks - 1
    if self.ranks == 1:
        return session in handed_before
    return others >= 1


def waiting_submit(engine):
    """``DigestEngine.submit`` as the code before 2026-12-03 called its engine: each call waited
    for its sums before returning (restated for the same-run comparison, modes
    ``_window_waits``: the worker's windows then waited for the GPU; not shipped). Returns the
    engine's real submit, to put back."""
    from sglang_dflash_pp.srt.disaggregation.kv_digest_engine import Sums

    real = engine.submit

    def submit(blocks, keys, wait_events=()):
        return Sums(real(blocks, keys, wait_events=wait_events).result())

    engine.submit = submit
    return real


def l2_flush_event(torch, forward, flush_buf):
    """The L2 flush (``flush_buf`` filled on the ``forward`` stream) stands for the forward's KV
    writes: the event the digest must wait on, already passed when returned."""
    with torch.cuda.stream(forward):
        flush_buf.fill_(1)
        e = torch.cuda.Event()
        e.record(forward)
    e.synchronize()
    return e


def make_pools(g, dev, pool_pages, torch):
    """The prefill rank's pools: the stage's MLA layers, the draft entries (NHD), KDA state."""
    gen = torch.Generator(device=dev).manual_seed(0)
    rnd = lambda *shape, dt=torch.bfloat16: torch.randn(*shape, device=dev, generator=gen).to(dt)  # noqa: E731
    mla = [rnd(pool_pages * g.page, g.mla_token_bytes // 2) for _ in g.mla_stage_layers]
    draft = [rnd(pool_pages * g.page, g.prefill_heads, g.head_dim) for _ in range(g.draft_entries)]
    n, sp = len(g.kda_stage_layers), g.state_p
    conv = rnd(n, STATE_SLOTS, *sp["conv_shape"])
    temporal = rnd(n, STATE_SLOTS, *sp["temporal_shape"], dt=torch.float32)
    return SimpleNamespace(mla=mla, draft=draft, conv=conv, temporal=temporal,
                           lens=[p.numel() * p.element_size() for p in mla + draft])  # fmt: skip


def send_path_of(g, pools, pages, device, slice_fn=mirror_slice_byte_blocks):
    return SendPath(g, device, [p.data_ptr() for p in pools.mla], [p.data_ptr() for p in pools.draft],
                    [pools.conv[k].data_ptr() for k in range(pools.conv.shape[0])],
                    [pools.temporal[k].data_ptr() for k in range(pools.temporal.shape[0])],
                    pools.lens, pages, slice_fn)  # fmt: skip


def decode_side_state(g, sp, r, conv_cpu, temporal_cpu, torch, slice_fn=mirror_slice_byte_blocks):
    """Decode rank ``r``'s own digest of its state slot once the state descriptors' bytes landed:
    a host model of its state pool, the descriptors (rebuilt with host addresses) copied by
    ``ctypes.memmove``, then ``kv_digest_verify.request_blocks`` (what the decode digests of a
    request) over it. Returns (the stage's state buffers compared, equal, bytes moved)."""
    from sglang_dflash_pp.srt.disaggregation import kv_digest as kd
    from sglang_dflash_pp.srt.disaggregation import kv_digest_verify as kv

    n_d, sd = len(g.kda_layers), g.state_d
    dconv = torch.zeros(n_d, DECODE_STATE_SLOTS, *sd["conv_shape"], dtype=torch.bfloat16)
    dtemp = torch.zeros(n_d, DECODE_STATE_SLOTS, *sd["temporal_shape"], dtype=torch.float32)
    dst_ptrs = [dconv[k].data_ptr() for k in range(n_d)] + [dtemp[k].data_ptr() for k in range(n_d)]
    src_ptrs = [conv_cpu[k].data_ptr() for k in range(conv_cpu.shape[0])] + [
        temporal_cpu[k].data_ptr() for k in range(temporal_cpu.shape[0])]
    src, dst, length = state_descriptors(g, r, src_ptrs, dst_ptrs, slice_fn)
    for a, b, c in zip(src, dst, length):
        ctypes.memmove(b, a, c)
    kv_args = SimpleNamespace(
        kv_data_ptrs=sp.regs[r].dst_kv_ptrs, kv_item_lens=[0] * g.slots_per_rank,
        state_data_ptrs=[dst_ptrs],
        state_item_lens=[[sd["conv_item_bytes"]] * n_d + [sd["temporal_item_bytes"]] * n_d],
    )  # fmt: skip
    tables = kv.decode_tables(kv_args)
    own = kd.as_sums(tables, kd.digest_blocks_host(
        kv.request_blocks(kv_args, np.zeros(0, np.int64), [DST_STATE_SLOT]), kd.slots_of(tables)))
    stage = [(int(kd.BufferKind.STATE), c) for c in range(2 * n_d)
             if g.kda_layers[c % n_d] in g.kda_stage_layers]  # fmt: skip
    sent = {k: v for k, v in sp.popped[r].sums.items() if k[0] == int(kd.BufferKind.STATE)}
    equal = sorted(sent) == sorted(stage) and all(own[k] == sent[k] for k in stage)
    return len(stage), bool(equal), int(sum(length))


def summary(samples):
    import provenance

    return dict(samples=samples, **provenance.summary(samples))


def run(args):
    import torch

    import provenance
    from sglang_dflash_pp.srt.disaggregation import kv_digest as kd
    from sglang_dflash_pp.srt.disaggregation import kv_digest_triton as kt

    g = geometry()
    dev = torch.device("cuda")
    pools = make_pools(g, dev, PREFILL_POOL_PAGES, torch)
    mla_pools, draft_pools = pools.mla, pools.draft
    mla_bases = [p.data_ptr() for p in mla_pools]
    draft_bases = [p.data_ptr() for p in draft_pools]
    pages = chunk_pages(g)
    keys = keys_of(g)
    n_ranks, spr = len(g.decode_ranks), g.slots_per_rank
    per_rank = [rank_blocks(g, r, mla_bases, draft_bases, pages) for r in g.decode_ranks]
    chunk = kd.Blocks.concat(
        [rank_blocks(g, r, mla_bases, draft_bases, pages, slot0=i * spr) for i, r in enumerate(g.decode_ranks)]
    )
    mla_once = kd.Blocks.concat(
        [rank_blocks(g, g.decode_ranks[0], mla_bases, draft_bases, pages, draft=False)]
        + [rank_blocks(g, r, mla_bases, draft_bases, pages, slot0=i * spr, mla=False)
           for i, r in enumerate(g.decode_ranks)]
    )  # fmt: skip
    chunk_keys = keys * n_ranks
    chunk_bytes = chunk.total_bytes
    link_s = chunk_bytes / LINK_BPS

    t0 = time.perf_counter()
    from sglang_dflash_pp.srt.disaggregation.kv_digest_send import SEND_LANES

    dig = kt.DeviceDigest(dev, max_blocks=args.max_blocks, max_slots=args.max_slots, lanes=SEND_LANES)
    dig.warm()
    torch.cuda.synchronize()
    startup_s = time.perf_counter() - t0

    # The shipped send path: its DigestEngine (what the prefill builds at startup) and manager.
    slice_fn, slice_src = slice_byte_blocks()
    sp = send_path_of(g, pools, pages, dev, slice_fn)
    torch.cuda.synchronize()
    bytes_mid, bytes_last = sp.bytes(False), sp.bytes(True)
    link_mid, link_last = bytes_mid / LINK_BPS, bytes_last / LINK_BPS
    blocks_mid, blocks_last = sp.blocks(False), sp.blocks(True)

    forward = torch.cuda.Stream()
    flush_buf = torch.empty(512 << 20, dtype=torch.uint8, device=dev)
    # The next chunk's forward, as in serving (the prefill computes chunk k+1 while chunk k
    # moves): bf16 GEMMs queued on a stream of their own just before a ``_busy`` sample, about as
    # long as the chunk's transfers; waited for after the sample (untimed).
    busy_stream = torch.cuda.Stream()
    gemm = [torch.randn(BUSY_GEMM, BUSY_GEMM, device=dev, dtype=torch.bfloat16) for _ in range(3)]

    def load_gpu():
        with torch.cuda.stream(busy_stream):
            for _ in range(BUSY_GEMMS):
                torch.mm(gemm[0], gemm[1], out=gemm[2])

    def busy_gpu_ms():
        """How long the queued forward keeps the GPU busy alone (ms, CUDA events)."""
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(busy_stream)
        load_gpu()
        b.record(busy_stream)
        b.synchronize()
        return a.elapsed_time(b)

    busy_gpu_ms()
    busy_alone_ms = sorted(busy_gpu_ms() for _ in range(5))[2]

    def kv_written():
        return l2_flush_event(torch, forward, flush_buf)

    def jit(fn):
        """``fn`` with the DeviceDigest launching through Triton's JIT (its fallback)."""
        def run_jit(e):
            direct, dig._direct = dig._direct, None
            try:
                fn(e)
            finally:
                dig._direct = direct
        return run_jit

    def timed(variants):
        """Every variant once per repetition, in a rotating order (drift of the machine's clocks
        or load falls on all of them alike). A variant is (fn(event), stream to put its CUDA
        events on, optional untimed fn run after it); fn may return the host clock at its
        ``flush`` call (the shipped variants), which splits its wall time."""
        out = {name: dict(wall=[], gpu=[], before_flush=[], flush=[]) for name in variants}
        names = list(variants)
        for i in range(args.warmup + args.reps):
            for name in names[i % len(names):] + names[: i % len(names)]:
                fn, stream, after = variants[name]
                e = kv_written()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record(stream)
                t0 = time.perf_counter()
                split = fn(e)
                t1 = time.perf_counter()
                b.record(stream)
                b.synchronize()
                if after is not None:
                    after()
                if i >= args.warmup:
                    o = out[name]
                    o["wall"].append(t1 - t0)
                    o["gpu"].append(a.elapsed_time(b) / 1e3)
                    if isinstance(split, float):
                        o["before_flush"].append(split - t0)
                        o["flush"].append(t1 - split)
        res = {}
        for name, o in out.items():
            res[name] = dict(wall_s=summary(o["wall"]), gpu_s=summary(o["gpu"]))
            if o["flush"]:
                res[name]["wall_before_flush_s"] = summary(o["before_flush"])
                res[name]["wall_flush_s"] = summary(o["flush"])
        return res

    room = {"now": None}

    def shipped(last):
        def fn(e):
            room["now"] = next(sp.rooms)
            return sp.chunk(room["now"], e, last)
        return fn

    def prebuilt(blocks):
        def fn(e):
            room["now"] = next(sp.rooms)
            return sp.add_and_flush(room["now"], e, blocks)
        return fn

    def pop():
        sp.pop(room["now"])

    def handoff_alone(last, on=True):
        """The worker's side alone: the shipped hooks hand the chunk's sends over, but the digest
        thread gets none of its jobs (``DigestThread.submit`` stubbed for the call, the jobs
        dropped: no sums), so nothing competes for the GIL before ``flush``; the time to the
        ``flush`` call is the hooks' own host cost (``on=False``: the same hooks, digest off)."""
        thread = sp.manager._dflash_kv_digest.thread

        def fn(e):
            room["now"] = next(sp.rooms)
            thread.submit = lambda *a: None
            sp.windows = False  # (with windows the worker would digest in its transfers)
            try:
                return sp.chunk(room["now"], e, last, digest=on)
            finally:
                del thread.submit
                sp.windows = True
        return fn

    # Over an emulated link (each transfer takes its bytes' time at LINK_BPS, the GIL released):
    # the chunk's wall time with the digest on against the same sends with it off, in one loop.
    # After each sample (untimed) the digest thread's queue is drained: its lag behind the
    # worker, and its busy time for the chunk.
    thread_use = {}

    # The shipped path (every chunk on the digest thread; a last chunk also digested during its
    # own transfers of at least EAGER_DIGEST_MIN_BYTES) against: every chunk inline (the worker
    # resolves and digests its chunk itself before the chunk ends or at the status: the
    # synchronous design, and for a last chunk the previous shipped design, the same functions),
    # and a last chunk on the thread without those eager digests (all of it at the status);
    # same run.
    kds = sp.kds
    # "windows": the worker digests its chunk inside its own transfers (Mooncake's asynchronous
    # batch API, what ships where the engine has it); without it, the digest thread's schedule
    # (``_thread``: the code before the windows, still what ships for an engine without it),
    # which every restated earlier schedule below varies.
    modes = {"": dict(inline=False, windows=True), "_thread": dict(inline=False),
             "_all_inline": dict(inline=True),
             "_no_eager": dict(inline=False, eager_min_bytes=1 << 62),
             "_no_prepare": dict(inline=False, prepare=False),
             "_at_last_rank_only": dict(inline=False, digest_during=at_last_rank_only, prepare=False),
             # a what-if, not shipped: the interpreter hands the GIL to a waiting thread after
             # 0.5 ms instead of 5 (does the worker wait out whole switch intervals?)
             "_switch_interval": dict(inline=False, switch_interval=SWITCH_INTERVAL_WHAT_IF_S),
             # the same two schedules, each transfer waiting on its core as Mooncake's polling
             # wait does (``link_wait.spin_until``), against the digest off waiting so too
             # the shipped windows with every engine call waiting for its sums (the code before
             # the asynchronous engine calls, restated: ``waiting_submit``)
             "_window_waits": dict(inline=False, windows=True, window_waits=True),
             # the GPU busy with the next chunk's forward meanwhile (``load_gpu``), both ways
             "_busy": dict(inline=False, windows=True, busy=True),
             "_window_waits_busy": dict(inline=False, windows=True, window_waits=True, busy=True),
             **({"_spin": dict(inline=False, windows=True, wait="spin"),
                 # both: the GPU busy and each transfer waiting on its core (serving with
                 # Mooncake's polling wait), the digest off so too
                 "_busy_spin": dict(inline=False, windows=True, busy=True, wait="spin"),
                 "_thread_spin": dict(inline=False, wait="spin"),
                 "_window_waits_spin": dict(inline=False, windows=True, window_waits=True,
                                            wait="spin")} if link_wait.spin_until else {})}  # fmt: skip
    mode_chunks = {"": ("middle", "last"), "_thread": ("middle", "last"),
                   "_all_inline": ("middle", "last"), "_no_eager": ("last",),
                   "_no_prepare": ("last",), "_at_last_rank_only": ("last",),
                   "_switch_interval": ("last",), "_spin": ("middle", "last"),
                   "_thread_spin": ("middle", "last"), "_window_waits": ("middle", "last"),
                   "_busy": ("middle", "last"), "_window_waits_busy": ("middle", "last"),
                   "_window_waits_spin": ("middle", "last"), "_busy_spin": ("middle", "last")}  # fmt: skip
    shipped_prepare = kds.prepare_states
    thread_use.update({f"{w}{m}": dict(lag=[], busy=[]) for m in modes for w in mode_chunks[m]})
    # Each over-link sample's wall split as the breakdown pass splits it (``_link_parts``), in
    # this rotating loop: does the same code spend the same time in the same places here?
    link_parts = collections.defaultdict(list)

    def over_link(last, on, mode=""):
        def fn(e):
            room["now"] = next(sp.rooms)
            room["busy0"] = sp.manager._dflash_kv_digest.thread.busy_s
            shipped_eager, shipped_rule = kds.EAGER_DIGEST_MIN_BYTES, kds._Pending.digest_during
            kds.EAGER_DIGEST_MIN_BYTES = modes[mode].get("eager_min_bytes", shipped_eager)
            kds._Pending.digest_during = modes[mode].get("digest_during", shipped_rule)
            if not modes[mode].get("prepare", True):
                kds.prepare_states = no_prepare
            switch_interval = sys.getswitchinterval()
            sys.setswitchinterval(modes[mode].get("switch_interval", switch_interval))
            sp.windows = modes[mode].get("windows", False)
            real_submit = waiting_submit(sp.engine) if modes[mode].get("window_waits") else None
            global TRANSFERS, WAIT_UNTIL
            TRANSFERS = []
            WAIT_UNTIL = WAITS[modes[mode].get("wait", "sleep")]
            if modes[mode].get("busy"):
                load_gpu()
            try:
                t0 = time.perf_counter()
                t_flush = sp.chunk(room["now"], e, last, link_bps=LINK_BPS, digest=on,
                                   inline=modes[mode]["inline"])  # fmt: skip
                link_parts[(("last" if last else "middle") + mode, on)].append(
                    _link_parts(TRANSFERS, t0, t_flush, time.perf_counter()))
                return t_flush
            finally:
                if real_submit is not None:
                    del sp.engine.submit
                TRANSFERS = None
                WAIT_UNTIL = link_wait.sleep_until
                sp.windows = True
                sys.setswitchinterval(switch_interval)
                kds.EAGER_DIGEST_MIN_BYTES = shipped_eager
                kds._Pending.digest_during = shipped_rule
                kds.prepare_states = shipped_prepare
        return fn

    def drained(last, mode=""):
        def after():
            busy_stream.synchronize()
            lag = sp.drain()
            use = thread_use[("last" if last else "middle") + mode]
            use["lag"].append(lag)
            use["busy"].append(sp.manager._dflash_kv_digest.thread.busy_s - room["busy0"])
            sp.pop(room["now"])
        return after

    # A whole request over the link: REQUEST_CHUNKS - 1 middle chunks then the last, one room,
    # back to back (a middle chunk's digest still running on the thread while the next is sent,
    # as in serving); digest on (shipped), every chunk inline, and off.
    def request(on, inline=False, prepare=True, windows=True, wait="sleep", window_waits=False):
        def fn(e):
            global WAIT_UNTIL
            room["now"] = next(sp.rooms)
            room["busy0"] = sp.manager._dflash_kv_digest.thread.busy_s
            if not prepare:
                kds.prepare_states = no_prepare
            sp.windows = windows
            WAIT_UNTIL = WAITS[wait]
            real_submit = waiting_submit(sp.engine) if window_waits else None
            try:
                for i in range(REQUEST_CHUNKS):
                    last = i == REQUEST_CHUNKS - 1
                    sp.chunk(room["now"], e, last, link_bps=LINK_BPS, digest=on, inline=inline)
            finally:
                if real_submit is not None:
                    del sp.engine.submit
                kds.prepare_states = shipped_prepare
                sp.windows = True
                WAIT_UNTIL = link_wait.sleep_until
        return fn

    def request_after():
        sp.drain()
        sp.pop(room["now"])

    chunk_call = lambda e: dig.digest(chunk, chunk_keys, wait_events=(e,))  # noqa: E731
    results = timed({
        f"over_link_request_{REQUEST_CHUNKS}_chunks_digest_on": (request(True), sp.stream, request_after),
        f"over_link_request_{REQUEST_CHUNKS}_chunks_digest_on_all_inline": (
            request(True, inline=True), sp.stream, request_after),
        f"over_link_request_{REQUEST_CHUNKS}_chunks_digest_on_thread": (
            request(True, windows=False), sp.stream, request_after),
        f"over_link_request_{REQUEST_CHUNKS}_chunks_digest_on_no_prepare": (
            request(True, prepare=False, windows=False), sp.stream, request_after),
        f"over_link_request_{REQUEST_CHUNKS}_chunks_digest_off": (request(False), sp.stream, None),
        f"over_link_request_{REQUEST_CHUNKS}_chunks_digest_on_window_waits": (
            request(True, window_waits=True), sp.stream, request_after),
        **({f"over_link_request_{REQUEST_CHUNKS}_chunks_digest_on_spin": (
                request(True, wait="spin"), sp.stream, request_after),
            f"over_link_request_{REQUEST_CHUNKS}_chunks_digest_on_window_waits_spin": (
                request(True, wait="spin", window_waits=True), sp.stream, request_after),
            f"over_link_request_{REQUEST_CHUNKS}_chunks_digest_on_thread_spin": (
                request(True, windows=False, wait="spin"), sp.stream, request_after),
            f"over_link_request_{REQUEST_CHUNKS}_chunks_digest_off_spin": (
                request(False, wait="spin"), sp.stream, None),
            "over_link_middle_chunk_digest_off_spin": (over_link(False, False, "_spin"), sp.stream, None),
            "over_link_last_chunk_digest_off_spin": (over_link(True, False, "_spin"), sp.stream, None),
            "over_link_middle_chunk_digest_off_busy_spin": (over_link(False, False, "_busy_spin"),
                                                            sp.stream, busy_stream.synchronize),
            "over_link_last_chunk_digest_off_busy_spin": (over_link(True, False, "_busy_spin"),
                                                          sp.stream, busy_stream.synchronize),
            } if link_wait.spin_until else {}),
        **{f"over_link_{w}_chunk_digest_on{m}": (over_link(w == "last", True, m), sp.stream,
                                                 drained(w == "last", m))
           for m in modes for w in mode_chunks[m]},
        "over_link_middle_chunk_digest_off": (over_link(False, False), sp.stream, None),
        "over_link_last_chunk_digest_off": (over_link(True, False), sp.stream, None),
        "over_link_middle_chunk_digest_off_busy": (over_link(False, False, "_busy"), sp.stream,
                                                   busy_stream.synchronize),
        "over_link_last_chunk_digest_off_busy": (over_link(True, False, "_busy"), sp.stream,
                                                 busy_stream.synchronize),
        "shipped_send_path_middle_chunk": (shipped(False), sp.stream, pop),
        "shipped_send_path_last_chunk": (shipped(True), sp.stream, pop),
        "shipped_add_blocks_flush_middle_chunk": (prebuilt(blocks_mid), sp.stream, pop),
        "shipped_add_blocks_flush_last_chunk": (prebuilt(blocks_last), sp.stream, pop),
        "handoff_alone_middle_chunk": (handoff_alone(False), sp.stream, None),
        "handoff_alone_last_chunk": (handoff_alone(True), sp.stream, None),
        "handoff_alone_middle_chunk_digest_off": (handoff_alone(False, on=False), sp.stream, None),
        "handoff_alone_last_chunk_digest_off": (handoff_alone(True, on=False), sp.stream, None),
        "direct_call_formula_blocks": (chunk_call, dig.stream, None),
        "direct_call_formula_blocks_jit_launch": (jit(chunk_call), dig.stream, None),
        "direct_calls_per_rank_formula_blocks": (
            lambda e: [dig.digest(b, keys, wait_events=(e,)) for b in per_rank], dig.stream, None),
        "direct_call_formula_blocks_mla_once": (
            lambda e: dig.digest(mla_once, chunk_keys, wait_events=(e,)), dig.stream, None),
        # The fixed part of a call: zeros and keys up, sums down, synchronize (no launch).
        "direct_call_empty": (
            lambda e: dig.digest(kd.Blocks.empty(), chunk_keys, wait_events=(e,)), dig.stream, None),
    })  # fmt: skip
    direct = dig._direct
    results["busy_forward"] = dict(gemms=BUSY_GEMMS, shape=[BUSY_GEMM] * 3, dtype="bfloat16",
                                   gpu_ms_alone_median_of_5=busy_alone_ms)  # fmt: skip
    link_request = (REQUEST_CHUNKS - 1) * link_mid + link_last
    for mode in ("", "_thread", "_all_inline", "_no_prepare", "_spin", "_thread_spin",
                 "_window_waits", "_window_waits_spin"):
        if f"over_link_request_{REQUEST_CHUNKS}_chunks_digest_on{mode}" not in results:
            continue
        off = results[f"over_link_request_{REQUEST_CHUNKS}_chunks_digest_off{_wait_of(mode)}"]["wall_s"]
        on = results[f"over_link_request_{REQUEST_CHUNKS}_chunks_digest_on{mode}"]["wall_s"]
        results[f"over_link_request_{REQUEST_CHUNKS}_chunks_exposed{mode}"] = dict(
            chunks=REQUEST_CHUNKS, exposed_s=on["median"] - off["median"],
            over_link_time=(on["median"] - off["median"]) / link_request, emulated_link_s=link_request,
            wall_on_median_s=on["median"], wall_off_median_s=off["median"])  # fmt: skip
    for (which, link), mode in itertools.product((("middle", link_mid), ("last", link_last)), modes):
        if f"over_link_{which}_chunk_digest_on{mode}" not in results:
            continue
        on = results[f"over_link_{which}_chunk_digest_on{mode}"]["wall_s"]
        off = results[f"over_link_{which}_chunk_digest_off{_wait_of(mode)}"]["wall_s"]
        use = thread_use[which + mode]
        n = min(len(use["busy"]), len(use["lag"]))
        busy = use["busy"][-args.reps:] if n >= args.reps else use["busy"]
        lag = use["lag"][-args.reps:] if n >= args.reps else use["lag"]
        results[f"over_link_{which}_chunk_exposed{mode}"] = dict(
            inline=modes[mode]["inline"], windows=modes[mode].get("windows", False),
            link_wait=modes[mode].get("wait", "sleep"),
            eager_digest_min_bytes=(modes[mode].get("eager_min_bytes", kds.EAGER_DIGEST_MIN_BYTES)
                                    if which == "last" else None),  # fmt: skip
            exposed_s=on["median"] - off["median"],
            over_link_time=(on["median"] - off["median"]) / link,
            emulated_link_s=link, wall_on_median_s=on["median"], wall_off_median_s=off["median"],
            wall_off_over_link_time=off["median"] / link,
            thread_busy_s=summary(busy), thread_busy_over_link_time=statistics.median(busy) / link,
            thread_lag_after_chunk_s=summary(lag),
            wall_parts_on=_parts_summary(link_parts[(which + mode, True)], args.reps),
            wall_parts_off=_parts_summary(link_parts[(which + _wait_of(mode), False)], args.reps),
        )  # fmt: skip

    # The engine calls per chunk (DigestEngine.submit, and the wait for its sums: each call timed
    # to its result), host clock, against the worker's wait at the flush; the engine call
    # wrapped only in this pass (no link: nothing hides the digest).
    def flush_breakdown(last):
        engine = sp.engine
        real, calls = engine.submit, []

        def counted(blocks, k, wait_events=()):
            t0 = time.perf_counter()
            out = real(blocks, k, wait_events=wait_events)
            out.result()
            calls.append((time.perf_counter() - t0, blocks.count, len(k), blocks.total_bytes))
            return out

        engine.submit = counted
        flush, eng, n_calls, per_chunk = [], [], [], None
        try:
            for i in range(args.warmup + args.reps):
                e = kv_written()
                r = next(sp.rooms)
                first = len(calls)
                t_flush = sp.chunk(r, e, last)
                t = time.perf_counter() - t_flush
                sp.drain()
                sp.pop(r)
                mine = calls[first:]  # the digest thread's engine calls for this chunk
                if i >= args.warmup:
                    flush.append(t)
                    eng.append(sum(c[0] for c in mine))
                    n_calls.append(len(mine))
                    per_chunk = mine
        finally:
            del engine.submit
        return dict(flush_s=summary(flush), engine_digest_s=summary(eng),
                    engine_calls_per_chunk=summary(n_calls),
                    blocks=sum(c[1] for c in per_chunk), keys=sum(c[2] for c in per_chunk),
                    bytes=sum(c[3] for c in per_chunk))  # fmt: skip

    results["shipped_flush_breakdown_middle_chunk"] = flush_breakdown(False)
    results["shipped_flush_breakdown_last_chunk"] = flush_breakdown(True)

    # Where a last chunk's exposed time goes over the link, a separate pass (its own loop; the
    # timing wrappers add a little to every variant): the worker's wait at the status (the
    # tail), its time outside the transfers (the hooks' hand-offs, and the GIL when the thread
    # holds it), how much later than requested its transfers returned (the GIL taken back), and
    # the digest thread's time per job kind and in engine calls.
    def over_link_breakdown(mode):
        global TRANSFERS
        thread = sp.manager._dflash_kv_digest.thread
        engine = sp.engine
        real_timed, real_submit, real_resolved = thread._timed, engine.submit, kds._resolved_lists
        jobs, engine_calls, job_parts = {}, [], []  # job_parts: per digest job, in order

        def timed_job(fn, *a):
            t0 = time.perf_counter()
            if fn is kds._digest_and_settle:
                job_parts.append(dict(resolve=0.0, engine=0.0))
            real_timed(fn, *a)
            name = getattr(fn, "__name__", "?")
            jobs[name] = jobs.get(name, 0.0) + time.perf_counter() - t0
            if fn is kds._digest_and_settle:
                job_parts[-1]["job"] = time.perf_counter() - t0

        def counted(blocks, k, wait_events=()):  # the submit's host time (windows: all it costs)
            t0 = time.perf_counter()
            out = real_submit(blocks, k, wait_events=wait_events)
            engine_calls.append(time.perf_counter() - t0)
            if job_parts:
                job_parts[-1]["engine"] += engine_calls[-1]
            return out

        def resolved(*a):
            t0 = time.perf_counter()
            try:
                return real_resolved(*a)
            finally:
                if job_parts:
                    job_parts[-1]["resolve"] += time.perf_counter() - t0

        thread._timed, engine.submit, kds._resolved_lists = timed_job, counted, resolved
        shipped_rule = kds._Pending.digest_during
        sp.windows = mode in ("shipped", "all_inline", "off")
        if mode == "at_last_rank_only":
            kds._Pending.digest_during = at_last_rank_only
        if mode in ("at_last_rank_only", "no_prepare"):
            kds.prepare_states = no_prepare
        samples = []
        try:
            for i in range(args.warmup + args.reps):
                TRANSFERS, jobs_before = [], dict(jobs)
                engine_calls.clear()
                job_parts.clear()
                e = kv_written()
                r = next(sp.rooms)
                t0 = time.perf_counter()
                t_flush = sp.chunk(r, e, True, link_bps=LINK_BPS, digest=mode != "off",
                                   inline=mode == "all_inline")  # fmt: skip
                t1 = time.perf_counter()
                moved = TRANSFERS
                TRANSFERS = None
                sp.drain()
                if mode != "off":
                    sp.pop(r)
                if i >= args.warmup:
                    samples.append(dict(
                        wall=t1 - t0, **_link_parts(moved, t0, t_flush, t1),
                        engine_calls=len(engine_calls), engine_s=sum(engine_calls),
                        # the digest job the status waited for (the chunk's last one), and its parts
                        **({f"tail_job_{k}": v for k, v in job_parts[-1].items()}
                           if mode in ("shipped", "thread", "no_prepare") and job_parts else {}),
                        **{f"thread_{k}": v - jobs_before.get(k, 0.0) for k, v in jobs.items()}))
        finally:
            TRANSFERS = None
            thread._timed, kds._resolved_lists = real_timed, real_resolved
            del engine.submit
            kds._Pending.digest_during = shipped_rule
            kds.prepare_states = shipped_prepare
            sp.windows = True
        keys = sorted({k for s_ in samples for k in s_})
        return {k: summary([s_.get(k, 0.0) for s_ in samples]) for k in keys}

    results["over_link_last_chunk_breakdown"] = {
        m: over_link_breakdown(m)
        for m in ("shipped", "thread", "no_prepare", "at_last_rank_only", "all_inline", "off")}

    # Where a direct chunk call's time goes: DeviceDigest's own marks (host clock and an event on
    # its stream at each step), relative to the call's start.
    def call_steps():
        steps = {}
        for i in range(args.warmup + args.reps):
            e = kv_written()
            dig.trace = []
            dig.digest(chunk, chunk_keys, wait_events=(e,))
            trace, dig.trace = dig.trace, None
            if i >= args.warmup:
                t0, e0 = trace[0][1], trace[0][2]
                for label, t, ev in trace[1:]:
                    d = steps.setdefault(label, dict(host_s=[], gpu_s=[]))
                    d["host_s"].append(t - t0)
                    d["gpu_s"].append(e0.elapsed_time(ev) / 1e3)
        return {k: {c: summary(v) for c, v in d.items()} for k, d in steps.items()}

    results["direct_call_steps"] = call_steps()
    dig._direct = None
    results["direct_call_steps_jit_launch"] = call_steps()
    dig._direct = direct

    # Host part alone.
    host = []
    cols, shared = np.zeros(7 * chunk.count, dtype=np.int64), np.zeros(chunk.count, dtype=np.int64)
    for i in range(args.warmup + args.reps):
        t0 = time.perf_counter()
        kt.fill_table(chunk, 0, chunk.count, cols, shared)
        if i >= args.warmup:
            host.append(time.perf_counter() - t0)
    results["host_prep"] = dict(wall_s=summary(host))

    # The kernel alone, the chunk's table on the device as the call left it (in the lane it
    # took: the last one used).
    dig.digest(chunk, chunk_keys)
    lane = dig.lanes[(dig._next - 1) % len(dig.lanes)]
    plan = kt.fill_table(chunk, 0, chunk.count, cols, shared)
    nk = len(chunk_keys)
    keys_at = kt.STATUS + nk + nk % 2  # DeviceDigest's layout: [status | sums | keys | columns | shared]
    cols_at = keys_at + nk + nk % 2
    table = kt.column_table(lane.dev[cols_at:], chunk.count)
    split_dev = lane.dev[cols_at + 7 * chunk.count + (7 * chunk.count) % 2 :]
    keys_dev, sums_dev, status_dev = lane.dev[keys_at : keys_at + nk], lane.dev[kt.STATUS :], lane.dev[:1]

    def kernel(block_rows, num_warps, program_bytes):
        p = kt.plan_split(cols[2 * chunk.count : 3 * chunk.count], cols[3 * chunk.count : 4 * chunk.count],
                          shared, program_bytes=program_bytes)  # fmt: skip
        n_split, split = p.n_split, p.split
        samples = []
        for i in range(args.warmup + args.reps):
            kv_written()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(dig.stream):
                a.record(dig.stream)
                kt.launch(table, keys_dev, sums_dev, chunk.count, split_dev, p, status_dev,
                          block_rows=block_rows, num_warps=num_warps)  # fmt: skip
                b.record(dig.stream)
            b.synchronize()
            if i >= args.warmup:
                samples.append(a.elapsed_time(b) / 1e3)
        s = summary(samples)
        return dict(block_rows=block_rows, block_c=kt.BLOCK_C, num_warps=num_warps,
                    program_bytes=program_bytes, split=split, n_split=n_split, programs=n_split * split + chunk.count, gpu_s=s,
                    GBps_median=chunk_bytes / s["median"] / 1e9)  # fmt: skip

    # The host's share of a call, step by step (each timed alone, host clock).
    def host_time(fn, sync=True):
        samples = []
        for i in range(args.warmup + args.reps):
            t0 = time.perf_counter()
            fn()
            t = time.perf_counter() - t0
            if sync:
                dig.stream.synchronize()
            if i >= args.warmup:
                samples.append(t)
        return summary(samples)

    end = cols_at + 7 * chunk.count + (7 * chunk.count) % 2 + plan.n_split
    micro = dict(pinned=[lane.host.is_pinned(), lane.host[8:end].is_pinned()],
                 upload_bytes=end * 8, direct_launch=dig._direct is not None)  # fmt: skip
    with torch.cuda.stream(dig.stream):
        micro["upload_call"] = host_time(
            lambda: lane.dev[:end].copy_(lane.host[:end], non_blocking=True))
        micro["launch_call_jit"] = host_time(
            lambda: kt.launch(table, keys_dev, sums_dev, chunk.count, split_dev, plan, status_dev))
        micro["launch_call_shipped"] = host_time(
            lambda: dig._launch(lane, chunk.count, nk, keys_at, cols_at,
                                cols_at + 7 * chunk.count + (7 * chunk.count) % 2, plan))
        micro["download_and_sync"] = host_time(
            lambda: (lane.host[: kt.STATUS + nk].copy_(lane.dev[: kt.STATUS + nk], non_blocking=True),
                     dig.stream.synchronize()))  # fmt: skip

    def stream_context():
        with torch.cuda.stream(dig.stream):
            pass

    micro["stream_context"] = host_time(stream_context, sync=False)
    micro["keys_to_int64"] = host_time(lambda: np.asarray(chunk_keys, dtype=np.int64) & 0xFFFFFFFF, sync=False)
    results["host_steps"] = micro

    shipped = (kt.BLOCK_R, kt.NUM_WARPS, kt.PROGRAM_BYTES)
    results["kernel_alone"] = kernel(*shipped)
    sweep = []
    for br, nw in ((8, 4), (16, 4), (16, 8), (32, 4), (32, 8)):
        for pb in (512 << 10, 1 << 20):
            if (br, nw, pb) != shipped:
                sweep.append(kernel(br, nw, pb))
    sweep.append(results["kernel_alone"])
    sweep.sort(key=lambda k: k["gpu_s"]["median"])
    results["kernel_sweep"] = [{k: v for k, v in s.items() if k != "gpu_s"} | {
        "gpu_s": {k: v for k, v in s["gpu_s"].items() if k != "samples"}} for s in sweep]
    copy_src = torch.empty(chunk_bytes // 2, dtype=torch.uint8, device=dev)
    copy_dst = torch.empty_like(copy_src)
    cs = []
    for i in range(args.warmup + args.reps):
        kv_written()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        copy_dst.copy_(copy_src)
        b.record()
        b.synchronize()
        if i >= args.warmup:
            cs.append(a.elapsed_time(b) / 1e3)
    results["d2d_copy_half_the_bytes"] = dict(
        bytes=copy_src.numel(), gpu_s=summary(cs),
        GBps_read_plus_write=2 * copy_src.numel() / statistics.median(cs) / 1e9)  # fmt: skip

    over = {"shipped_send_path_last_chunk": link_last, "shipped_add_blocks_flush_last_chunk": link_last}
    for name in ("shipped_send_path_middle_chunk", "shipped_send_path_last_chunk",
                 "shipped_add_blocks_flush_middle_chunk", "shipped_add_blocks_flush_last_chunk",
                 "direct_call_formula_blocks", "direct_call_formula_blocks_jit_launch",
                 "direct_calls_per_rank_formula_blocks", "direct_call_formula_blocks_mla_once"):
        for clock in ("wall_s", "gpu_s"):
            s = results[name][clock]
            link = over.get(name, link_mid)
            s["over_link_time"] = s["median"] / link
            s["over_link_time_min_max"] = [s["min"] / link, s["max"] / link]
    results["kernel_alone"]["over_link_time"] = results["kernel_alone"]["gpu_s"]["median"] / link_s

    # -- checks -------------------------------------------------------------------------------
    checks = {}
    got_chunk = dig.digest(chunk, chunk_keys)
    got_ranks = [dig.digest(b, keys) for b in per_rank]
    checks["chunk_call_equals_per_rank_calls"] = all(
        (got_chunk[i * spr : (i + 1) * spr] == got_ranks[i]).all() for i in range(n_ranks))
    mla_slots = g.mla_decode_index
    checks["mla_sums_equal_over_the_8_decode_ranks"] = all(
        (got_ranks[i][mla_slots] == got_ranks[0][mla_slots]).all() for i in range(n_ranks))
    checks["mla_once_equals_chunk"] = bool(
        (dig.digest(mla_once, chunk_keys)[: spr] == got_chunk[:spr]).all())
    small = kt.DeviceDigest(dev, max_blocks=1000, max_slots=args.max_slots)
    small.warm()
    checks["pieces_of_1000_blocks_equal_one_launch"] = bool((small.digest(chunk, chunk_keys) == got_chunk).all())
    # Calls submitted without waiting, more than the lanes, each after a new KV-written event,
    # read in reverse order: each returns its own sums (a lane taken again reads its sums out).
    queued = [(dig.submit(b, keys, wait_events=(kv_written(),)), want_rank)
              for b, want_rank in zip(per_rank * 2, got_ranks * 2)]  # fmt: skip
    # the shipped digest stream's priority against the range this GPU offers (lower: higher)
    checks["digest_stream_priority"] = dict(priority=int(dig.stream.priority),
                                            range=[int(x) for x in torch.cuda.Stream.priority_range()])
    checks["submitted_calls_read_later_in_reverse"] = dict(
        calls=len(queued), lanes=len(dig.lanes),
        equal=all(bool((q.result() == w).all()) for q, w in reversed(queued)))  # fmt: skip
    t0 = time.perf_counter()
    mla_cpu = [p.cpu() for p in mla_pools]
    draft_cpu = [p.cpu() for p in draft_pools]
    r0 = g.decode_ranks[0]
    host_blocks = rank_blocks(g, r0, [p.data_ptr() for p in mla_cpu], [p.data_ptr() for p in draft_cpu], pages)
    want = kd.digest_blocks_host(host_blocks, keys)
    checks["host_reference"] = dict(
        decode_rank=r0, blocks=host_blocks.count, bytes=host_blocks.total_bytes,
        slots_touched=int(np.count_nonzero(want)), equal=bool((want == got_ranks[0]).all()),
        host_s=time.perf_counter() - t0,
    )  # fmt: skip
    # One flipped byte: draft entry 3, the chunk's 5th page, row 7, in rank 0's head.
    byte = draft_pools[3].view(torch.uint8).reshape(-1)
    at = ((int(pages[0][4]) * g.page + 7) * g.prefill_heads + g.local_head[r0]) * g.head_dim * 2 + 33
    byte[at] ^= 0x01
    flipped = dig.digest(per_rank[0], keys)
    byte[at] ^= 0x01
    changed = np.flatnonzero(flipped != got_ranks[0]).tolist()
    checks["flipped_byte"] = dict(changed_slots=changed,
                                  expected_slot=g.full_attention_layers + 3,
                                  restored_equal=bool((dig.digest(per_rank[0], keys) == got_ranks[0]).all()))  # fmt: skip
    too_many = None
    try:
        dig.digest(kd.Blocks.empty(), [1] * (args.max_slots + 1))
    except ValueError as e:
        too_many = str(e)
    checks["more_keys_than_max_slots"] = too_many

    # -- the shipped path's sums --------------------------------------------------------------
    def contribution_of(sums):
        """What Contribution.add_slots keeps of one decode rank's KV slots: the touched ones."""
        return {(int(kd.BufferKind.KV), i): int(v) for i, v in enumerate(sums) if int(v)}

    e = kv_written()
    r_mid = next(sp.rooms)
    sp.chunk(r_mid, e, False)
    mid = sp.pop(r_mid)
    r_last = next(sp.rooms)
    sp.chunk(r_last, kv_written(), True)
    last = dict(sp.pop(r_last))
    checks["shipped_middle_chunk_equals_direct_formula"] = all(
        mid[r].sums == contribution_of(got_ranks[i]) for i, r in enumerate(g.decode_ranks))
    kv_kind = int(kd.BufferKind.KV)
    checks["shipped_last_chunk_kv_equals_middle_chunk"] = all(
        {k: v for k, v in last[r].sums.items() if k[0] == kv_kind} == mid[r].sums for r in g.decode_ranks)
    checks["shipped_sender"] = [last[g.decode_ranks[0]].sender.pp_rank, last[g.decode_ranks[0]].sender.tp_rank,
                                last[g.decode_ranks[0]].sender.rank_id]  # fmt: skip
    t0 = time.perf_counter()
    conv_cpu, temporal_cpu = pools.conv.cpu(), pools.temporal.cpu()
    decode_side = {}
    for r in (g.decode_ranks[0], g.decode_ranks[-1]):
        sp.popped = last
        compared, equal, moved = decode_side_state(g, sp, r, conv_cpu, temporal_cpu, torch, slice_fn)
        decode_side[str(r)] = dict(state_buffers_compared=compared, equal=equal, bytes_moved=moved)
    checks["decode_side_state_digest_equals_sender"] = dict(ranks=decode_side, host_s=time.perf_counter() - t0)
    checks["shipped_failures_concluded"] = len(sp.failures)

    # -- nothing allocated or compiled while serving -------------------------------------------
    def compiled():
        try:
            return sum(len(c[0]) for c in kt._digest_kernel.device_caches.values())
        except Exception:  # another Triton's layout
            return None

    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    compiled_before = compiled()
    for i in range(100):
        dig.digest(chunk if i % 2 else per_rank[i % n_ranks], chunk_keys if i % 2 else keys)
    for i in range(100):  # the shipped path, middle and last chunks
        room_i = next(sp.rooms)
        sp.chunk(room_i, None, bool(i % 2))
        sp.pop(room_i)
    torch.cuda.synchronize()
    checks["after_warm_100_digests_and_100_shipped_flushes"] = dict(
        cuda_allocations=torch.cuda.memory_stats()["allocation.all.allocated"] - before,
        kernel_variants_compiled=None if compiled_before is None else compiled() - compiled_before,
        kernel_variants_total=compiled(),
    )  # fmt: skip

    report = dict(
        provenance=provenance.record(
            repetitions=args.reps, warmup=args.warmup, timed_sources=TIMED,
            timed=("over_link_*: the shipped send path with each transfer taking its bytes' time at "
                   "50 GB/s (time.sleep, the GIL released; *_spin: a C loop on the clock through "
                   "ctypes, the GIL released, the thread on its core as in Mooncake's polling wait), "
                   "digest on against off (waiting the same way), the digest thread "
                   "drained after each sample; shipped_*: per chunk, for the 8 decode ranks, "
                   "mooncake_draft_kv.begin_chunk (the chunk's KV-written event as wait_event), the target MLA descriptors through "
                   "kv_digest_send.scope + batch_transfer_sync_around (BufferTable.blocks, "
                   "add_blocks), the draft's kv_digest_send.add_draft_blocks (DraftSend.check_pages, "
                   "add_blocks(DraftPart)), on the last chunk the KDA state descriptors through a STATE "
                   "scope, then kv_digest_send.flush (one DigestEngine.digest: DeviceDigest table "
                   "fill, one H2D, launch, D2H, stream synchronize; the sums into the rooms' "
                   "Contributions); add_blocks_flush: add_blocks of prebuilt blocks + flush. "
                   "direct_*: DeviceDigest.digest on this script's own blocks. Each after an L2 "
                   "flush on another stream whose event the digest waits on; wall = perf_counter "
                   "around the call, gpu = CUDA events on the digest stream around it; kernel = "
                   "events around the launch"),
            not_timed=("sglang's own send code (its descriptors are built before timing: sglang "
                       "cannot be installed on the GPU machine), the transfer itself (the ratio's "
                       "denominator is bytes / 50 GB/s), send_aux's ZMQ message of the sums, the "
                       "decode's digest"),
            stand_ins=("the KV manager (a SimpleNamespace with _dflash_kv_digest = SendDigest("
                       "DigestEngine(cuda), Sender(7, 3, 31)), decode_kv_args_table, engine, "
                       "conclude_failure, kv_args), the decode registrations (SimpleNamespace("
                       "dst_kv_ptrs, dst_state_data_ptrs) with fake decode bases), Mooncake's "
                       "batch_transfer_sync (a no-op under the hook)"),
            state_slicing=slice_src,
            sglang_imported=[m for m in sys.modules if m == "sglang" or m.startswith("sglang.")][:5],
        ),  # fmt: skip
        geometry=dict(
            example="kimi-k3", prefill=f"TP{g.p_tp} x PP{g.pp}", decode=f"TP{g.d_tp}",
            prefill_rank=PREFILL_RANK, stage=STAGE, stage_layers=g.stage_layers,
            mla_stage_layers=g.mla_stage_layers, mla_decode_index=g.mla_decode_index,
            mla_bytes_per_token_per_layer=g.mla_token_bytes, page_size=g.page,
            chunk_tokens=g.chunk_tokens, chunk_pages=g.pages, run_pages=RUN_PAGES,
            draft_entries=g.draft_entries, draft_kv_heads=g.kv_heads,
            draft_heads_prefill_rank=g.prefill_heads, draft_heads_decode_rank=g.decode_heads,
            head_dim=g.head_dim, decode_ranks=g.decode_ranks, slots_per_decode_rank=spr,
            blocks_chunk=chunk.count, blocks_per_rank=per_rank[0].count,
            blocks_per_rank_mla=rank_blocks(g, r0, mla_bases, draft_bases, pages, draft=False).count,
            bytes_chunk=chunk_bytes,
            bytes_per_rank_mla=rank_blocks(g, r0, mla_bases, draft_bases, pages, draft=False).total_bytes,
            bytes_per_rank_draft=rank_blocks(g, r0, mla_bases, draft_bases, pages, mla=False).total_bytes,
            bytes_chunk_mla_once=mla_once.total_bytes, link_GBps=LINK_BPS / 1e9,
            link_time_s=link_s, goal_ratio=GOAL, link_wait=link_wait.describe(),
            shipped=dict(
                descriptors_per_rank_mla=len(sp.mla[r0][0]), bytes_per_rank_mla=sum(sp.mla[r0][2]),
                draft_blocks_per_rank=blocks_mid[r0][1].count, bytes_per_rank_draft=blocks_mid[r0][1].total_bytes,
                state_descriptors_per_rank=len(sp.state[r0][0]), bytes_per_rank_state=sum(sp.state[r0][2]),
                state_descriptor_lengths=sorted(set(sp.state[r0][2])),
                blocks_middle_chunk=sum(b.count for p in blocks_mid.values() for b in p),
                blocks_last_chunk=sum(b.count for p in blocks_last.values() for b in p),
                keys_middle_chunk=results["shipped_flush_breakdown_middle_chunk"]["keys"],
                keys_last_chunk=results["shipped_flush_breakdown_last_chunk"]["keys"],
                bytes_middle_chunk=bytes_mid, bytes_last_chunk=bytes_last,
                link_time_middle_chunk_s=link_mid, link_time_last_chunk_s=link_last,
                digest_engine_startup_s=sp.startup_s,
                draft_regime=sp.sends[r0].regime.value, draft_action=sp.sends[r0].plan.action.value,
            ),
            kda_state=dict(
                derivation=STATE_DERIVATION,
                linear_attn_config={k: v for k, v in g.linear_attn_config.items() if not k.endswith("layers")},
                kda_layers_total=len(g.kda_layers), kda_stage_layers=g.kda_stage_layers,
                prefill_rank_tp4=g.state_p, decode_rank_tp32=g.state_d,
                prefill_state_slots=STATE_SLOTS, src_state_slot=SRC_STATE_SLOT,
                dst_state_slot=DST_STATE_SLOT,
                bytes_per_decode_rank=sum(sp.state[r0][2]),
                bytes_per_decode_rank_formula=len(g.kda_stage_layers) * (
                    g.state_d["conv_item_bytes"] + g.state_d["temporal_item_bytes"]),
            ),
            direct_launch=None if dig._direct is None else dict(extra_args=list(dig._direct[1])),
            device_digest=dict(max_blocks=args.max_blocks, max_slots=args.max_slots,
                               block_rows=kt.BLOCK_R, block_c=kt.BLOCK_C, num_warps=kt.NUM_WARPS,
                               split_bytes=kt.SPLIT_BYTES, program_bytes=kt.PROGRAM_BYTES,
                               startup_s=startup_s),
        ),  # fmt: skip
        results=results,
        checks=checks,
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    brief = {k: {c: {x: v[c][x] for x in ("median", "min", "max", "over_link_time") if x in v[c]}
                 for c in ("wall_s", "gpu_s") if c in v} for k, v in results.items() if isinstance(v, dict)}
    print(json.dumps(dict(link_s=link_s, bytes=chunk_bytes, bytes_middle=bytes_mid, bytes_last=bytes_last,
                          brief=brief, checks=checks), indent=1))
    print(json.dumps(results["kernel_sweep"][:6], indent=1))


def us(s):
    return f"{s['median'] * 1e6:.0f} ({s['min'] * 1e6:.0f}-{s['max'] * 1e6:.0f})"


# What was tried on the way to the shipped kernel (earlier versions, one H200 run each; the figures
# are those runs' medians for the one-call chunk digest / the kernel; prefill rank 1, the direct
# call on this script's own blocks).
TRIED = (
    "Tried on the way (one H200 run each, direct one-call wall / kernel medians in µs): a grid of "
    "(block, tile) programs with the large blocks moved to the front by an argsort, a [32, 64] tile "
    "per 4 warps, per-word masks and offset hashes, scalar loads: 1811 / 1072 (18% of the link time; "
    "the sweep's best tile, [16, 64] per 8 warps: 451); the shared blocks listed instead of reordered, "
    "a mask-free fast path (the offset's high half hashed once per block, c1 a per-tile scalar plus a "
    "loop-invariant part) with 16-byte vector loads: 589 / 280; one upload for sums, keys and table "
    "(no zeroing launch): 544 / 261; Triton's compiled kernel launched directly (its JIT launch cost "
    "55 µs of host time), the table validated by the kernel instead of numpy, [16, 64] per 4 warps "
    "and 1 MiB per program: 391 / 219. The shipped kernel, 50 repetitions after 10, each variant "
    "measured in one stretch: 434 / 224, and right after a machine start 494 (371-630) / 218, its "
    "first samples slow: hence 100 repetitions after 30, the variants in turn."
)
# ... and on the way to the shipped last-chunk schedule (send side, over the emulated link).
TRIED_SCHEDULE = (
    "Tried for the last chunk's schedule (send side, over the link): an engine call hidden by every "
    "long transfer (commit 6cae7f9: up to 16 engine calls per last chunk where the shipped schedule "
    "made 2, the shipped one 3; superseded, its run not kept), and the digest thread held to the workers' GIL-free "
    "windows, stopping "
    "between jobs when none is open (commit 6bd2cc4, reverted: its run, "
    "[`kv_digest_cost_thread_windows_6bd2cc4.json`](kv_digest_cost_thread_windows_6bd2cc4.json), gave "
    "the last chunk +1480 us = 14.4% against 31.0% inline in the same run, the ratio this run gives "
    "without it). 012a25a's schedule (one call, at the last decode rank's first long transfer) is "
    "the `_at_last_rank_only` row above; e7c7ad6's code (the last rank's state digested at its "
    "send, not from the chunk's start) the `_no_prepare` row. Earlier runs, each of the code "
    "shipped then: 012a25a ([`kv_digest_cost_012a25a.json`](kv_digest_cost_012a25a.json)) the last "
    "chunk +1705 us = 16.6%, the middle chunk 2.9%, a 4-chunk request 7.0%; f155aac "
    "([`kv_digest_cost_f155aac.json`](kv_digest_cost_f155aac.json)) 15.8% against 18.2% for "
    "012a25a's schedule in the same run, middle 4.4%, request 7.7%; e7c7ad6 "
    "([`kv_digest_cost_e7c7ad6.json`](kv_digest_cost_e7c7ad6.json)) 15.0%, middle 4.1%, request "
    "6.8%, with every chunk inline at 23.3% (last) and 18.7% (request) in that run, against 20.1% and "
    "15.1% in 58998f6's; 427f587 ([`kv_digest_cost_rerun_427f587.json`](kv_digest_cost_rerun_427f587.json), "
    "a slower host) the last chunk 37.9%, middle 4.7%, request 13.6%. The digest thread's schedule (the `_thread` rows), in earlier runs when it was the shipped code: a585835 "
    "([`kv_digest_cost_a585835.json`](kv_digest_cost_a585835.json)) the last chunk 8.5%, middle 3.8%, request 5.4%; 58998f6 "
    "([`kv_digest_cost_58998f6.json`](kv_digest_cost_58998f6.json)) the last chunk 6.8% against "
    "10.6% for e7c7ad6's code, middle 3.5%, request 4.9% (inline 20.1% and 15.1%); 082158a "
    "([`kv_digest_cost_082158a.json`](kv_digest_cost_082158a.json)) the last chunk 10.7% against "
    "15.8% for e7c7ad6's code, middle 4.3%, request 8.8% (inline 25.5% and 21.1%); 92c4cc4 "
    "([`kv_digest_cost_92c4cc4.json`](kv_digest_cost_92c4cc4.json), without the request's and the "
    "switch interval's what-if rows) 13.0% against 19.2%, middle 4.7%, request 10.8% (inline 29.9% "
    "and 24.8%); and the `_state_prepare_only` row of the 052f2b6 run below, 9.2%: each run starts "
    "a fresh machine and they differ, so compare rows of one run. Also tried: the "
    "digest thread running sglang's state send dry for every decode rank, not only the last (commit "
    "722cc67, [`kv_digest_cost_prepare_every_rank_722cc67.json`]"
    "(kv_digest_cost_prepare_every_rank_722cc67.json)): the status's wait fell from 620 to 189 us, "
    "but building 8 ranks' state descriptors again on the thread held the GIL the worker needed "
    "(its transfers 600 us later): the last chunk 15.2% against 12.1% without it, same run. And "
    "the last decode rank's draft part digested from the chunk's start too, in the state "
    "prepare's engine call (commit 052f2b6, reverted by 9c75af2: its run, "
    "[`kv_digest_cost_tail_draft_052f2b6.json`](kv_digest_cost_tail_draft_052f2b6.json), row "
    "`_state_prepare_only` = the shipped code): the last chunk 9.9% against 9.2% without it, a "
    "4-chunk request 6.3% against 6.2%, the status's wait 162 against 160 us, 3 engine calls "
    "either way: that part was not what the status waited for (its tail job was 35 us either "
    "way). And the decode ranks before the last digested in three engine calls during their "
    "transfers instead of one at half of them, the prepared state joining the chunk's next call "
    "instead of its own (commit ca8a98f, reverted: its run, "
    "[`kv_digest_cost_thirds_ca8a98f.json`](kv_digest_cost_thirds_ca8a98f.json), with the "
    "shipped schedule restated as `_at_half`): the last chunk 9.0% against 7.5%, but 12928 "
    "against 12989 us in the breakdown pass and a 4-chunk request 5.9% against 6.5%, no clear "
    "gain; its timeline ([`kv_digest_timeline_thirds_ca8a98f.json`]"
    "(kv_digest_timeline_thirds_ca8a98f.json), 5 samples): the prepare job 450-620 us, within "
    "the transfer it ran in, but each of the two thirds' jobs 0.9-1.3 ms, outlasting its 0.76 ms "
    "transfer by 0.2-0.6 ms: a job's length did not follow the ranks it covered. The worker "
    "digesting inside its transfers (shipped since 1040fb6), in earlier runs (middle chunk, last "
    "chunk, 4-chunk request, each transfer waiting asleep): 5be56d5 "
    "([`kv_digest_cost_5be56d5.json`](kv_digest_cost_5be56d5.json)) 6.8%, 7.9%, 4.98%; 2291bd6 "
    "([`kv_digest_cost_rerun_2291bd6.json`](kv_digest_cost_rerun_2291bd6.json)) 6.6%, 6.6%, 4.2%; "
    "bce2727 ([`kv_digest_cost_rerun_bce2727.json`](kv_digest_cost_rerun_bce2727.json)) 3.3%, "
    "5.2%, 3.2%; and restated as `_every_step` in the 9bcb285 run below: 3.3%, 6.1%, 4.4% (waiting "
    "on the core: 3.2%, 6.5%, 5.0%). Also tried there: a window clock (commit 9bcb285, reverted by "
    "d2de289: its run, [`kv_digest_cost_window_clock_9bcb285.json`]"
    "(kv_digest_cost_window_clock_9bcb285.json)), each window step run only where the rank's "
    "moving estimates of its link and of that step expected it to end before the bytes landed, "
    "the rest left to a later window or the status: the windows no longer ran late, but the "
    "deferred engine calls grew (the estimate 1.9 ms by the run's end), fitted fewer windows and "
    "piled up at the status: the last chunk 16.6% against 6.1% for the shipped code (14.4% "
    "against 6.5% waiting on the core), the status's wait +1250 us, a 4-chunk request 10.9% "
    "against 4.4%; its timeline waiting on the core ([`kv_digest_timeline_spin_window_clock_9bcb285.json`]"
    "(kv_digest_timeline_spin_window_clock_9bcb285.json)): 2 engine calls in a last chunk's "
    "windows, the status's wait 1363 us. The windows' engine calls waiting for their sums (the "
    "code before d710671) in their last runs: 59c67ae ([`kv_digest_cost_59c67ae.json`]"
    "(kv_digest_cost_59c67ae.json), a slower host, and its timelines "
    "[`kv_digest_timeline_59c67ae.json`](kv_digest_timeline_59c67ae.json), "
    "[`kv_digest_timeline_spin_59c67ae.json`](kv_digest_timeline_spin_59c67ae.json)) 10.2%, "
    "11.1%, 7.6%; restated as `_window_waits` since (this run's rows above, the GPU idle and busy). "
    "The asynchronous engine calls' first run, ce785d0 ([`kv_digest_cost_ce785d0.json`]"
    "(kv_digest_cost_ce785d0.json), no `_busy` rows): 5.0%, 6.3%, 3.6% (restated waiting windows "
    "2.9%, 6.0%; waiting on the core 3.3%, 6.0%, 3.9%). Two more runs of that product code: "
    "4f47bc4 ([`kv_digest_cost_4f47bc4.json`](kv_digest_cost_4f47bc4.json)): the GPU busy, middle "
    "3.6%, last 5.7% against 24.0%, 41.8% for the restated waiting windows; idle, asleep 6.9%, "
    "6.5%, 4.1%, on the core 4.1%, 7.3%, 4.4%; f3c2329 ([`kv_digest_cost_rerun_f3c2329.json`]"
    "(kv_digest_cost_rerun_f3c2329.json)): the GPU busy, middle 2.4%, last 6.2% against 25.0%, "
    "40.4% for the restated waiting windows; idle, asleep 5.5%, 6.6%, 4.1% (waiting windows 3.3%, "
    "6.2%), on the core 3.3%, 6.3%, 4.1% (3.7%, 6.5%). Then, toward this run's code: 29ad310 "
    "([`kv_digest_cost_29ad310.json`](kv_digest_cost_29ad310.json), the state's dry run moved to a "
    "window with nothing new queued, and DeviceDigest launching with addresses): idle, asleep "
    "3.9%, 4.8%, 2.3%, on the core 2.3%, 3.5%, 2.5%; the GPU busy 2.9%, 5.5%; a224093 "
    "([`kv_digest_cost_a224093.json`](kv_digest_cost_a224093.json), the hooks trimmed too, the "
    "first `_busy_spin` rows): idle, asleep 1.9%, 2.9%, 2.0%, on the core 1.2%, 2.6%, 1.7%; the "
    "GPU busy 2.4%, 4.9%; busy and on the core 0.9%, 3.6%. Its timelines are this page's "
    "(`kv_digest_timeline.json`, `kv_digest_timeline_spin.json`); 29ad310's and ce785d0's carry "
    "their commit in their names."
)


def section(r, name="kv_digest_cost.json"):
    """The README section (``benchmark/gpu/results/README.md``, via ``report.py``) of a result."""
    from report import origin

    g, res, c = r["geometry"], r["results"], r["checks"]
    sh, st = g["shipped"], g["kda_state"]
    p, d = st["prefill_rank_tp4"], st["decode_rank_tp32"]
    links = {k: sh["link_time_last_chunk_s"] if "last" in k else sh["link_time_middle_chunk_s"] for k in res}

    def share(key, clock="wall_s"):
        v, link = res[key][clock], links[key]
        return f"{100 * v['median'] / link:.1f}% ({100 * v['min'] / link:.1f}-{100 * v['max'] / link:.1f}%)"

    def shape(s, which):
        return "[" + ", ".join(str(x) for x in s[f"{which}_shape"]) + "]"

    k = res["kernel_alone"]
    cs = c["decode_side_state_digest_equals_sender"]["ranks"]
    after = c["after_warm_100_digests_and_100_shipped_flushes"]
    out = [
        f"## The composed KV digest, one {g['chunk_tokens']}-token chunk of Kimi-K3's last PP stage "
        f"({g['prefill']} -> {g['decode']}), through the shipped send path",
        "",
        *(line.replace(f"`{name}`", f"[`{name}`]({name})", 1) for line in origin(name, r["provenance"])),
        "",
        f"Timed: {r['provenance']['timed']}. Not timed: {r['provenance']['not_timed']}. Stand-ins: "
        f"{r['provenance']['stand_ins']}.",
        "",
        f"Prefill rank {g['prefill_rank']} -> decode ranks {g['decode_ranks'][0]}..{g['decode_ranks'][-1]}; per "
        f"decode rank {sh['descriptors_per_rank_mla']} target MLA descriptors (one per layer per page run, "
        f"sglang's `_send_kvcache_generic`) of the stage's {len(g['mla_stage_layers'])} MLA layers, "
        f"{sh['bytes_per_rank_mla'] / 1e6:.1f} MB, and {sh['draft_blocks_per_rank']:,} draft blocks "
        f"(the decode's head in strided rows, one block per entry and run of pages contiguous on both sides, "
        f"`draft_kv_digest.digest_blocks_of`) "
        f"of the {g['draft_entries']} draft entries, {sh['bytes_per_rank_draft'] / 1e6:.1f} MB; on the last "
        f"chunk also {sh['state_descriptors_per_rank']} KDA state descriptors "
        f"({sh['bytes_per_rank_state']:,} B). Chunk: {sh['blocks_middle_chunk']:,} blocks and "
        f"{sh['keys_middle_chunk']:,} slots, {sh['bytes_middle_chunk'] / 1e6:.1f} MB = "
        f"{sh['link_time_middle_chunk_s'] * 1e3:.2f} ms at {g['link_GBps']:.0f} GB/s (middle chunk); "
        f"{sh['blocks_last_chunk']:,} blocks and {sh['keys_last_chunk']:,} slots, "
        f"{sh['bytes_last_chunk'] / 1e6:.1f} MB = {sh['link_time_last_chunk_s'] * 1e3:.2f} ms (last chunk, "
        "with the state).",
        "",
        f"KDA state ({len(st['kda_stage_layers'])} of the {st['kda_layers_total']} KDA layers in the stage; "
        f"sglang's `KimiLinearStateShape` for `linear_attn_config` heads "
        f"{st['linear_attn_config']['num_heads']}, head_dim {st['linear_attn_config']['head_dim']}, conv "
        f"kernel {st['linear_attn_config']['short_conv_kernel_size']}): per layer and slot, the conv state "
        f"{shape(p, 'conv')} bf16 = {p['conv_item_bytes']:,} B and the recurrent state "
        f"{shape(p, 'temporal')} fp32 = {p['temporal_item_bytes']:,} B on a TP4 prefill rank, "
        f"{shape(d, 'conv')} = {d['conv_item_bytes']:,} B and {shape(d, 'temporal')} = "
        f"{d['temporal_item_bytes']:,} B on a TP32 decode rank; `_send_mamba_state_slice` sends each "
        f"decode rank per layer its 9 conv pieces (3 rows x q, k, v) and one recurrent-state slice "
        f"(descriptor lengths {', '.join(f'{n:,}' for n in sh['state_descriptor_lengths'])} B; slicing "
        f"on the GPU machine: {r['provenance']['state_slicing']}).",
        "",
        "Microseconds, median (min-max); share = digest wall time / link time of the chunk's bytes. "
        "Without a link nothing hides the digest: these rows are its whole work; the goal (< 5%) is "
        "read over the link, below.",
        "",
        "| what | wall | GPU (events) | share of link time |",
        "|---|---|---|---|",
    ]
    rows = [
        ("shipped send path, no link, middle chunk (the worker digesting in each long transfer, which takes no time here, then `flush`)", "shipped_send_path_middle_chunk"),
        ("shipped send path, no link, last chunk (with the KDA state; the same)", "shipped_send_path_last_chunk"),
        ("`add_blocks` (blocks built beforehand) + `flush`, middle chunk", "shipped_add_blocks_flush_middle_chunk"),
        ("`add_blocks` + `flush`, last chunk", "shipped_add_blocks_flush_last_chunk"),
        ("direct `DeviceDigest.digest`, one call, this script's blocks (middle chunk)", "direct_call_formula_blocks"),
        ("the same through Triton's JIT launch (the fallback)", "direct_call_formula_blocks_jit_launch"),
        ("direct, 8 calls, one per decode rank", "direct_calls_per_rank_formula_blocks"),
        ("direct, one call, the MLA blocks once (their sums are equal on the 8 ranks)", "direct_call_formula_blocks_mla_once"),
    ]  # fmt: skip
    for label, key in rows:
        out.append(f"| {label} | {us(res[key]['wall_s'])} | {us(res[key]['gpu_s'])} | {share(key)} |")
    out.append(f"| kernel alone, middle chunk | - | {us(k['gpu_s'])} | "
               f"{100 * k['gpu_s']['median'] / g['link_time_s']:.1f}% |")  # fmt: skip
    out += [
        "",
        "**Over the link** (each `batch_transfer_sync` and draft transfer takes its bytes' time at "
        f"{g['link_GBps']:.0f} GB/s, the GIL released as Mooncake releases it; the digest thread works "
        "meanwhile): the chunk's worker wall time with the digest on minus the same sends with it off, "
        "medians of one loop; the digest thread's busy time per chunk; its lag = how long its queue "
        "still took after the worker's chunk ended (drained between samples).",
        "",
        "| chunk | digested | wall, digest off | wall, digest on | **exposed: on - off** | digest thread busy | thread lag after the chunk |",
        "|---|---|---|---|---|---|---|",
    ]
    for key in [k for k in res if k.startswith("over_link_") and "_chunk_exposed" in k]:
        which, mode = key[len("over_link_"):].split("_chunk_exposed")
        x = res[key]
        on = res[f"over_link_{which}_chunk_digest_on{mode}"]
        off = res[f"over_link_{which}_chunk_digest_off{_wait_of(mode)}"]
        how = {
            ("middle", ""): "by the worker inside its own long transfers (shipped: Mooncake's asynchronous batch API)",
            ("middle", "_thread"): "on the digest thread, after the chunk (shipped for an engine without that API; its work, done after the chunk, is the lag, not timed here: see the whole request)",
            ("middle", "_all_inline"): "inline, before the chunk ends (the synchronous design)",
            ("last", ""): "by the worker inside its own long transfers, the tail at the status (shipped)",
            ("last", "_thread"): "on the digest thread, during the chunk's long transfers and at the status (shipped for an engine without the asynchronous API)",
            ("last", "_all_inline"): "inline, at the status (the previous shipped design)",
            ("last", "_no_eager"): "on the digest thread, all at the status (no digest during its transfers)",
            ("last", "_at_last_rank_only"): "on the digest thread, one call at the last decode rank's first long transfer, the rest at the status (012a25a's schedule, the state digested at its send)",
            ("last", "_no_prepare"): "shipped, but the state digested at its send, not from the chunk's start (e7c7ad6's code)",
            ("last", "_switch_interval"): "shipped, the interpreter's thread switch interval 0.5 ms instead of 5 ms during the chunk (a what-if, not shipped)",
            ("middle", "_spin"): f"shipped (the worker inside its transfers), **{link_wait.HOW['spin']}**, the digest off waiting so too",
            ("last", "_spin"): f"shipped (the worker inside its transfers, the tail at the status), **{link_wait.HOW['spin']}**, the digest off so too",
            ("middle", "_thread_spin"): f"on the digest thread after the chunk (an engine without the asynchronous API), {link_wait.HOW['spin']}",
            ("last", "_thread_spin"): f"on the digest thread (an engine without the asynchronous API), {link_wait.HOW['spin']}",
            ("middle", "_window_waits"): "by the worker inside its transfers, each engine call waiting for its sums (the code before the asynchronous calls, restated)",
            ("last", "_window_waits"): "by the worker inside its transfers, each engine call waiting for its sums (the code before the asynchronous calls, restated)",
            ("middle", "_window_waits_spin"): f"the same, each engine call waiting for its sums (restated), {link_wait.HOW['spin']}",
            ("last", "_window_waits_spin"): f"the same, each engine call waiting for its sums (restated), {link_wait.HOW['spin']}",
            ("middle", "_busy"): "shipped, **the GPU busy with the next chunk's forward** (bf16 GEMMs on another stream), the digest off so too",
            ("last", "_busy"): "shipped, **the GPU busy with the next chunk's forward** (bf16 GEMMs on another stream), the digest off so too",
            ("middle", "_window_waits_busy"): "each engine call waiting for its sums (restated), the GPU busy with the next chunk's forward",
            ("last", "_window_waits_busy"): "each engine call waiting for its sums (restated), the GPU busy with the next chunk's forward",
            ("middle", "_busy_spin"): f"shipped, **the GPU busy with the next chunk's forward and {link_wait.HOW['spin']}**, the digest off so too",
            ("last", "_busy_spin"): f"shipped, **the GPU busy with the next chunk's forward and {link_wait.HOW['spin']}**, the digest off so too",
        }.get((which, mode), mode)
        out.append(
            f"| {which} | {how} | {us(off['wall_s'])} "
            f"({100 * x['wall_off_over_link_time']:.0f}% of the link time) | "
            f"{us(on['wall_s'])} | **{x['exposed_s'] * 1e6:.0f} = {100 * x['over_link_time']:.1f}%** | "
            f"{us(x['thread_busy_s'])} ({100 * x['thread_busy_over_link_time']:.0f}%) | "
            f"{us(x['thread_lag_after_chunk_s'])} |")  # fmt: skip
    REQUEST_MODE_NAMES = {"_all_inline": "every chunk inline (the synchronous design)",
                          "_thread": "on the digest thread (an engine without the asynchronous API)",
                          "_no_prepare": "shipped but the last chunk's state digested at its send "
                                         "(e7c7ad6's code)",
                          "_spin": f"shipped, {link_wait.HOW['spin']}, against the digest off "
                                   "waiting so too",
                          "_thread_spin": f"on the digest thread, {link_wait.HOW['spin']}",
                          "_window_waits": "the windows' engine calls waiting for their sums "
                                           "(the code before the asynchronous calls, restated)",
                          "_window_waits_spin": "the windows' engine calls waiting for their sums "
                                                f"(restated), {link_wait.HOW['spin']}"}  # fmt: skip
    rq = [k for k in res if k.startswith("over_link_request_") and "_chunks_exposed" in k]
    if rq:
        n = res[rq[0]]["chunks"]
        off = res[f"over_link_request_{n}_chunks_digest_off"]
        off_spin = res.get(f"over_link_request_{n}_chunks_digest_off_spin")
        out += ["", f"A whole request of {n} chunks ({n - 1} middle, then the last; one room, back to back, "
                "so a middle chunk's digest still runs on the thread while the next chunk is sent): "
                f"digest off {us(off['wall_s'])}"
                + (f" (each transfer waiting on its core: {us(off_spin['wall_s'])})" if off_spin else "")
                + "; "
                + "; ".join(
                    f"{REQUEST_MODE_NAMES.get(k.rsplit('_chunks_exposed', 1)[1], 'shipped')} "
                    f"{us(res[k.replace('_exposed', '_digest_on')]['wall_s'])}, "
                    f"**+{res[k]['exposed_s'] * 1e6:.0f} us = {100 * res[k]['over_link_time']:.1f}%** of the "
                    f"request's link time ({res[k]['emulated_link_s'] * 1e3:.2f} ms)" for k in rq) + "."]
    def verdict(key):
        x = res[key]["over_link_time"]
        return f"{'met' if x < GOAL else 'not met'} ({100 * x:.2f}%)"

    for mode, how in (("", link_wait.HOW["sleep"]), ("_spin", link_wait.HOW["spin"])):
        if f"over_link_middle_chunk_exposed{mode}" not in res:
            continue
        rkey = f"over_link_request_{REQUEST_CHUNKS}_chunks_exposed{mode}"
        out += ["", f"Goal < {100 * GOAL:.0f}% of the link time, as the time the digest adds to the "
                f"chunk's sends (shipped; {how}): middle chunk "
                f"{verdict(f'over_link_middle_chunk_exposed{mode}')}, last chunk "
                f"{verdict(f'over_link_last_chunk_exposed{mode}')}"
                + (f", a {REQUEST_CHUNKS}-chunk request {verdict(rkey)}" if rkey in res else "") + "."]
    bf = res.get("busy_forward")
    if bf and "over_link_last_chunk_exposed_busy" in res:
        out += ["", f"The GPU busy with the next chunk's forward, as in serving ({bf['gemms']} bf16 "
                f"{'x'.join(map(str, bf['shape']))} GEMMs on another stream, "
                f"{bf['gpu_ms_alone_median_of_5']:.1f} ms of GPU work alone): the shipped windows "
                f"(engine calls that queue the kernel) middle chunk "
                f"{verdict('over_link_middle_chunk_exposed_busy')}, last chunk "
                f"{verdict('over_link_last_chunk_exposed_busy')}; the windows' engine calls "
                "waiting for their sums (the code before, restated) middle chunk "
                f"{verdict('over_link_middle_chunk_exposed_window_waits_busy')}, last chunk "
                f"{verdict('over_link_last_chunk_exposed_window_waits_busy')}."]
    if bf and "over_link_last_chunk_exposed_busy_spin" in res:
        out += ["", "The GPU busy so and each transfer waiting on its core, as Mooncake's polling "
                "wait does (the closest this script comes to serving): the shipped windows middle "
                f"chunk {verdict('over_link_middle_chunk_exposed_busy_spin')}, last chunk "
                f"{verdict('over_link_last_chunk_exposed_busy_spin')}."]
    bd = res.get("over_link_last_chunk_breakdown")
    if bd:
        med = lambda m, k: bd[m].get(k, {"median": 0.0})["median"] * 1e6  # noqa: E731
        # a job kind the measured code did not have (since 0.5.23's lists are resolved in the
        # digest job itself, there are no resolve or queue jobs): "-"
        job = lambda m, k: f"{med(m, k):.0f}" if k in bd[m] else "-"  # noqa: E731
        names = {"shipped": "shipped (the worker, inside its transfers)",
                 "thread": "on the digest thread (no asynchronous API)",
                 "no_prepare": "the state digested at its send (e7c7ad6)",
                 "at_last_rank_only": "012a25a's schedule (one call at the last rank)",
                 "all_inline": "inline at the status (earlier design)", "off": "digest off"}  # fmt: skip
        out += ["", "Where a last chunk's time goes over the link (a separate pass with timing "
                "wrappers; medians in µs): the worker's wait at the status; its time outside the "
                "transfers (the hooks' hand-offs, and the GIL while the digest thread holds it); how "
                "much later than requested its transfers returned (summed: the GIL taken back); the "
                "digest thread's time per job kind; its engine calls.", "",
                "| last chunk | wall | wait at the status | worker outside transfers | transfers late | "
                "thread: resolve / queue / digest jobs | engine calls (time) |",
                "|---|---|---|---|---|---|---|"]
        for m in ("shipped", "thread", "no_prepare", "at_last_rank_only", "all_inline", "off"):
            if m not in bd:
                continue
            out.append(
                f"| {names[m]} | {med(m, 'wall'):.0f} | {med(m, 'flush_wait'):.0f} | "
                f"{med(m, 'worker_outside_transfers'):.0f} | {med(m, 'transfers_late'):.0f} | "
                f"{job(m, 'thread__resolve_job')} / {job(m, 'thread__queue_job')} / "
                f"{job(m, 'thread__digest_and_settle')} | {bd[m]['engine_calls']['median']:.0f} "
                f"({med(m, 'engine_s'):.0f}) |")  # fmt: skip
        tails = [m for m in ("shipped", "thread", "no_prepare") if "tail_job_job" in bd.get(m, {})]
        if tails:
            out += ["", "The digest job the status waits for (the chunk's last; medians in µs): " + "; ".join(
                f"{names[m]}: {med(m, 'tail_job_job'):.0f} in all, resolving sglang's descriptor lists "
                f"{med(m, 'tail_job_resolve'):.0f}, engine calls {med(m, 'tail_job_engine'):.0f}"
                for m in tails) + " (an engine call with no blocks, `direct_call_empty`: "
                f"{res['direct_call_empty']['wall_s']['median'] * 1e6:.0f})."]
    split = [(f"{w} chunk" + (", each transfer waiting on its core," if m else ""),
              res[f"over_link_{w}_chunk_exposed{m}"])
             for m in ("", "_spin") for w in ("middle", "last")
             if "wall_parts_on" in res.get(f"over_link_{w}_chunk_exposed{m}", {})]
    if split:
        part = lambda e, side, k: e[side][k]["median"] * 1e6  # noqa: E731
        parts = (("worker_outside_transfers", "outside the transfers"),
                 ("transfers_late", "transfers late"), ("flush_wait", "the wait at the status"))
        out += ["", "The same split in the main loop itself (each over-link sample of the rotating "
                "loop above; digest on / off, medians in µs, the difference in bold): " + "; ".join(
                    f"{w} (+{e['exposed_s'] * 1e6:.0f} exposed): " + ", ".join(
                        f"{name} {part(e, 'wall_parts_on', k):.0f} / {part(e, 'wall_parts_off', k):.0f} "
                        f"**{part(e, 'wall_parts_on', k) - part(e, 'wall_parts_off', k):+.0f}**"
                        for k, name in parts) for w, e in split) + "."]
    prev = r.get("previous_run")
    if prev:
        pp = prev["provenance"]
        pr = prev["results"]
        synchronous = ""
        if "shipped_send_path_middle_chunk" in pr:
            synchronous = (
                f"; its send path, every chunk digested by the worker before the status or the chunk's "
                f"end, no link: middle chunk {us(pr['shipped_send_path_middle_chunk']['wall_s'])}, last "
                f"chunk {us(pr['shipped_send_path_last_chunk']['wall_s'])}")
        out += ["", f"The previous run of this file ({pp['date_utc']}, commit `{pp['project']['commit'][:12]}`, "
                f"prefill rank {prev['prefill_rank']} -> decode ranks {prev['decode_ranks'][0]}.."
                f"{prev['decode_ranks'][-1]}; summaries kept under `previous_run`; a separate run, "
                f"so only this run's ratios compare): "
                f"direct one call {us(pr['direct_call_formula_blocks']['wall_s'])}, 8 calls "
                f"{us(pr['direct_calls_per_rank_formula_blocks']['wall_s'])}, MLA once "
                f"{us(pr['direct_call_formula_blocks_mla_once']['wall_s'])}, kernel alone "
                f"{us(pr['kernel_alone']['gpu_s'])}{synchronous}."]
    bm, bl = res["shipped_flush_breakdown_middle_chunk"], res["shipped_flush_breakdown_last_chunk"]
    sm, sl = res["shipped_send_path_middle_chunk"], res["shipped_send_path_last_chunk"]
    out += [
        "",
        f"Where the shipped path's time goes without a link (wall, µs): the sends, digested by the "
        f"worker in its (instant) transfers, {us(sm['wall_before_flush_s'])} middle / {us(sl['wall_before_flush_s'])} "
        f"last; the tail at `flush` {us(sm['wall_flush_s'])} / {us(sl['wall_flush_s'])}; the "
        f"engine calls per chunk (a separate pass) {us(bm['engine_digest_s'])} / "
        f"{us(bl['engine_digest_s'])} in total, {bm['engine_calls_per_chunk']['median']:.0f} / "
        f"{bl['engine_calls_per_chunk']['median']:.0f} calls (median).",
    ]
    if "handoff_alone_last_chunk" in res:
        ha = {w: (res[f"handoff_alone_{w}_chunk"]["wall_before_flush_s"],
                  res[f"handoff_alone_{w}_chunk_digest_off"]["wall_before_flush_s"])
              for w in ("middle", "last")}  # fmt: skip
        own = {w: (on["median"] - off["median"]) * 1e6 for w, (on, off) in ha.items()}
        out += [
            "",
            "The hand-off alone (the digest thread's schedule, its thread given none of its jobs, "
            "so nothing competes for the GIL; wall to the `flush` call, µs): middle chunk "
            f"{us(ha['middle'][0])} against {us(ha['middle'][1])} with the digest off, last chunk "
            f"{us(ha['last'][0])} against {us(ha['last'][1])}: the hooks' own cost is "
            f"{own['middle']:.0f} / {own['last']:.0f} us of the chunk's exposed time over the link; "
            "on the thread's schedule the rest is the worker waiting for the GIL the digest thread "
            "holds, and the status's wait; inside the transfers, the windows' work that outlasts "
            "them (transfers late) and the worker's hooks run cold after each wait (outside)."]
    out += [
        "",
        f"Kernel: {k['GBps_median']:.0f} GB/s of digested bytes (device copy: "
        f"{res['d2d_copy_half_the_bytes']['GBps_read_plus_write']:.0f} GB/s read + write), tile "
        f"{k['block_rows']} x {k['block_c']} words, {k['num_warps']} warps; tile shapes swept (median "
        "µs): " + ", ".join(f"{s['block_rows']}x{s['block_c']}/{s['num_warps']}w/{s['program_bytes'] >> 10}K "
                           f"{s['gpu_s']['median'] * 1e6:.0f}" for s in res["kernel_sweep"][:5]) + ", ...",
        "",
        f"Checks on the H200: the shipped middle chunk's sums per decode rank equal the direct digest "
        f"of this script's blocks: {c['shipped_middle_chunk_equals_direct_formula']}; the last chunk's "
        f"KV sums equal the middle chunk's: {c['shipped_last_chunk_kv_equals_middle_chunk']}; the "
        f"decode's own digest of its state slot after the state descriptors' bytes landed (host model, "
        f"`kv_digest_verify.request_blocks`) equals the sender's state sums: "
        + ", ".join(f"decode rank {rk} {v['equal']} ({v['state_buffers_compared']} buffers, "
                    f"{v['bytes_moved']:,} B)" for rk, v in cs.items())
        + f"; failures concluded: {c['shipped_failures_concluded']}; the direct digest equals "
        f"`digest_blocks_host` over `tensor.cpu()` copies for decode rank "
        f"{c['host_reference']['decode_rank']} ({c['host_reference']['blocks']:,} blocks): "
        f"{c['host_reference']['equal']}; one call equals the per-rank calls: "
        f"{c['chunk_call_equals_per_rank_calls']}; in pieces of 1000 blocks: "
        f"{c['pieces_of_1000_blocks_equal_one_launch']}; "
        + (f"{c['submitted_calls_read_later_in_reverse']['calls']} calls submitted without waiting "
           f"({c['submitted_calls_read_later_in_reverse']['lanes']} lanes), read in reverse order, "
           f"each its own sums: {c['submitted_calls_read_later_in_reverse']['equal']}; "
           if "submitted_calls_read_later_in_reverse" in c else "")
        + f"a flipped byte changed slots "
        f"{c['flipped_byte']['changed_slots']} (expected [{c['flipped_byte']['expected_slot']}]); after "
        f"`warm()`, 100 direct digests and 100 shipped flushes made {after['cuda_allocations']} CUDA "
        f"allocations and compiled {after['kernel_variants_compiled']} kernels; sglang modules imported: "
        f"{r['provenance']['sglang_imported'] or 'none'}.",
    ]
    x = r.get("sglang_cross_check")
    if x:
        out += [
            "",
            f"Checked against sglang {x['sglang']} itself (`--check-sglang`, {x['date_utc']}, CPU): "
            + "; ".join(f"{k.replace('_', ' ')}: {v}" for k, v in x["checks"].items()) + ".",
        ]
    out += ["", TRIED, "", TRIED_SCHEDULE, ""]
    return out


def render(path):
    print("\n".join(section(json.load(open(path)), os.path.basename(path))))


# The earlier result file's variants (before the shipped-path variants) and their names here.
PREVIOUS_NAMES = {"chunk": "direct_call_formula_blocks",
                  "chunk_jit_launch": "direct_call_formula_blocks_jit_launch",
                  "per_rank": "direct_calls_per_rank_formula_blocks",
                  "chunk_mla_once": "direct_call_formula_blocks_mla_once",
                  "empty_call": "direct_call_empty", "kernel": "kernel_alone"}  # fmt: skip


# kept from an earlier run by their own names (the synchronous send path of f6111a11, say)
KEPT = ("shipped_send_path_middle_chunk", "shipped_send_path_last_chunk", *PREVIOUS_NAMES.values())


def keep_previous(path, previous):
    """Copy the summaries (not the samples) of an earlier result file's direct variants into
    ``path`` as ``previous_run``, under this file's names, with that run's provenance."""
    old, r = json.load(open(previous)), json.load(open(path))
    strip = lambda v: {c: {x: v[c][x] for x in ("median", "min", "max", "n", "over_link_time") if x in v[c]}
                       for c in ("wall_s", "gpu_s") if c in v}  # noqa: E731
    p = old["provenance"]
    r["previous_run"] = dict(
        provenance={k: p[k] for k in ("date_utc", "project", "command", "device", "versions",
                                      "repetitions", "warmup", "source_sha256")},
        prefill_rank=old["geometry"]["prefill_rank"], decode_ranks=old["geometry"]["decode_ranks"],
        link_time_s=old["geometry"]["link_time_s"],
        results={**{new: strip(old["results"][o]) for o, new in PREVIOUS_NAMES.items() if o in old["results"]},
                 **{k: strip(old["results"][k]) for k in KEPT if k in old["results"]}},
    )  # fmt: skip
    with open(path, "w") as f:
        json.dump(r, f, indent=1)


def check_sglang(path):
    """Compare this script's copies of sglang's descriptor and state arithmetic with sglang's own
    functions (where sglang 0.5.23 is installed: the local .venv) and record it in the result."""
    import datetime
    import importlib.metadata

    import torch  # noqa: F401  (sglang's mamba_utils needs it)
    from sglang.srt.configs.mamba_utils import KimiLinearStateShape
    from sglang.srt.disaggregation.common.utils import group_concurrent_contiguous
    from sglang.srt.disaggregation.utils import (
        build_transfer_entry_pairs,
        compute_mamba_state_slice_byte_blocks,
    )
    from sglang.srt.distributed.utils import get_pp_indices

    g = geometry()
    lin = g.linear_attn_config
    checks = {}
    checks["pp8_partition_equals_get_pp_indices"] = [
        list(range(*get_pp_indices(93, s, g.pp))) for s in range(g.pp)
    ] == [list(range(sum(PP8_PARTITION[:s]), sum(PP8_PARTITION[: s + 1]))) for s in range(g.pp)]
    same_shape = True
    for tp, mine in ((g.p_tp, g.state_p), (g.d_tp, g.state_d)):
        s = KimiLinearStateShape.create(tp_world_size=tp, num_heads=lin["num_heads"], head_dim=lin["head_dim"],
                                        conv_kernel_size=lin["short_conv_kernel_size"])  # fmt: skip
        same_shape &= ([list(s.conv[0])] == [mine["conv_shape"]] and len(s.conv) == 1
                       and list(s.temporal) == mine["temporal_shape"]
                       and list(s.conv_shard_groups) == mine["conv_shard_groups"]
                       and getattr(s, "conv_slice_axis", None) == 1)  # fmt: skip
    checks["kda_state_shapes_equal_KimiLinearStateShape"] = bool(same_shape)
    src, dst = decode_state_ptrs(g, 100)[:16], decode_state_ptrs(g, 101)
    checks["state_descriptors_equal_sglang_slicing"] = all(
        state_descriptors(g, r, src, dst, mirror_slice_byte_blocks)
        == state_descriptors(g, r, src, dst, compute_mamba_state_slice_byte_blocks)
        for r in range(g.d_tp) if r in g.decode_ranks)  # fmt: skip
    checks["state_pairs_equal_build_transfer_entry_pairs"] = entry_pairs(
        g.kda_stage_layers * 2, g.kda_layers * 2) == [tuple(p) for p in build_transfer_entry_pairs(
            g.kda_stage_layers * 2, g.kda_layers * 2, 16, 2 * len(g.kda_layers))]  # fmt: skip
    s_pages, d_pages, _, _ = chunk_pages(g)
    sg, dg = group_concurrent_contiguous(s_pages.astype(np.int32), d_pages.astype(np.int32))
    item = g.page * g.mla_token_bytes
    want = ([], [], [])
    for base, j in zip([1 << 44, 2 << 44, 3 << 44, 4 << 44], g.mla_decode_index):
        for a, b in zip(sg, dg):
            want[0].append(base + a[0] * item)
            want[1].append(decode_kv_ptrs(g, 24)[j] + b[0] * item)
            want[2].append(item * len(a))
    got = mla_descriptors(g, [1 << 44, 2 << 44, 3 << 44, 4 << 44], decode_kv_ptrs(g, 24), s_pages, d_pages)
    checks["mla_descriptors_equal_group_concurrent_contiguous"] = [list(w) for w in want] == [list(x) for x in got]
    r = json.load(open(path))
    r["sglang_cross_check"] = dict(
        date_utc=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        sglang=importlib.metadata.version("sglang"), command=" ".join(sys.argv), checks=checks)  # fmt: skip
    with open(path, "w") as f:
        json.dump(r, f, indent=1)
    print(json.dumps(r["sglang_cross_check"], indent=1))


class _NoSglang:
    """A meta-path finder that refuses every sglang import (and records it)."""

    def __init__(self):
        self.refused = set()

    def find_spec(self, name, path=None, target=None):
        if name == "sglang" or name.startswith("sglang."):
            self.refused.add(name)
            raise ImportError(f"{name}: sglang is not importable here")
        return None


def smoke():
    """The shipped path on CPU (DigestEngine's host digest), a small chunk: sums against the
    formula's host digest and the decode-side state check; which sglang modules it imported."""
    import torch

    from sglang_dflash_pp.srt.disaggregation import kv_digest as kd

    g = geometry()
    pools = make_pools(g, torch.device("cpu"), 64, torch)
    pages = chunk_pages(g, pages=2 * RUN_PAGES, pool_pages=64)
    # sglang made unimportable while the shipped path runs (as on the GPU machine): a lazy sglang
    # import on that path raises here.
    hidden = {m: sys.modules.pop(m) for m in list(sys.modules) if m == "sglang" or m.startswith("sglang.")}
    blocker = _NoSglang()
    sys.meta_path.insert(0, blocker)
    try:
        sp = send_path_of(g, pools, pages, "cpu")
        t0 = time.perf_counter()
        sp.chunk(1, None, False)
        mid = sp.pop(1)
        t1 = time.perf_counter()
        sp.chunk(2, None, True)
        last = sp.pop(2)
        t2 = time.perf_counter()
        # over the emulated link: the middle chunk ends without waiting, the last one waits
        sp.chunk(3, None, False, link_bps=LINK_BPS)
        sp.drain()
        mid_link = sp.pop(3)
        sp.chunk(4, None, True, link_bps=LINK_BPS)
        last_link = sp.pop(4)
        sp.chunk(5, None, True, link_bps=LINK_BPS, digest=False)
        off = sp.pop(5)
        sp.chunk(6, None, False, link_bps=LINK_BPS, inline=True)
        mid_inline = sp.pop(6)
        sp.chunk(7, None, True, link_bps=LINK_BPS, inline=True)
        last_inline = sp.pop(7)
        sp.popped = last  # what decode_side_state compares with
    finally:
        sys.meta_path.remove(blocker)
        sys.modules.update(hidden)
    imported = sorted(blocker.refused)
    bases = [p.data_ptr() for p in pools.mla], [p.data_ptr() for p in pools.draft]
    keys = keys_of(g)
    ok = []
    for r in g.decode_ranks:
        want = kd.digest_blocks_host(rank_blocks(g, r, *bases, pages), keys)
        ok.append(mid[r].sums == {(1, i): int(v) for i, v in enumerate(want) if int(v)})
    side = [decode_side_state(g, sp, r, pools.conv, pools.temporal, torch) for r in g.decode_ranks]
    print(json.dumps(dict(
        middle_equals_formula=ok, decode_side_state=side, failures=sp.failures,
        last_kv_equals_middle=[{k: v for k, v in last[r].sums.items() if k[0] == 1} == mid[r].sums
                               for r in g.decode_ranks],
        state_keys=len([k for k in last[g.decode_ranks[0]].sums if k[0] == 2]),
        over_link_equals_without=[mid_link[r].sums == mid[r].sums and last_link[r].sums == last[r].sums
                                  and mid_inline[r].sums == mid[r].sums
                                  and last_inline[r].sums == last[r].sums for r in g.decode_ranks],
        digest_off_sends_no_sums=all(not off[r].sums for r in g.decode_ranks),
        sglang_imports_refused_on_the_shipped_path=imported, host_s=[t1 - t0, t2 - t1],
        bytes=[sp.bytes(False), sp.bytes(True)]), indent=1))  # fmt: skip


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--max-blocks", type=int, default=65536)  # kv_digest_engine's default
    ap.add_argument("--max-slots", type=int, default=8192)
    ap.add_argument("--render", help="print the README section of a result file")
    ap.add_argument("--check-sglang", help="compare with sglang's own functions; record in this result file")
    ap.add_argument("--smoke", action="store_true", help="the shipped path on CPU, a small chunk")
    ap.add_argument("--keep-previous", nargs=2, metavar=("RESULT", "EARLIER"),
                    help="copy an earlier result's direct-variant summaries into RESULT")
    ap.add_argument("--geometry", action="store_true", help="print the chunk's blocks (no GPU)")
    args = ap.parse_args()
    if args.render:
        return render(args.render)
    if args.check_sglang:
        return check_sglang(args.check_sglang)
    if args.smoke:
        return smoke()
    if args.keep_previous:
        return keep_previous(*args.keep_previous)
    if args.geometry:
        g = geometry()
        fake = [1 << 40] * len(g.mla_stage_layers), [1 << 41] * g.draft_entries
        pages = chunk_pages(g)
        b = rank_blocks(g, g.decode_ranks[0], *fake, pages)
        r0 = g.decode_ranks[0]
        mla = mla_descriptors(g, [(3 + i) << 40 for i in range(4)], decode_kv_ptrs(g, r0), *pages[:2])
        st = state_descriptors(g, r0, decode_state_ptrs(g, 100)[:16], decode_state_ptrs(g, r0))
        print(vars(g))
        print(dict(blocks_per_rank=b.count, bytes_per_rank=b.total_bytes,
                   chunk_bytes=b.total_bytes * len(g.decode_ranks),
                   link_ms=b.total_bytes * len(g.decode_ranks) / LINK_BPS * 1e3,
                   mla_descriptors_per_rank=len(mla[0]), mla_bytes_per_rank=sum(mla[2]),
                   state_descriptors_per_rank=len(st[0]), state_bytes_per_rank=sum(st[2]),
                   state_lengths=sorted(set(st[2]))))  # fmt: skip
        print(b.table()[:3], b.table()[-3:], sep="\n")
        return
    if not args.out:
        ap.error("--out is required")
    run(args)


if __name__ == "__main__":
    main()
