"""The last prefill PP stage of ``preflight``: draft KV written by the real model, sent by the
plugin's real send path over the real Mooncake engine.

1. Build the real ``DFlashDraftModel`` (seeded weights) at TP1 on CPU and save its ``fc`` as the
   checkpoint the other stages read their column blocks from; compute sglang's partition
   (``get_pp_indices``) and the ownership, or report the refusal.
2. Receive the carry, then write the draft KV exactly as the PP worker does on the last stage:
   the inbound partial is stashed on the model (``models.dflash.stashed_context``) around the
   stock ``DFlashWorkerV2._append_target_hidden_to_draft_kv_by_loc`` (projection through the
   plugin's ``project_target_hidden`` hook, then the stock per-layer K/V path into a real
   ``MHATokenToKVPool`` with the run's page size).
3. The single-process reference: the same stock method, nothing stashed, on the full concat of
   every feature (stock ``project_target_hidden``, one ``fc`` GEMM).
4. Split the TP1 pool into one page-layout pool per prefill TP rank by head, as
   ``QKVParallelLinear`` shards KV heads (rank ``r`` holds heads ``[r*h, (r+1)*h)``; with more
   ranks than heads, consecutive ranks hold the same heads). Building the draft once at TP1 and
   splitting keeps the run small; it is exact because each head's K/V depends only on its own
   rows of the projection.
5. For every decode rank and every prefill rank sglang's rank mapping pairs it with: the
   plugin's registration verdict (``draft_kv_peer.peer_verdict``) on the item lengths both sides
   really registered, then the plugin's ``mooncake_draft_kv.send_draft_entries`` (pack into the
   registered staging buffer, page-run descriptors, batches of at most 1024) through one Mooncake
   engine holding every prefill rank's pool.

The "manager" handed to ``send_draft_entries`` is :class:`PrefillRankSender`: the attributes of
sglang's ``MooncakeKVManager`` that the draft send path reads, around the real engine.
"""

from __future__ import annotations

import json
import time
from types import SimpleNamespace
from typing import Dict, List

from sglang_dflash_pp.tools import peer_process as proc
from sglang_dflash_pp.tools.preflight_spec import (
    KV_FILE,
    OWNERSHIP_FILE,
    SGLANG_INIT,
    PreflightSpec,
)
from sglang_dflash_pp.tools.preflight_carry import carry_group, recv_partial


def setup_sglang(spec: PreflightSpec) -> None:
    """Plugins as in a server process; a world-1 gloo runtime (the draft's layers read their TP
    group even at TP1), initialised through a file so no port is opened; RoPE on its native
    torch path (``_is_cpu``: the flag sglang freezes at import from SGLANG_USE_CPU_ENGINE, which
    would switch the whole platform to a CPU-kernel build that is not installed)."""
    from sglang.srt.plugins import load_plugins

    load_plugins()
    import sglang.srt.layers.rotary_embedding.base as rotary_base
    from sglang.srt.distributed.parallel_state import init_distributed_environment
    from sglang.test.layer_ut_utils import init_single_process_dist

    init_distributed_environment(
        world_size=1,
        rank=0,
        distributed_init_method=f"file://{spec.path(SGLANG_INIT)}",
        local_rank=0,
        backend="gloo",
    )
    init_single_process_dist(backend="gloo")  # publishes the TP1 topology, model-parallel groups
    rotary_base._is_cpu = True

    from sglang_dflash_pp.hooks import is_applied
    from sglang_dflash_pp.srt.models import dflash as dflash_hook

    missing = [h.name for h in dflash_hook.HOOKS if not is_applied(h)]
    if missing:
        raise RuntimeError(f"the plugin's hooks are not applied in this process: {missing}")


def build_draft(spec: PreflightSpec):
    """The real ``DFlashDraftModel`` with seeded weights; its ``fc`` saved as the checkpoint."""
    import os

    import torch
    from safetensors.torch import save_file
    from sglang.srt.models.dflash import DFlashDraftModel
    from sglang.srt.utils.hf_transformers.config import get_config

    torch.manual_seed(spec.seed)
    model = DFlashDraftModel(get_config(spec.draft_dir, trust_remote_code=True)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.ndim == 1 else 0.0))
    model = model.to(spec.torch_dtype(spec.dtype))
    fc = model.fc.weight.detach().contiguous()
    save_file({"fc.weight": fc}, os.path.join(spec.draft_dir, "model.safetensors"))
    return model


