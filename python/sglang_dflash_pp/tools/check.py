"""What a DFLASH P/D deployment would do, and every refusal either server's startup would
raise.

Every number and verdict comes from the patched tree's own code, run on the resolved arguments
in a runtime context built from them (as a scheduler has one), so the report is what the servers
would do, not a second model of it: ``ServerArgs`` of both servers, ``ModelConfig``, the
runner's capture layers, ``get_pp_indices``, ``DFlashPPStage.build`` and the startup checks of
``for_target``, each side's draft built by its own constructor (on the meta device, at that
side's draft parallel layout), ``compute_head_slice_params`` and
``MooncakeKVManager._draft_kv_layout_mismatch``. The decode's launch arguments are taken to be
the prefill's (the same model, draft, page size and KV cache dtype, as the draft KV transfer
needs) at ``--decode-tp-size``, PP1 and in decode mode, without the prefill's expert
parallelism.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from types import SimpleNamespace
from typing import List

from sglang_dflash_pp.tools.check_transfer import stage_transfer
from sglang_dflash_pp.tools.resolve import quiet_sglang, resolve

SHOWN = ("tp_size", "pp_size", "ep_size", "page_size", "kv_cache_dtype", "speculative_algorithm",
         "speculative_num_draft_tokens", "disaggregation_mode", "disaggregation_transfer_backend")


class UsageError(ValueError):
    """Arguments ``check`` cannot plan (not DFLASH, no such prefill rank): exit code 2."""


@dataclass
class CheckInputs:
    argv: List[str]  # the prefill's launch arguments
    decode_tp: int  # the decode's attention TP size
    prompt_tokens: int
    prefill_rank: int = 0  # the last stage's attention-TP rank whose writes are listed
    label: str = "prefill launch arguments"
    link_gbps: float = 50.0  # the link one prefill rank sends on, in GB/s


def run_check(inputs: CheckInputs, verbose: bool = False) -> dict:
    """The report as plain data; ``accepted`` says whether startup would succeed."""
    rep = dict(label=inputs.label, argv=inputs.argv, refusals=[])
    with quiet_sglang(verbose):
        record, error = resolve(inputs.argv)
        if error:
            refuse(rep, "prefill ServerArgs resolution", error)
        else:
            _plan(rep, record, inputs)
            _draft_builds(rep, "prefill", record)
        rep["decode_argv"] = decode_argv(inputs.argv, inputs.decode_tp)
        decode, error = resolve(rep["decode_argv"])
        if error:
            refuse(rep, "decode ServerArgs resolution", error)
        else:
            _draft_builds(rep, "decode", decode)
    rep["accepted"] = not rep["refusals"]
    return rep


# The prefill's settings the decode does not share: check gives it its own.
PREFILL_ONLY = ("--disaggregation-mode", "--pp-size", "--tp-size", "--ep-size")


def decode_argv(argv: List[str], decode_tp: int) -> List[str]:
    """The decode's launch arguments as check takes them: the prefill's at the decode's
    TP, PP1, in decode mode, without the prefill's expert parallelism."""
    out, i = [], 0
    while i < len(argv):
        flag = argv[i].split("=", 1)[0]
        if flag in PREFILL_ONLY:
            i += 1 if "=" in argv[i] else 2
            continue
        out.append(argv[i])
        i += 1
    return out + ["--tp-size", str(decode_tp), "--pp-size", "1",
                  "--disaggregation-mode", "decode"]


