"""``sglang-dflash-pp check``: what a DFLASH P/D deployment would do, and whether it would start.

From the prefill's launch arguments (or the packaged Kimi-K3 example) and the decode TP size:

1. resolve the prefill's arguments with sglang 0.5.23's real ``ServerArgs`` and the plugin
   loaded, exactly as ``launch_server`` does (every startup refusal of sglang and of our argument
   gate surfaces here), and a decode server derived from them (same model, draft, page size and
   KV dtype; ``--tp-size`` = the decode TP; PP1);
2. the PP partition (sglang's ``get_pp_indices``) and which stage owns which context feature
   (``capture_ownership``), the carry bytes per token per hop (``tools.carry_table``, carry dtype
   from ``SGLANG_DFLASH_PP_CARRY_DTYPE``);
3. the draft-KV geometry on both sides, the writer map, and one request's bytes and descriptors
   per rank (``tools.draft_kv_report``, i.e. the plugin's registration verdict and descriptor
   builders);
4. every startup assertion computable from the configs and both servers' arguments that fires
   after resolution, while a server builds its draft, pool or transfer registrations
   (``tools.startup_assertions``: draft heads vs each side's draft TP, target heads, draft layer
   types and window, page size, draft pool class, carry dtype, the PP-path env switches);
5. every refusal, with its message. The exit code is non-zero when anything would be refused.

Numbers come from those modules; this file only gathers inputs and collects outcomes.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, List, Optional

from sglang_dflash_pp.tools import examples
from sglang_dflash_pp.tools.resolve import (
    ConfigDirs,
    Resolution,
    load_plugin,
    prepare_argv,
    quiet_sglang,
    resolve,
)

LAUNCH_PREFIX = ("-m", "sglang.launch_server")


@dataclass
class CheckInputs:
    prefill_argv: List[str]
    decode_tp: int
    prompt_tokens: int
    label: str
    carry_dtype: Optional[str] = None  # None: SGLANG_DFLASH_PP_CARRY_DTYPE, as the server reads it
    # Appended to the derived decode arguments (e.g. ["--attn-dp-size", "4"]).
    decode_extra_argv: List[str] = field(default_factory=list)


@dataclass
class Refusals:
    items: List[dict] = field(default_factory=list)

    def add(self, source: str, message: str) -> None:
        message = str(message).strip()
        if any(message in r["message"] for r in self.items):
            return  # the same refusal already reported (e.g. by the gate during resolution)
        self.items.append(dict(source=source, message=message))


def strip_launch_prefix(argv: List[str]) -> List[str]:
    """Accept ``python -m sglang.launch_server ARGS`` as pasted from a launch script."""
    argv = list(argv)
    for i in range(min(len(argv), 2)):
        if tuple(argv[i : i + 2]) == LAUNCH_PREFIX:
            return argv[i + 2 :]
    return argv


def run_check(inputs: CheckInputs, *, verbose: bool = False) -> dict:
    """The full report as plain data (``accepted`` says whether startup would succeed)."""
    dirs = ConfigDirs()
    try:
        with quiet_sglang(verbose):
            load_plugin()
            return _check(inputs, dirs)
    finally:
        dirs.cleanup()


def _check(inputs: CheckInputs, dirs: ConfigDirs) -> dict:
    refusals = Refusals()
    argv = prepare_argv(inputs.prefill_argv, dirs)
    p = resolve(argv)
    out: dict = dict(
        label=inputs.label,
        prefill=_side(p),
        decode=dict(tp_size=inputs.decode_tp),
        notes=[],
    )
    if not p.ok:
        refusals.add("prefill startup (sglang ServerArgs resolution, plugin loaded)", p.error)
        out["notes"].append(
            "sglang's resolution stops at its first refusal: fix it and run check again to see "
            "any later one; the rest of this report is planned from the raw arguments"
        )
    if p.server_args is None:
        return _finish(out, refusals)
    if str(p.value("speculative_algorithm") or "").upper() != "DFLASH" or not p.value(
        "speculative_draft_model_path"
    ):
        refusals.add(
            "check",
            "check plans DFLASH deployments: pass --speculative-algorithm DFLASH and "
            "--speculative-draft-model-path with the prefill arguments.",
        )
        return _finish(out, refusals)
    try:
        models = _load_models(p)
    except Exception as e:
        refusals.add("model configs", f"{type(e).__name__}: {e}")
        return _finish(out, refusals)
    out["target"], out["draft"] = models.target_summary, models.draft_summary

    ownership = _partition(p, models, out, refusals)
    if ownership is not None:
        _carry(inputs, ownership, models, out, refusals)

    page_size = p.value("page_size")
    if page_size is None:
        page_size = 1
        out["notes"].append("page size not resolved (startup refused); assumed 1")
    d = resolve(_decode_argv(p, inputs.decode_tp, page_size) + list(inputs.decode_extra_argv))
    out["decode"] = dict(_side(d), tp_size=inputs.decode_tp)
    if not d.ok:
        refusals.add("decode startup (derived decode arguments, plugin loaded)", d.error)
    _startup_assertions(p, d, models, int(page_size), out, refusals)
    _draft_kv(inputs, p, d, models, int(page_size), out, refusals)
    out["kv_checksum"] = _kv_checksum(p, inputs.decode_tp)
    _last_stage_draft_weights(p, ownership, models, out)
    out["notes"] += _platform_notes(p)
    return _finish(out, refusals)


def _finish(out: dict, refusals: Refusals) -> dict:
    from sglang_dflash_pp.srt.models.capture_ownership import PP_CAPTURE_TARGETS

    out["accepted_target_classes"] = {
        arch: convention.name for arch, convention in sorted(PP_CAPTURE_TARGETS.items())
    }
    out["refusals"] = refusals.items
    out["accepted"] = not refusals.items
    return out


RESOLVED_FIELDS = (
    "tp_size", "pp_size", "ep_size", "page_size", "kv_cache_dtype", "dtype", "attention_backend",
    "speculative_algorithm", "speculative_num_draft_tokens", "speculative_draft_attention_backend",
    "disaggregation_mode", "disaggregation_transfer_backend", "chunked_prefill_size",
    "mamba_radix_cache_strategy", "model_path", "speculative_draft_model_path",
)  # fmt: skip


def _side(r: Resolution) -> dict:
    side = dict(argv=r.argv, resolved=r.ok, error=r.error)
    if r.server_args is not None:
        side["values"] = {k: r.value(k) for k in RESOLVED_FIELDS}
    return side


def _decode_argv(p: Resolution, decode_tp: int, page_size: int) -> List[str]:
    """A stock DFLASH decode server for the same model and draft: what must agree with the
    prefill for the handoff (page size, KV dtype, draft) is copied from it."""
    argv = [
        "--model-path", p.value("model_path"),
        "--speculative-algorithm", "DFLASH",
        "--speculative-draft-model-path", p.value("speculative_draft_model_path"),
        "--tp-size", str(decode_tp),
        "--disaggregation-mode", "decode",
        "--disaggregation-transfer-backend", "mooncake",
        "--page-size", str(page_size),
        "--kv-cache-dtype", str(p.value("kv_cache_dtype", "auto")),
        "--device", str(p.value("device", "cuda")),
    ]  # fmt: skip
    if p.value("trust_remote_code"):
        argv.append("--trust-remote-code")
    if p.value("disaggregation_enable_kv_checksum"):
        argv.append("--disaggregation-enable-kv-checksum")  # both sides, or aux buffers differ
    return argv


@dataclass
class _Models:
    target_hf: Any
    draft_hf: Any
    num_layers: int
    target_layer_ids: List[int]
    hidden: int
    target_dtype_bytes: int
    draft_layers: int
    draft_model_config: Any
    target_is_mla: bool  # MLA or hybrid-MLA target: sglang sends its KV as whole pages

    @property
    def target_summary(self) -> dict:
        return dict(
            architectures=list(getattr(self.target_hf, "architectures", None) or []),
            num_layers=self.num_layers,
            dtype_bytes=self.target_dtype_bytes,
        )

    @property
    def draft_summary(self) -> dict:
        mc = self.draft_model_config
        return dict(
            architectures=list(getattr(self.draft_hf, "architectures", None) or []),
            num_layers=self.draft_layers,
            hidden_size=self.hidden,
            query_heads=int(self.draft_hf.num_attention_heads),
            intermediate_size=int(getattr(self.draft_hf, "intermediate_size", 0) or 0),
            kv_heads=int(mc.get_total_num_kv_heads()),
            head_dim=int(mc.head_dim),
            v_head_dim=int(getattr(mc, "v_head_dim", None) or mc.head_dim),
            target_layer_ids=self.target_layer_ids,
        )


def _load_models(p: Resolution) -> _Models:
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config
    from sglang.srt.utils.hf_transformers.config import get_config

    from sglang_dflash_pp.srt.arg_groups.dflash_pp_gate import target_capture_layout

    trust = bool(p.value("trust_remote_code", False))
    overrides = p.value("json_model_override_args", "{}")
    target_path, draft_path = p.value("model_path"), p.value("speculative_draft_model_path")
    draft_rev = p.value("speculative_draft_model_revision")
    target_hf = get_config(target_path, trust, p.value("revision"), json.loads(overrides))
    draft_hf = get_config(draft_path, trust, draft_rev, json.loads(overrides))
    num_layers, ids = target_capture_layout(target_hf, draft_hf)
    dtype = str(p.value("dtype", "auto"))
    target_mc = ModelConfig(
        target_path, trust, p.value("revision"), model_override_args=overrides, dtype=dtype
    )
    draft_mc = ModelConfig(draft_path, trust, draft_rev, dtype=dtype, is_draft_model=True)
    return _Models(
        target_hf=target_hf,
        draft_hf=draft_hf,
        num_layers=num_layers,
        target_layer_ids=ids,
        hidden=int(draft_hf.hidden_size),
        target_dtype_bytes=target_mc.dtype.itemsize,
        draft_layers=parse_dflash_draft_config(draft_hf_config=draft_hf).require_num_layers(),
        draft_model_config=draft_mc,
        target_is_mla=target_mc.attention_arch.name == "MLA",
    )


def _partition(p: Resolution, models: _Models, out: dict, refusals: Refusals):
    from sglang.srt.distributed.utils import get_pp_indices

    from sglang_dflash_pp.srt.arg_groups.dflash_pp_gate import target_class_refusal
    from sglang_dflash_pp.srt.models.capture_ownership import (
        capture_convention,
        compute_feature_ownership,
    )

    pp = int(p.value("pp_size", 1))
    architectures = list(getattr(models.target_hf, "architectures", None) or [])
    convention = capture_convention(architectures)
    if convention is None:
        refusals.add(
            "target class (capture_ownership.PP_CAPTURE_TARGETS)",
            target_class_refusal(architectures, p.value("model_path"), pp),
        )
        return None
    try:
        stage_layers = [get_pp_indices(models.num_layers, r, pp) for r in range(pp)]
    except ValueError as e:
        refusals.add("PP partition (SGLANG_PP_LAYER_PARTITION)", str(e))
        return None
    out["partition"] = dict(
        stage_layers=[list(s) for s in stage_layers],
        layers_per_stage=[b - a for a, b in stage_layers],
        env=os.environ.get("SGLANG_PP_LAYER_PARTITION"),
    )
    try:
        ownership = compute_feature_ownership(
            stage_layers, models.target_layer_ids, models.num_layers, convention
        )
        out["capture_convention"] = dict(
            target_class=next(a for a in architectures if capture_convention([a])),
            rule=convention.name,
        )
    except ValueError as e:
        refusals.add("feature ownership (capture_ownership)", f"DFLASH with --pp-size {pp}: {e}")
        return None
    out["stages"] = ownership.stage_rows()
    return ownership


def _carry(inputs: CheckInputs, ownership, models: _Models, out: dict, refusals: Refusals) -> None:
    from sglang_dflash_pp.srt.models.context_partial import (
        CARRY_DTYPE_ENV,
        CARRY_DTYPES,
        carry_dtype_from_env,
    )
    from sglang_dflash_pp.tools.carry_table import carry_table_for_ownership, partial_key

    try:
        dtype = CARRY_DTYPES[inputs.carry_dtype] if inputs.carry_dtype else carry_dtype_from_env()
    except ValueError as e:
        refusals.add("carry dtype (context_partial)", str(e))
        return
    name = next(n for n, d in CARRY_DTYPES.items() if d == dtype)
    table = carry_table_for_ownership(ownership, models.hidden, models.target_dtype_bytes)
    key = partial_key(name)
    hops = [
        dict(
            hop=r["hop"],
            partial_bytes_per_token=r[key],
            concat_bytes_per_token=r["concat_bytes_per_token"],
        )
        for r in table["stages"]
        if r["hop"]
    ]
    out["carry"] = dict(
        dtype=name,
        dtype_source=(
            "--carry-dtype"
            if inputs.carry_dtype
            else f"{CARRY_DTYPE_ENV}={os.environ.get(CARRY_DTYPE_ENV, '(unset: float32)')}"
        ),
        hidden=models.hidden,
        hops=hops,
        partial_bytes_per_token_per_hop=table["worst_hop"][key],
        concat_bytes_per_token_max=table["worst_hop"]["concat_bytes_per_token"],
        partial_bytes_per_token_all_hops=table["total_over_hops"][key],
        concat_bytes_per_token_all_hops=table["total_over_hops"]["concat_bytes_per_token"],
        table=table,
    )


def _startup_assertions(p, d, models: _Models, page_size: int, out: dict, refusals) -> None:
    from sglang_dflash_pp.tools.startup_assertions import evaluate

    try:
        rows = evaluate(
            p,
            d,
            target_hf=models.target_hf,
            draft_hf=models.draft_hf,
            draft_layers=models.draft_layers,
            target_is_mla=models.target_is_mla,
            page_size=page_size,
            carry=out.get("carry"),
        )
    except Exception as e:  # a config the rules cannot read: say so, plan the rest
        out["notes"].append(f"startup assertions not evaluated: {type(e).__name__}: {e}")
        return
    out["startup_assertions"] = rows.rows
    for row in rows.refusals:
        refusals.add(f"{row['side']} startup: {row['check']} ({row['source']})", row["refusal"])


def _draft_kv(inputs, p: Resolution, d: Resolution, models: _Models, page_size: int, out: dict,
              refusals) -> None:  # fmt: skip
    from sglang.srt.environ import envs

    from sglang_dflash_pp.srt.disaggregation import mooncake_draft_kv
    from sglang_dflash_pp.srt.disaggregation.draft_kv_staging import (
        PACK_BUFFER_MB_ENV,
        staging_size,
    )
    from sglang_dflash_pp.srt.disaggregation.draft_kv_geometry import (
        DraftKVLayoutError,
        DraftKVShape,
    )
    from sglang_dflash_pp.tools.draft_kv_report import DraftKVTopology, report
    from sglang_dflash_pp.tools.startup_assertions import side_parallel

    try:
        mooncake_draft_kv.check_environment()
        num_slots = max(1, int(envs.SGLANG_DISAGGREGATION_QUEUE_SIZE.get()))
        max_batch_pages = int(envs.SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES.get())
    except ValueError as e:
        refusals.add("draft KV transfer environment (mooncake_draft_kv)", str(e))
        return
    try:
        kv_dtype = _draft_kv_dtype(p, models)
        mc = models.draft_model_config
        shape = DraftKVShape(
            total_heads=int(mc.get_total_num_kv_heads()),
            k_head_dim=int(mc.head_dim),
            v_head_dim=int(getattr(mc, "v_head_dim", None) or mc.head_dim),
            dtype_bytes=int(kv_dtype.itemsize),
        )
        topo = DraftKVTopology(
            shape=shape,
            num_layers=models.draft_layers,
            page_size=page_size,
            prefill_tp=side_parallel(p).draft_tp.size,
            decode_tp=side_parallel(d).draft_tp.size,
            pp_size=int(p.value("pp_size", 1)),
        )
        staging = staging_size(
            topo.geometry("prefill", 0),
            2 * topo.num_layers,
            chunk_tokens=transfer_chunk_tokens(p),
            num_slots=num_slots,
        )
        slot = staging.slot_bytes
        rep = report(
            topo, inputs.prompt_tokens, pack_slot_bytes=slot, max_batch_pages=max_batch_pages
        )
    except DraftKVLayoutError as e:
        refusals.add("draft KV transfer (the plugin's registration verdict)", str(e))
        return
    except ValueError as e:  # e.g. an unsupported --kv-cache-dtype
        refusals.add("draft KV pool", str(e))
        return
    rep["dtype"] = str(kv_dtype).replace("torch.", "")
    if topo.geometry("prefill", 0).heads_per_rank > 1:  # a rank holding one head never packs
        rep["pack_staging"] = dict(
            bytes_per_gpu=staging.total_bytes,
            slots=staging.num_slots,
            slot_bytes=staging.slot_bytes,
            chunk_tokens=staging.chunk_tokens,
            chunk_slot_bytes=staging.chunk_slot_bytes,
        )
    for w in (w for pr in rep["prefill_ranks"] for w in pr["writes"]):
        if w["regime"] == "pack on prefill, then page runs":
            per_page = w["bytes"] // rep["pages"]
            if slot < per_page:
                refusals.add(
                    "draft KV pack buffer (mooncake_draft_kv)",
                    f"a draft KV pack slot holds {slot} B, less than one page of a decode rank's "
                    f"draft heads ({per_page} B); raise or unset {PACK_BUFFER_MB_ENV}.",
                )
                break
    out["draft_kv"] = rep


def _kv_checksum(p: Resolution, decode_tp: int) -> dict:
    """Whether this deployment's transfers will be verified (``kv_digest_send`` /
    ``kv_digest_verify``), and how."""
    from sglang.srt.environ import envs

    pp, tp = int(p.value("pp_size", 1)), int(p.value("tp_size", 1))
    stock_skips = pp > 1 or tp != decode_tp
    rep = dict(enabled=bool(p.value("disaggregation_enable_kv_checksum")), prefill_ranks=pp * tp,
               decode_tp=decode_tp, stock_would_skip=stock_skips)  # fmt: skip
    if rep["enabled"] and envs.SGLANG_DISAGG_STAGING_BUFFER.get() and tp != decode_tp:
        rep["refused"] = (
            "SGLANG_DISAGG_STAGING_BUFFER at another attention TP: the digest does not see the "
            "staging copy, so registration refuses the decode while the checksum is on"
        )
    return rep


def transfer_chunk_tokens(p: Resolution) -> int:
    """The most tokens one prefill step (so one transfer chunk) covers: the ceiling sglang 0.5.23
    sizes its prefill buffers by (``runtime_context.max_prefill_buffer_tokens``: the chunked
    prefill size, grown toward ``max_prefill_tokens`` by PP dynamic chunking), evaluated on the
    resolved arguments; ``max_prefill_tokens`` without chunked prefill."""
    chunked = int(p.value("chunked_prefill_size", 0) or 0)
    chunked = chunked if chunked > 0 else 0
    max_prefill = int(p.value("max_prefill_tokens", 0) or 0)
    if chunked and p.value("enable_dynamic_chunking", False) and int(p.value("pp_size", 1)) > 1:
        return max(chunked, max_prefill, -(-chunked * 5 // 4))
    return chunked or max_prefill


def _last_stage_draft_weights(p: Resolution, ownership, models: _Models, out: dict) -> None:
    """Draft weight bytes per GPU on the last P stage: the stock draft vs the KV-write-only draft
    that stage builds (``kv_write_draft``; figures from ``draft_weight_bytes``)."""
    from sglang_dflash_pp.srt.models.draft_weight_bytes import last_stage_draft_weight_bytes
    from sglang_dflash_pp.tools.startup_assertions import side_parallel

    if ownership is None or int(p.value("pp_size", 1)) < 2:
        return
    draft_tp = side_parallel(p).draft_tp.size
    last = ownership.stages[-1].features
    figures = last_stage_draft_weight_bytes(
        models.draft_hf,
        tp_size=draft_tp,
        num_features=ownership.num_features,
        last_stage_features=len(last),
        dtype=str(models.draft_model_config.dtype),
    )
    out["last_stage_draft_weights"] = dict(
        draft_tp=draft_tp,
        fc_features=list(last),
        stock_bytes=figures.stock,
        kv_write_only_bytes=figures.kv_write_only,
        saved_bytes=figures.saved,
    )


def _draft_kv_dtype(p: Resolution, models: _Models):
    """The draft pool's element type, as the draft worker configures it."""
    from sglang.srt.mem_cache.kv_cache_dtype import configure_kv_cache_dtype

    _, dtype = configure_kv_cache_dtype(
        server_args_kv_cache_dtype=str(p.value("kv_cache_dtype", "auto")),
        model=None,
        model_dtype=models.draft_model_config.dtype,
        is_draft_worker=True,
        is_dflash=True,
        speculative_draft_attention_backend=p.value("speculative_draft_attention_backend"),
        speculative_draft_kv_cache_dtype=p.value("speculative_draft_kv_cache_dtype"),
    )
    return dtype


def _platform_notes(p: Resolution) -> List[str]:
    from sglang.srt.runtime_context import get_platform

    if get_platform().is_cuda or p.value("device") != "cuda":
        return []
    note = (
        "resolved for --device cuda on a machine without a GPU: the attention backend shown is "
        "this platform's choice, not the GPU's"
    )
    if "--page-size" not in p.argv:
        note += " (and so is the default page size; pin --page-size to plan the GPU's)"
    return [note]


def example_inputs(
    name: str, *, page_size=None, decode_tp=None, prompt_tokens=None, device=None
) -> CheckInputs:
    ex = examples.load(name)
    argv = ex.prefill_argv(page_size=page_size)
    if device:
        argv += ["--device", device]
    return CheckInputs(
        prefill_argv=argv,
        decode_tp=int(decode_tp or ex.decode_tp_size),
        prompt_tokens=int(prompt_tokens or ex.prompt_tokens),
        label=f"example {name} ({ex.description})",
    )