def partition(spec: PreflightSpec):
    """sglang's partition and the ownership; writes it for the other stages."""
    from sglang.srt.distributed.utils import get_pp_indices

    from sglang_dflash_pp.srt.models.capture_ownership import compute_feature_ownership

    stage_layers = [list(get_pp_indices(spec.num_layers, r, spec.pp)) for r in range(spec.pp)]
    ownership = compute_feature_ownership(stage_layers, spec.target_layer_ids, spec.num_layers)
    with open(spec.path(OWNERSHIP_FILE), "w") as f:
        json.dump({"stage_layers": stage_layers}, f)
    return ownership


def draft_pool(spec: PreflightSpec, head_num: int):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return MHATokenToKVPool(
        size=spec.p_pool_pages * spec.page_size,
        page_size=spec.page_size,
        dtype=spec.torch_dtype(spec.dtype),
        head_num=head_num,
        head_dim=spec.head_dim,
        layer_num=spec.draft_layers,
        device="cpu",
        enable_memory_saver=False,
    )


def kv_writer(model, pool):
    """A ``DFlashWorkerV2`` holding only what its draft-KV write path reads (its real
    ``__init__`` builds a draft model runner and device pools). CPU: the sequential path."""
    from sglang.srt.speculative.base_spec_worker import BaseSpecWorker
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2
    from sglang.srt.speculative.draft_parallel import DraftParallelLayout

    w = object.__new__(DFlashWorkerV2)
    BaseSpecWorker.__init__(w)
    w.model_runner = SimpleNamespace(device="cpu")
    w.draft_model = model
    w.draft_model_runner = SimpleNamespace(token_to_kv_pool=pool)
    w.draft_parallel_layout = DraftParallelLayout(tp_group=None, attn_tp_size=1)
    w.lilicorr = None
    w._use_fused_kv_materialize = False
    w._fused_kv_helper = None
    return w


def write_kv(spec: PreflightSpec, model, hidden, pool) -> None:
    import torch

    writer = kv_writer(model, pool)
    with torch.inference_mode():
        writer._append_target_hidden_to_draft_kv_by_loc(
            target_hidden=hidden, cache_loc=spec.cache_locs(), positions=torch.arange(spec.tokens)
        )


def pool_kv(pool) -> Dict[str, list]:
    return {"k": [t.clone() for t in pool.k_buffer], "v": [t.clone() for t in pool.v_buffer]}


def split_by_head(spec: PreflightSpec, pool) -> list:
    """One page-layout pool per prefill TP rank, holding the heads QKVParallelLinear gives it."""
    from sglang_dflash_pp.srt.disaggregation.draft_kv_geometry import DraftKVGeometry, DraftKVShape

    shape = DraftKVShape(spec.draft_heads, spec.head_dim, spec.head_dim, pool.store_dtype.itemsize)
    pools = []
    for p in range(spec.p_tp):
        heads = DraftKVGeometry.for_rank(
            shape, side="prefill", tp_size=spec.p_tp, tp_rank=p, page_size=spec.page_size
        ).owned_heads
        rank_pool = draft_pool(spec, len(heads))
        for src, dst in zip(
            list(pool.k_buffer) + list(pool.v_buffer),
            list(rank_pool.k_buffer) + list(rank_pool.v_buffer),
        ):
            dst.copy_(src[:, heads.start : heads.stop])
        pools.append(rank_pool)
    return pools


class PrefillRankSender:
    """What ``mooncake_draft_kv.send_draft_entries`` reads of a ``MooncakeKVManager``: the rank's
    KV args, the batching knob, the engine (to register the pack buffer) and ``_transfer_data``
    (here the real engine's ``batch_transfer_sync_write``, counted)."""

    def __init__(self, engine, rank: int, ptrs: List[int], lens: List[int], item_lens: List[int],
                 num_draft: int):  # fmt: skip
        self._engine = engine
        self.rank = rank
        self.kv_args = SimpleNamespace(
            kv_data_ptrs=list(ptrs),
            kv_data_lens=list(lens),
            kv_item_lens=list(item_lens),
            num_draft_entries=num_draft,
        )
        self.max_transfer_batch_indices = 0
        self.calls: List[int] = []  # descriptors per engine call
        self.bytes = 0
        self.pack_buffer = None

    def _transfer_data(self, session: str, blocks) -> int:
        src, dst, length = (list(x) for x in zip(*blocks)) if blocks else ([], [], [])
        self.calls.append(len(blocks))
        self.bytes += sum(length)
        return self._engine.batch_transfer_sync_write(session, src, dst, length)


