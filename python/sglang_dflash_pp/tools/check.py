"""What a DFLASH P/D deployment would do, and every refusal its startup would raise.

Every number and verdict comes from the patched tree's own code, run on the resolved arguments
inside a runtime context built from them (as a scheduler process has one), so the report is
what the servers would do, not a second model of it:

* resolution: sglang's ``ServerArgs`` (``tools.resolve``), including the series' gate;
* the target and draft: ``ModelConfig.from_server_args`` and the runner's
  ``resolve_spec_aux_hidden_state_config`` (capture layer ids, draft layers);
* the stages: ``get_pp_indices`` (``SGLANG_PP_LAYER_PARTITION``), ``DFlashPPStage.build`` and the
  startup checks ``DFlashPPStage.for_target`` runs (``check_pp_target`` on the class the model
  loader picks, ``check_pp_draft``);
* the draft KV: ``configure_kv_cache_dtype``, ``compute_head_slice_params`` and the decode
  registration verdict ``MooncakeKVManager._draft_kv_layout_mismatch``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from types import SimpleNamespace
from typing import List

from sglang_dflash_pp.tools.resolve import quiet_sglang, resolve

SHOWN = ("tp_size", "pp_size", "ep_size", "page_size", "kv_cache_dtype", "speculative_algorithm",
         "speculative_num_draft_tokens", "disaggregation_mode", "disaggregation_transfer_backend",
         "attention_backend", "model_path", "speculative_draft_model_path")  # fmt: skip


class UsageError(ValueError):
    """Arguments ``check`` cannot plan (not DFLASH, no such prefill rank): exit code 2."""


@dataclass
class CheckInputs:
    argv: List[str]  # the prefill's launch arguments
    decode_tp: int  # the decode's attention TP size
    prompt_tokens: int
    prefill_rank: int = 0  # the last stage's attention-TP rank whose writes are listed
    label: str = "prefill launch arguments"


def run_check(inputs: CheckInputs, verbose: bool = False) -> dict:
    """The report as plain data; ``accepted`` says whether startup would succeed."""
    rep = dict(label=inputs.label, argv=inputs.argv, decode_tp_size=inputs.decode_tp, refusals=[])
    with quiet_sglang(verbose):
        record, error = resolve(inputs.argv)
        if error:
            _refuse(rep, "prefill ServerArgs resolution", error)
        else:
            _plan(rep, record, inputs)
    rep["accepted"] = not rep["refusals"]
    return rep


def _refuse(rep: dict, source: str, message) -> None:
    rep["refusals"].append(dict(source=source, message=str(message).strip()))


def _plan(rep: dict, record, inputs: CheckInputs) -> None:
    from sglang.srt.configs.hybrid_arch import mambaish_config
    from sglang.srt.configs.model_config import AttentionArch, ModelConfig
    from sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state import (
        resolve_spec_aux_hidden_state_config,
    )
    from sglang.srt.runtime_context import create_context, use_context
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    resolved = json.loads(json.dumps(record.resolved_dict(), default=str))
    rep["prefill"] = {k: resolved.get(k) for k in SHOWN}
    if str(resolved.get("speculative_algorithm")).upper() != "DFLASH":
        raise UsageError("check plans DFLASH servers: pass --speculative-algorithm DFLASH")
    with use_context(create_context(record, role="scheduler")):
        target = ModelConfig.from_server_args(record)
        aux = resolve_spec_aux_hidden_state_config(
            server_args=record,
            model_config=target,
            spec_algorithm=SpeculativeAlgorithm.from_string("DFLASH"),
            is_draft_worker=False,
        )
        draft = aux.draft_model_config
        # A plain MLA pool (not a hybrid linear-attention one) is what the Mooncake manager
        # calls is_mla_backend: a decode rank then pulls from one prefill rank only.
        mla = target.attention_arch == AttentionArch.MLA and mambaish_config(target) is None
        rep["target"] = dict(architectures=list(target.hf_config.architectures or []),
                             num_layers=int(target.num_hidden_layers), mla_pool=mla)  # fmt: skip
        rep["draft"] = dict(
            architectures=list(draft.hf_config.architectures or []),
            num_layers=int(aux.dflash_draft_num_layers),
            hidden_size=int(draft.hf_config.hidden_size),
            kv_heads=int(draft.get_total_num_kv_heads()),
            head_dim=int(draft.head_dim),
            target_layer_ids=list(aux.dflash_target_layer_ids),
        )
        _stages(rep, resolved, target, draft)
        _draft_kv(rep, record, resolved, draft, inputs)


def _stages(rep: dict, resolved: dict, target, draft) -> None:
    """The partition, each stage's features and the carry on each hop. Under PP, also the
    checks every stage runs at startup (``DFlashPPStage.for_target``)."""
    from sglang.srt.distributed.utils import get_pp_indices
    from sglang.srt.model_loader.utils import get_model_architecture
    from sglang.srt.speculative.dflash_pp import (
        DFlashPPStage,
        check_pp_draft,
        check_pp_target,
        feature_stages,
    )

    pp, layers = int(resolved["pp_size"]), rep["target"]["num_layers"]
    ids, hidden = rep["draft"]["target_layer_ids"], rep["draft"]["hidden_size"]
    if pp > 1:
        model_cls, _ = get_model_architecture(target)
        rep["target"]["model_class"] = model_cls.__name__
        for source, check, arg in (
            ("target class (check_pp_target)", check_pp_target, model_cls.__new__(model_cls)),
            ("draft (check_pp_draft)", check_pp_draft, draft.hf_config),
        ):
            try:
                check(arg)
            except ValueError as e:
                _refuse(rep, source, e)
    try:
        built = [DFlashPPStage.build(ids, layers, r, pp) for r in range(pp)]
    except ValueError as e:
        _refuse(rep, "PP partition (DFlashPPStage.build)", e)
        built = None
    owners = feature_stages(ids, layers, pp)
    rep["partition_env"] = os.environ.get("SGLANG_PP_LAYER_PARTITION")
    rep["stages"], rep["carry"] = [], []
    raw_bytes = target.dtype.itemsize
    for r in range(pp):
        mine = list(built[r].features) if built else [j for j, s in enumerate(owners) if s == r]
        rep["stages"].append(dict(
            stage=r, layers=list(get_pp_indices(layers, r, pp)), features=mine,
            captured_layers=[ids[j] for j in mine], holds_draft=r == pp - 1,
            receives_partial=any(s < r for s in owners),
        ))  # fmt: skip
        if r < pp - 1:  # the hop r -> r + 1 carries what stages 0..r captured
            k = sum(s <= r for s in owners)
            rep["carry"].append(dict(hop=f"{r}->{r + 1}", partial_fp32=4 * hidden if k else 0,
                                     raw_captures=raw_bytes * hidden * k, captured_features=k))  # fmt: skip


def _draft_kv(rep: dict, record, resolved: dict, draft, inputs: CheckInputs) -> None:
    """Draft KV heads per rank on both sides, what one last-stage prefill rank writes to which
    decode ranks, one request's bytes and descriptors, and the decode's registration verdict."""
    from sglang.srt.arg_groups.model_override_base import resolved_view
    from sglang.srt.disaggregation.common.staging_buffer import compute_head_slice_params
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager
    from sglang.srt.environ import envs
    from sglang.srt.mem_cache.kv_cache_dtype import configure_kv_cache_dtype
    from sglang.srt.runtime_context import attn_tp_size_of

    _, dtype = configure_kv_cache_dtype(
        server_args_kv_cache_dtype=str(resolved.get("kv_cache_dtype") or "auto"),
        model=None, model_dtype=draft.dtype, is_draft_worker=True, is_dflash=True,
        speculative_draft_attention_backend=resolved.get("speculative_draft_attention_backend"),
        speculative_draft_kv_cache_dtype=resolved.get("speculative_draft_kv_cache_dtype"),
    )  # fmt: skip
    total, head_dim = rep["draft"]["kv_heads"], rep["draft"]["head_dim"]
    tp_p, tp_d, page = attn_tp_size_of(resolved_view(record)), inputs.decode_tp, int(resolved["page_size"])
    entries = 2 * rep["draft"]["num_layers"]  # a K and a V buffer per draft layer
    head_bytes = head_dim * dtype.itemsize

    def heads(tp: int, rank: int) -> List[int]:
        n = max(1, total // tp)
        first = rank * n if total >= tp else rank // (tp // total)
        return list(range(first, first + n))

    pages = -(-inputs.prompt_tokens // page)
    q = inputs.prefill_rank
    if not 0 <= q < tp_p:
        raise UsageError(f"--prefill-rank {q}: the prefill has attention TP {tp_p}")
    if tp_d >= tp_p:
        targets = range(q * (tp_d // tp_p), (q + 1) * (tp_d // tp_p)) if tp_d % tp_p == 0 else []
    else:
        targets = [q // (tp_p // tp_d)] if tp_p % tp_d == 0 else []
    writes = []
    for d in targets:
        src, n, _, _ = compute_head_slice_params(tp_p, tp_d, q, d, total)
        writes.append(dict(
            decode_rank=d, heads=heads(tp_p, q)[src : src + n],
            bytes=pages * page * entries * n * head_bytes,
            descriptors=pages * page * entries if tp_d != tp_p else entries,  # one page run
        ))  # fmt: skip
    item_len = lambda tp: page * max(1, total // tp) * head_bytes  # noqa: E731
    manager = SimpleNamespace(
        kv_args=SimpleNamespace(num_draft_entries=entries, draft_total_kv_head_num=total,
                                kv_item_lens=[item_len(tp_p)] * entries),
        attn_tp_size=tp_p, enable_staging=envs.SGLANG_DISAGG_STAGING_BUFFER.get(),
        is_mla_backend=rep["target"]["mla_pool"],
    )  # fmt: skip
    peer = SimpleNamespace(dst_attn_tp_size=tp_d, dst_tp_rank=0,
                           dst_kv_item_lens=[item_len(tp_d)] * entries)  # fmt: skip
    mismatch = MooncakeKVManager._draft_kv_layout_mismatch(manager, peer)
    if mismatch:
        _refuse(rep, "decode registration (MooncakeKVManager._draft_kv_layout_mismatch)", mismatch)
        writes = []
    rep["draft_kv"] = dict(
        dtype=str(dtype).replace("torch.", ""), dtype_bytes=dtype.itemsize, page_size=page,
        entries=entries, prefill_tp=tp_p, decode_tp=tp_d,
        prefill_heads=[heads(tp_p, r) for r in range(tp_p)],
        decode_heads=[heads(tp_d, r) for r in range(tp_d)],
        head_by_head=tp_p != tp_d, prompt_tokens=inputs.prompt_tokens, pages=pages,
        prefill_rank=q, writes=writes,
    )  # fmt: skip