def _draft_builds(rep: dict, side: str, record) -> None:
    """Build the side's DFlash draft as its DFLASH worker does (on the last PP stage of a
    prefill), on the meta device: the constructors' refusals (heads and widths over the
    draft's TP) are that server's startup refusals."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state import (
        resolve_spec_aux_hidden_state_config,
    )
    from sglang.srt.models.registry import ModelRegistry
    from sglang.srt.runtime_context import (
        create_context,
        draft_attn_tp_size,
        get_parallel,
        use_context,
    )
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    algorithm = SpeculativeAlgorithm.from_string("DFLASH")
    with use_context(create_context(record, role="scheduler")):
        target = ModelConfig.from_server_args(record)
        draft = resolve_spec_aux_hidden_state_config(
            server_args=record, model_config=target, is_draft_worker=False,
            spec_algorithm=algorithm).draft_model_config
        model_cls, _ = ModelRegistry.resolve_model_cls(draft.hf_config.architectures)
        # The draft's own group, as draft_tp_context narrows it: attention TP under
        # attention DP; any rank builds the same shapes.
        tp = draft_attn_tp_size()
        try:
            with native_rope(), torch_meta():
                get_parallel().override_permanently(
                    tp_size=tp, tp_rank=0, attn_tp_size=tp, attn_dp_size=1,
                    attn_cp_size=1, moe_tp_size=tp, moe_ep_size=1, moe_dp_size=1)
                model_cls(draft.hf_config)
        except Exception as e:
            refuse(rep, f"{side} draft at draft TP {tp} ({model_cls.__name__})",
                   f"{type(e).__name__}: {e}")


@contextlib.contextmanager
def torch_meta():
    import torch

    with torch.device("meta"):
        yield


@contextlib.contextmanager
def native_rope():
    """RoPE's native path while a draft is built on the meta device, where only the module's
    shapes matter: on a machine without CUDA its kernel path would import a GPU library."""
    import sglang.srt.layers.rotary_embedding.base as rotary_base

    original, rotary_base._is_cpu = rotary_base._is_cpu, True
    try:
        yield
    finally:
        rotary_base._is_cpu = original


def refuse(rep: dict, source: str, message) -> None:
    rep["refusals"].append(dict(source=source, message=str(message).strip()))


def _plan(rep: dict, record, inputs: CheckInputs) -> None:
    from sglang.srt.configs.hybrid_arch import mambaish_config
    from sglang.srt.configs.model_config import AttentionArch, ModelConfig
    from sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state import (
        resolve_spec_aux_hidden_state_config,
    )
    from sglang.srt.model_loader.utils import get_model_architecture
    from sglang.srt.runtime_context import create_context, use_context
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    resolved = json.loads(json.dumps(record.resolved_dict(), default=str))
    rep["prefill"] = {k: resolved.get(k) for k in SHOWN}
    if str(resolved.get("speculative_algorithm")).upper() != "DFLASH":
        raise UsageError("check plans DFLASH servers: pass --speculative-algorithm DFLASH")
    with use_context(create_context(record, role="scheduler")):
        target = ModelConfig.from_server_args(record)
        aux = resolve_spec_aux_hidden_state_config(
            server_args=record, model_config=target, is_draft_worker=False,
            spec_algorithm=SpeculativeAlgorithm.from_string("DFLASH"),
        )
        draft, model_cls = aux.draft_model_config, get_model_architecture(target)[0]
        rep["target"] = dict(
            model_class=model_cls.__name__,
            num_layers=int(target.num_hidden_layers),
            # What the Mooncake manager calls is_mla_backend: a plain MLA pool (a hybrid
            # linear-attention pool is not one), whose decode ranks pull from one P rank each.
            mla_pool=target.attention_arch == AttentionArch.MLA and not mambaish_config(target),
            kv_layer_ids=_publishes_kv_layer_ids(target, resolved),
        )
        rep["draft"] = dict(
            num_layers=int(aux.dflash_draft_num_layers), hidden_size=draft.hf_config.hidden_size,
            kv_heads=draft.get_total_num_kv_heads(), head_dim=draft.head_dim,
            target_layer_ids=list(aux.dflash_target_layer_ids))
        _stages(rep, int(resolved["pp_size"]), target, model_cls, draft)
        kv_dtype = _draft_kv(rep, record, resolved, draft, inputs)
        stage_transfer(rep, target, draft, kv_dtype(target.dtype, False), inputs.link_gbps)
        _draft_against_target(rep, resolved, target)


def _publishes_kv_layer_ids(target, resolved: dict) -> bool:
    """Whether ``build_kv_layer_ids`` (under DFLASH) gives ids for the pool that
    ``_build_token_to_kv_pool`` picks for this target, in its order: an SWA pool none
    (a hybrid linear-attention model with sliding layers too); a MiniMax sparse pool only on
    its NVFP4 stack; a hybrid linear-attention pool or a plain MHA pool ids; a plain MLA pool
    none. (Unified memory, whose envelope has none, is refused with PD speculative decoding
    over Mooncake.)"""
    from sglang.srt.configs.hybrid_arch import mambaish_config
    from sglang.srt.configs.model_config import (
        AttentionArch, is_minimax_sparse, uses_minimax_m3_nvfp4_native_stack)

    if target.is_hybrid_swa:
        return False
    if is_minimax_sparse(target.hf_config):
        return uses_minimax_m3_nvfp4_native_stack(resolved.get("quantization"))
    return bool(mambaish_config(target)) or target.attention_arch != AttentionArch.MLA


def _draft_against_target(rep: dict, resolved: dict, target) -> None:
    """The static draft/target checks (``draft_target.check_draft``) on the two checkpoints."""
    from sglang_dflash_pp.tools.draft_target import as_dicts, check_draft

    findings = check_draft(
        resolved["model_path"], resolved["speculative_draft_model_path"],
        tokenizer_path=resolved.get("tokenizer_path"),
        num_draft_tokens=resolved.get("speculative_num_draft_tokens"),
        context_length=int(target.context_len), pp_size=int(resolved["pp_size"]),
        trust_remote_code=bool(resolved.get("trust_remote_code")),
    )
    # Not startup refusals: most of them (block size, tokenizer, RoPE) only lower acceptance.
    rep["draft_target"] = as_dicts(findings)
    rep["draft_matches_target"] = not any(f.refused for f in findings)


def _stages(rep: dict, pp: int, target, model_cls, draft) -> None:
    """The partition, each stage's features, the carry on each hop and, under PP, the checks
    every stage runs at startup (``DFlashPPStage.for_target``)."""
    from sglang.srt.distributed.utils import get_pp_indices
    from sglang.srt.speculative.dflash_pp import (DFlashPPStage, check_pp_draft,
                                                  check_pp_target, feature_stages)

    layers, ids = rep["target"]["num_layers"], rep["draft"]["target_layer_ids"]
    if pp > 1:
        for source, check, arg in (
            ("target class (check_pp_target)", check_pp_target, model_cls.__new__(model_cls)),
            ("draft (check_pp_draft)", check_pp_draft, draft.hf_config),
        ):
            try:
                check(arg)
            except ValueError as e:
                refuse(rep, source, e)
    try:
        built = [DFlashPPStage.build(ids, layers, r, pp) for r in range(pp)]
    except ValueError as e:
        refuse(rep, "PP partition (DFlashPPStage.build)", e)
        built = None
    owners = feature_stages(ids, layers, pp)  # what build() assigns, for a refused partition too
    hidden, raw_bytes = rep["draft"]["hidden_size"], target.dtype.itemsize
    rep.update(partition_env=os.environ.get("SGLANG_PP_LAYER_PARTITION"), stages=[], carry=[])
    for r in range(pp):
        mine = list(built[r].features) if built else [j for j, s in enumerate(owners) if s == r]
        rep["stages"].append(dict(
            stage=r, layers=list(get_pp_indices(layers, r, pp)), features=mine,
            captured_layers=[ids[j] for j in mine], holds_draft=r == pp - 1,
            receives_partial=any(s < r for s in owners),
        ))
        k = sum(s <= r for s in owners)  # the hop r -> r + 1 carries what stages 0..r captured
        if r < pp - 1:
            rep["carry"].append(dict(hop=f"{r}->{r + 1}", captured_features=k,
                                     partial_fp32=4 * hidden if k else 0,
                                     raw_captures=raw_bytes * hidden * k))


def _draft_kv(rep: dict, record, resolved: dict, draft, inputs: CheckInputs):
    """Draft KV heads per rank on both sides, what one last-stage P rank writes to which D ranks
    (``send_kvcache_slice(draft=True)``) per request, and the decode's registration verdict.
    Returns the KV cache dtype sglang gives a pool (``kv_dtype(model_dtype, is_draft)``)."""
    from sglang.srt.arg_groups.model_override_base import resolved_view
    from sglang.srt.disaggregation.common.staging_buffer import compute_head_slice_params
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager
    from sglang.srt.environ import envs
    from sglang.srt.mem_cache.kv_cache_dtype import configure_kv_cache_dtype
    from sglang.srt.runtime_context import (attn_tp_size_of, get_schedule,
                                            max_prefill_buffer_tokens)

    def kv_dtype(model_dtype, is_draft: bool):
        return configure_kv_cache_dtype(
            server_args_kv_cache_dtype=str(resolved.get("kv_cache_dtype") or "auto"),
            model=None, model_dtype=model_dtype, is_draft_worker=is_draft, is_dflash=True,
            speculative_draft_attention_backend=resolved.get(
                "speculative_draft_attention_backend"),
            speculative_draft_kv_cache_dtype=resolved.get("speculative_draft_kv_cache_dtype"),
        )[1]

    dtype = kv_dtype(draft.dtype, True)
    total, entries = rep["draft"]["kv_heads"], 2 * rep["draft"]["num_layers"]  # K, V per layer
    tp_p, tp_d, q = attn_tp_size_of(resolved_view(record)), inputs.decode_tp, inputs.prefill_rank
    page, head_bytes = int(resolved["page_size"]), rep["draft"]["head_dim"] * dtype.itemsize
    if not 0 <= q < tp_p:
        raise UsageError(f"--prefill-rank {q}: the prefill has attention TP {tp_p}")

    def heads(tp: int, rank: int) -> List[int]:
        n = max(1, total // tp)
        first = rank * n if total >= tp else rank // (tp // total)
        return list(range(first, first + n))

    def item_len(tp: int) -> int:  # bytes of one page of one entry on a rank
        return page * max(1, total // tp) * head_bytes

    ids = list(range(entries)) if rep["target"]["kv_layer_ids"] else []  # only their presence counts
    manager = SimpleNamespace(
        kv_args=SimpleNamespace(num_draft_entries=entries, draft_total_kv_head_num=total,
                                kv_item_lens=[item_len(tp_p)] * entries, kv_layer_ids=ids),
        attn_tp_size=tp_p, enable_staging=envs.SGLANG_DISAGG_STAGING_BUFFER.get(),
        is_mla_backend=rep["target"]["mla_pool"],
        pp_size=1,  # both sides run one model and draft: both publish ids or neither
    )
    peer = SimpleNamespace(dst_attn_tp_size=tp_d, dst_tp_rank=0, requires_dcp_relayout=False,
                           dst_kv_item_lens=[item_len(tp_d)] * entries, dst_kv_layer_ids=ids)
    mismatch = MooncakeKVManager._draft_kv_layout_mismatch(manager, peer)
    if mismatch:
        refuse(rep, "decode registration (MooncakeKVManager._draft_kv_layout_mismatch)", mismatch)
    # D rank r reads from P rank r // (Td / Tp), or from P ranks [r k, (r + 1) k), k = Tp / Td.
    targets = range(q * tp_d // tp_p, max(q * tp_d // tp_p + 1, (q + 1) * tp_d // tp_p))
    # Each prefill chunk goes on its own, as whole pages of rows: at equal TP as page runs, at
    # another TP one descriptor per token row and entry, unless a CUDA pack buffer (2+ heads per
    # P rank, chunked prefill: _init_draft_kv_pack_buffers_once, a chunk of whole rows) packs a
    # D rank's heads into page runs: one gather for all D ranks where the chunk's rows fit it,
    # else one per D rank and piece of the buffer (_send_packed_head_slices).
    chunk, tokens = int(resolved.get("chunked_prefill_size") or 0), inputs.prompt_tokens
    sizes = [min(chunk, tokens - i) for i in range(0, tokens, chunk)] if chunk > 0 else [tokens]
    rows = [-(-t // page) * page for t in sizes]
    packs = total // tp_p >= 2 and resolved.get("device") == "cuda"
    # The pack buffer's bytes, as _init_draft_kv_pack_buffers_once sizes it.
    buffer_tokens = max_prefill_buffer_tokens() or get_schedule().max_prefill_tokens
    capacity = -(-buffer_tokens // page) * entries * item_len(tp_p)
    writes, n_dst = [], max(1, total // tp_d)  # heads a D rank holds
    packed = packs and n_dst < total // tp_p
    per_piece = capacity // (entries * item_len(tp_d))  # pages of a D rank's slice

    def sends(r: int) -> int:  # descriptors per entry for r rows (contiguous pages)
        return 1 if tp_p == tp_d else -(-r // page // per_piece) if packed else r

    for d in [] if mismatch else targets:
        src, n, dst, _ = compute_head_slice_params(tp_p, tp_d, q, d, total)
        send = "page runs" if tp_p == tp_d else "packed" if packed else "head by head"
        # A replica leaves the heads to the prefill rank before it (each byte written once).
        silent = bool(q % max(1, tp_p // tp_d)) and compute_head_slice_params(
            tp_p, tp_d, q - 1, d, total)[2] == dst
        send = f"silent: P rank {q - 1} writes them" if silent else send
        writes.append(dict(decode_rank=d, heads=heads(tp_p, q)[src : src + n], send=send,
                           bytes=0 if silent else sum(rows) * entries * n * head_bytes,
                           descriptors=0 if silent else entries * sum(sends(r) for r in rows)))
    # One gather of a chunk's whole rows serves every D rank; a larger one goes per D rank.
    whole = [r * entries * item_len(tp_p) // page <= capacity for r in rows]
    gathers = sum(1 if w else len(writes) * sends(r) for r, w in zip(rows, whole))
    rep["draft_kv"] = dict(
        dtype=str(dtype).replace("torch.", ""), page_size=page, entries=entries,
        prefill_tp=tp_p, decode_tp=tp_d, prefill_heads=[heads(tp_p, r) for r in range(tp_p)],
        decode_heads=[heads(tp_d, r) for r in range(tp_d)], prompt_tokens=tokens,
        chunks=len(sizes), pages=sum(rows) // page, prefill_rank=q, decode_ranks=list(targets),
        writes=writes,
        gathers=gathers if packed and writes else 0,
    )
    return kv_dtype