def run_last_stage(spec: PreflightSpec) -> None:
    import torch

    torch.set_num_threads(1)
    proc.progress("last stage: importing sglang, building the draft")
    t = time.perf_counter()
    setup_sglang(spec)
    model = build_draft(spec)
    from sglang_dflash_pp.srt.models.capture_ownership import OwnershipError

    try:
        ownership = partition(spec)
    except (OwnershipError, ValueError) as e:
        proc.send("refused", source="feature ownership (capture_ownership)", message=str(e))
        return
    proc.send(
        "ownership",
        setup_s=time.perf_counter() - t,
        stages=ownership.stage_rows(),
    )
    engine = _engine()  # before the timed phases: engine start-up is not transfer time

    from sglang_dflash_pp.srt.models.context_partial import fc_column_block
    from sglang_dflash_pp.srt.models.dflash import LastStageContext, stashed_context
    from sglang_dflash_pp.srt.speculative.pp_stage_carry import StageCarry

    carry = StageCarry.of(ownership, spec.pp - 1, spec.hidden)
    group = carry_group(spec, spec.pp - 1)
    group.barrier().wait()
    t0 = time.perf_counter()
    partial_in = recv_partial(spec, group, spec.pp - 1) if carry.receives else None
    t_carry = time.perf_counter()

    pool = draft_pool(spec, spec.draft_heads)
    w_last = fc_column_block(model.fc.weight, carry.features, spec.hidden)
    with stashed_context(model, LastStageContext(w_last, partial_in)):
        write_kv(spec, model, spec.captures(carry.features), pool)
    rank_pools = split_by_head(spec, pool)
    t_kv = time.perf_counter()

    ref_pool = draft_pool(spec, spec.draft_heads)
    write_kv(spec, model, spec.captures(range(spec.num_features)), ref_pool)
    torch.save({"pp": pool_kv(pool), "ref": pool_kv(ref_pool)}, spec.path(KV_FILE))
    err = _kv_error(spec, pool, ref_pool)
    proc.send(
        "written",
        features=list(carry.features),
        received_partial=partial_in is not None,
        carry_wait_s=t_carry - t0,
        kv_write_s=t_kv - t_carry,
        **err,
    )

    senders, sources = _register(spec, engine, rank_pools)
    decode = proc.read_command()["decode"]
    t1 = time.perf_counter()
    pairs = _send_all(spec, senders, sources, decode)
    t_transfer = time.perf_counter() - t1
    proc.send(
        "transferred",
        transfer_s=t_transfer,
        pairs=pairs,
        calls=sum(len(s.calls) for s in senders),
        max_batch=max((max(s.calls) for s in senders if s.calls), default=0),
        pack_buffer_bytes=[
            s.pack_buffer.nbytes if s.pack_buffer is not None else 0 for s in senders
        ],
    )
    proc.read_command()  # exit


def _kv_error(spec: PreflightSpec, pool, ref_pool) -> dict:
    """Max |PP path - reference| over the written rows, in the model dtype, and the scale."""
    locs = spec.cache_locs()
    err, scale = 0.0, 0.0
    for a, b in zip(
        list(pool.k_buffer) + list(pool.v_buffer), list(ref_pool.k_buffer) + list(ref_pool.v_buffer)
    ):
        x, y = a[locs].float(), b[locs].float()
        err = max(err, (x - y).abs().max().item())
        scale = max(scale, y.abs().max().item())
    return dict(kv_max_abs_error=err, kv_ref_absmax=scale)


def _engine():
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    rc = engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise RuntimeError(f"Mooncake TransferEngine.initialize returned {rc}")
    return engine


def _register(spec: PreflightSpec, engine, rank_pools):
    """Register every prefill rank's draft pool as sglang does (each K and V buffer, from
    ``get_contiguous_buf_infos``) and record it for the send path (``describe_draft_pool``)."""
    from dataclasses import replace

    from sglang_dflash_pp.srt.disaggregation.draft_kv_geometry import DraftKVGeometry
    from sglang_dflash_pp.srt.disaggregation.draft_kv_source import (
        describe_draft_pool,
        record_draft_kv_source,
    )
    from sglang_dflash_pp.srt.disaggregation.draft_kv_staging import build_staging

    senders, sources = [], []
    for p, pool in enumerate(rank_pools):
        ptrs, lens, item_lens = pool.get_contiguous_buf_infos()
        rc = engine.batch_register_memory(list(ptrs), list(lens))
        if rc != 0:
            raise RuntimeError(f"Mooncake refused to register prefill rank {p}'s pool (rc={rc})")
        source = describe_draft_pool(pool, spec.draft_heads)
        if source.shape is None:
            raise RuntimeError(f"prefill rank {p}'s pool: {source.shape_unknown_reason}")
        sender = PrefillRankSender(engine, p, ptrs, lens, item_lens, len(ptrs))
        sender.kv_args.page_size = spec.page_size
        # The staging the prefill builds at startup (one slot: one transfer queue), registered.
        src = DraftKVGeometry.for_rank(
            source.shape, side="prefill", tp_size=spec.p_tp, tp_rank=p, page_size=spec.page_size
        )
        staging = build_staging(source, src, chunk_tokens=spec.tokens, num_slots=1)
        if staging is not None:
            buf = staging.buffer
            rc = engine.batch_register_memory([buf.ptr], [buf.nbytes])
            if rc != 0:
                raise RuntimeError(f"Mooncake refused prefill rank {p}'s pack buffer (rc={rc})")
            sender.pack_buffer = buf
        source = replace(source, staging=staging)
        record_draft_kv_source(source)
        senders.append(sender)
        sources.append(source)
    return senders, sources


def _send_all(spec: PreflightSpec, senders, sources, decode: dict) -> list:
    from sglang_dflash_pp.srt.disaggregation import mooncake_draft_kv
    from sglang_dflash_pp.srt.disaggregation.draft_kv_peer import (
        DecodePeer,
        DraftEntryPair,
        DraftKVPeerPlan,
        PrefillSide,
        peer_verdict,
    )
    from sglang_dflash_pp.srt.disaggregation.draft_kv_plan import prefill_ranks_for
    from sglang_dflash_pp.tools.draft_kv_report import DraftKVTopology, writes_draft

    session = decode["session"]
    topo = DraftKVTopology(
        sources[0].shape, spec.draft_layers, spec.page_size, spec.p_tp, spec.d_tp, spec.pp
    )
    n = 2 * spec.draft_layers
    entries = tuple(DraftEntryPair(q, q, c) for q, c in enumerate(topo.components))
    pairs = []
    for r in range(spec.d_tp):
        published = decode["ranks"][str(r)]
        group = prefill_ranks_for(r, prefill_tp=spec.p_tp, decode_tp=spec.d_tp)
        for p in group:
            sender, source = senders[p], sources[p]
            prefill = PrefillSide(
                tp_size=spec.p_tp, tp_rank=p, page_size=spec.page_size,
                item_lens=sender.kv_args.kv_item_lens, num_draft_entries=n, has_layer_ids=True,
                pp_size=spec.pp, pp_rank=spec.pp - 1, shape=source.shape,
            )  # fmt: skip
            peer = DecodePeer(
                tp_size=spec.d_tp, tp_rank=r, item_lens=published["item_lens"], num_entries=n,
                has_layer_ids=True,
            )  # fmt: skip
            # sglang (hybrid MLA): with a smaller decode TP only the group's first rank sends
            # the replicated target KV; the verdict lets an elected draft writer through anyway.
            skips = spec.d_tp < spec.p_tp and p != group.start
            plan = peer_verdict(prefill, peer, [(q, q) for q in range(n)], stock_skips_kv=skips)
            pair = writes_draft(plan, topo, p, r)
            row = dict(
                prefill_rank=p, decode_rank=r, action=plan.action.value, sent=pair is not None
            )
            pairs.append(row)
            if pair is None:
                continue  # a replica that lost the election: no draft bytes
            if not plan.action.sends_draft:
                # A stock verdict (equal heads per rank): sglang's own whole-page copy, whose
                # descriptors the same send function builds for this regime.
                plan = DraftKVPeerPlan(plan.action, pair, entries)
            calls0, bytes0 = len(sender.calls), sender.bytes
            send = mooncake_draft_kv.DraftSend.of(sender, plan, published["kv_ptrs"])
            ret = mooncake_draft_kv.send_draft_entries(
                sender, send, session, spec.src_pages, spec.dst_pages
            )
            if ret != 0:
                raise RuntimeError(
                    f"draft KV send prefill rank {p} -> decode rank {r} returned {ret}"
                )
            row.update(
                heads=list(pair.heads),
                regime=pair.regime.value,
                descriptors=sum(sender.calls[calls0:]),
                calls=len(sender.calls) - calls0,
                bytes=sender.bytes - bytes0,
            )
    return pairs
