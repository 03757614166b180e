"""The startup assertions ``check`` can compute from the configs and both servers' arguments.

Argument resolution (``tools.resolve``) surfaces every refusal raised while ``ServerArgs``
resolve; the ones below fire later, while a server builds its draft, its KV pool or its transfer
registrations, so resolving alone misses them (a 56-head draft resolved for a TP32 decode that
then died in ``DFlashAttention.__init__``). Each row names the stock assertion (sglang 0.5.23
file:line) or the plugin refusal it mirrors; the rules themselves live with their owners
(``attention_tp_rules``, ``draft_config_checks``, ``draft_kv_pool_kind``, the gate), this module
only reads their inputs off the resolved arguments and configs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, List, Optional

from sglang_dflash_pp.srt.disaggregation.draft_kv_geometry import DraftKVLayoutError
from sglang_dflash_pp.srt.disaggregation.draft_kv_peer import target_path
from sglang_dflash_pp.srt.disaggregation.draft_kv_pool_kind import (
    draft_pool_kind,
    pool_transfer_refusal,
)
from sglang_dflash_pp.srt.speculative.attention_tp_rules import (
    TARGET_HEAD_ASSERTIONS,
    DraftAttentionTP,
    DraftModelShape,
    draft_attention_tp,
    draft_tp_refusal,
    target_tp_refusal,
)
from sglang_dflash_pp.srt.speculative.draft_config_checks import draft_layer_types_refusal
from sglang_dflash_pp.tools.resolve import Resolution

SIDES = {"P": "prefill", "D": "decode"}


@dataclass
class SideParallel:
    """One server's parallel widths, as sglang derives them (``parallel_widths_of``)."""

    tp: int
    attn_tp: int
    attn_dp: int
    attn_cp: int

    @property
    def draft_tp(self) -> DraftAttentionTP:
        return draft_attention_tp(
            tp_size=self.tp,
            attn_tp_size=self.attn_tp,
            attn_dp_size=self.attn_dp,
            attn_cp_size=self.attn_cp,
        )

    @property
    def flag(self) -> str:
        dp = f" --attn-dp-size {self.attn_dp}" if self.attn_dp > 1 else ""
        cp = f" --attn-cp-size {self.attn_cp}" if self.attn_cp > 1 else ""
        return f"--tp-size {self.tp}{dp}{cp}"


def side_parallel(r: Resolution) -> SideParallel:
    """Widths of a resolved server (from the raw arguments when resolution was refused)."""
    tp = int(r.value("tp_size", 1))
    if not r.ok:
        dp, cp = int(r.value("attn_dp_size", 1)), int(r.value("attn_cp_size", 1))
        return SideParallel(tp, max(1, tp // (dp * cp)), dp, cp)
    from sglang.srt.arg_groups.overrides import resolved_view
    from sglang.srt.runtime_context import parallel_widths_of

    view = resolved_view(r.server_args)
    widths = parallel_widths_of(view)
    return SideParallel(
        tp=int(view.tp_size),
        attn_tp=int(widths["attn_tp_size"]),
        attn_dp=int(widths["attn_dp_size"]),
        attn_cp=int(view.attn_cp_size),
    )


@dataclass
class Assertions:
    rows: List[dict] = field(default_factory=list)

    def add(self, side: str, check: str, value: str, source: str, refusal: Optional[str] = None,
            *, unknown: bool = False) -> None:  # fmt: skip
        """``ok`` is False with a refusal, None when only startup can tell, True otherwise."""
        ok = False if refusal else (None if unknown else True)
        self.rows.append(
            dict(side=side, check=check, value=value, ok=ok, source=source, refusal=refusal)
        )

    @property
    def refusals(self) -> List[dict]:
        return [r for r in self.rows if r["refusal"]]


def _config_file(path: str) -> str:
    return path if os.path.isfile(path) else os.path.join(path, "config.json")


def evaluate(
    p: Resolution,
    d: Resolution,
    *,
    target_hf: Any,
    draft_hf: Any,
    draft_layers: int,
    target_is_mla: bool,
    page_size: int,
    carry: Optional[dict],
) -> Assertions:
    """Every assertion below, for the prefill ``p`` and the decode ``d``."""
    from sglang.srt.utils.hf_transformers.common import get_hf_text_config

    out = Assertions()
    sides = {"P": side_parallel(p), "D": side_parallel(d)}
    draft_path = str(p.value("speculative_draft_model_path"))
    draft_cfg = _config_file(draft_path)
    shape = DraftModelShape(
        num_heads=int(draft_hf.num_attention_heads),
        # DFlashAttention: getattr(config, "num_key_value_heads", total_num_heads)
        num_kv_heads=int(
            getattr(draft_hf, "num_key_value_heads", None) or draft_hf.num_attention_heads
        ),
        intermediate_size=int(getattr(draft_hf, "intermediate_size", 0) or 0),
    )
    for tag, sp in sides.items():
        dtp = sp.draft_tp
        out.add(
            tag,
            "draft TP layout",
            f"the draft runs at TP {dtp.size}: {dtp.group} ({sp.flag})",
            "speculative/dflash_worker_v2.py:420-427, speculative/draft_parallel.py:53-68",
        )
        out.add(
            tag,
            "draft heads vs draft TP",
            f"{shape.num_heads} query / {shape.num_kv_heads} KV heads, intermediate "
            f"{shape.intermediate_size:,} over TP {dtp.size}",
            "models/dflash.py:215-229 (DFlashAttention), layers/linear.py:693 (DFlashMLP)",
            draft_tp_refusal(
                shape, dtp, side=SIDES[tag], draft_config=draft_cfg, tp_flag=sp.flag
            ),
        )
    _target_heads(out, sides, target_hf, get_hf_text_config(target_hf), target_is_mla)
    _draft_layers(out, p, draft_hf, draft_layers, draft_path, page_size)
    _draft_pool(out, p, sides)
    _carry_row(out, carry, int(p.value("pp_size", 1)))
    _env_switches(out, p, sides, target_is_mla)
    return out


def _target_heads(out: Assertions, sides, target_hf, text, target_is_mla: bool) -> None:
    architectures = list(getattr(target_hf, "architectures", None) or [])
    arch = next((a for a in architectures if a in TARGET_HEAD_ASSERTIONS), None)
    heads = int(getattr(text, "num_attention_heads", 0) or 0)
    kv = None if target_is_mla else int(getattr(text, "num_key_value_heads", heads) or heads)
    linear = (getattr(text, "linear_attn_config", None) or {}).get("num_heads")
    described = f"{heads} query" + (f" / {kv} KV" if kv is not None else " (MLA)") + " heads"
    if linear is not None:
        described += f", {linear} KDA heads"
    for tag, sp in sides.items():
        if arch is None:
            out.add(
                tag,
                "target heads vs attention TP",
                f"{architectures}: not modelled here (its layers shard their own attention)",
                "-",
                unknown=True,
            )
            continue
        out.add(
            tag,
            "target heads vs attention TP",
            f"{described} over attention TP {sp.attn_tp} (TP {sp.tp})",
            TARGET_HEAD_ASSERTIONS[arch][1],
            target_tp_refusal(
                architectures, heads, kv, tp_size=sp.tp, attn_tp_size=sp.attn_tp,
                side=SIDES[tag], tp_flag=sp.flag, linear_heads=linear,
            ),  # fmt: skip
        )


def _draft_layers(out: Assertions, p: Resolution, draft_hf, layers: int, where: str, page: int):
    from sglang.srt.speculative.dflash_utils import get_dflash_layer_types

    types = get_dflash_layer_types(draft_hf)
    window = getattr(draft_hf, "sliding_window", None)
    refusal = draft_layer_types_refusal(types, window, layers, where=where)
    kinds = sorted(set(types[:layers])) if types else ["full_attention (no layer_types)"]
    sliding = types is not None and "sliding_attention" in types
    value = f"{layers} layers: {', '.join(kinds)}"
    if sliding and window is not None:
        value += f", sliding window {int(window):,} tokens (window_left {int(window) - 1:,})"
    out.add(
        "P+D",
        "draft layer types and window",
        value,
        "models/dflash.py:166-190, speculative/dflash_utils.py:400-417",
        refusal,
    )
    compact = p.value("speculative_draft_window_size")
    block = p.value("speculative_num_draft_tokens")
    out.add(
        "P+D",
        "draft window and page size",
        (
            f"--speculative-draft-window-size {compact} (compact draft cache, >= block size "
            f"{block}; its visible start rounds down to a page, up to {page - 1} extra tokens), "
            f"page size {page} on both sides"
            if compact
            else f"no --speculative-draft-window-size (full draft cache), page size {page} on "
            "both sides (the draft KV item lengths must agree page for page)"
        ),
        # No stock assertion ties the window to the page size: the compact cache aligns its
        # start (speculative/dflash_worker_v2.py:1209-1225); window >= block size is checked at
        # resolution (arg_groups/speculative_hook.py:427-434); the transfer compares item lengths.
        "arg_groups/speculative_hook.py:427-434, speculative/dflash_worker_v2.py:1209-1225; "
        "plugin: draft_kv_geometry item lengths",
    )


def _draft_pool(out: Assertions, p: Resolution, sides) -> None:
    from sglang.srt.environ import envs

    draft_dtype = p.value("speculative_draft_kv_cache_dtype") or p.value("kv_cache_dtype", "auto")
    kind = draft_pool_kind(
        draft_kv_cache_dtype=str(draft_dtype),
        enable_unified_memory=bool(p.value("enable_unified_memory", False)),
        prefill_only_disable_kv_cache=bool(p.value("prefill_only_disable_kv_cache", False)),
        enable_page_major_kv_layout=bool(p.value("enable_page_major_kv_layout", False)),
        enable_kv_cache_sharding=bool(p.value("enable_kv_cache_sharding", False)),
        use_hnd_kv_cache=bool(envs.SGLANG_USE_HND_KVCACHE.get()),
    )
    p_tp, d_tp = sides["P"].draft_tp.size, sides["D"].draft_tp.size
    verdict = {
        True: "the head-aware transfer reads it",
        None: f"decided at startup ({kind.setting}); the transfer serves a pool it cannot "
        "read only at equal draft attention TP",
        False: f"not plain ({kind.setting}): served only at equal draft attention TP",
    }[kind.plain]
    out.add(
        "P",
        "draft KV pool class",
        f"{kind.name}; {verdict} (P draft TP {p_tp}, D draft TP {d_tp})",
        f"{kind.where}; plugin: draft_kv_source.describe_draft_pool, draft_kv_peer.peer_verdict",
        pool_transfer_refusal(kind, prefill_draft_tp=p_tp, decode_draft_tp=d_tp),
        unknown=kind.plain is None and p_tp != d_tp,
    )


def _carry_row(out: Assertions, carry: Optional[dict], pp: int) -> None:
    if pp <= 1:
        return
    value = (
        f"{carry['dtype']} ({carry['dtype_source']})"
        if carry
        else "not planned (see the refusals above it)"
    )
    out.add(
        "P",
        "carry dtype",
        value,
        "plugin: context_partial.carry_dtype_from_env, read by every PP stage's worker",
        unknown=not carry,
    )


def _env_switches(out: Assertions, p: Resolution, sides, target_is_mla: bool) -> None:
    from sglang.srt.environ import envs

    from sglang_dflash_pp.srt.arg_groups.dflash_pp_gate import pp_env_switch_refusal

    pp = int(p.value("pp_size", 1))
    names = ("SGLANG_ENABLE_PP_SPEC", "SGLANG_PP_SKIP_PURE_CHUNKED_OUTPUT_COMM")
    shown = ", ".join(f"{n}={os.environ.get(n, '(unset)')}" for n in names)
    if pp > 1:
        out.add(
            "P",
            "PP path env switches",
            f"{shown}; SGLANG_PP_LAYER_PARTITION="
            f"{os.environ.get('SGLANG_PP_LAYER_PARTITION', '(unset)')} (see the partition)",
            "plugin: dflash_pp_gate.pp_env_switch_refusal; managers/scheduler_pp_mixin.py:48-57",
            pp_env_switch_refusal(pp),
        )
    # Predicted from this process's environment, taken as both servers'.
    staging = bool(envs.SGLANG_DISAGG_STAGING_BUFFER.get())
    sliced = not target_is_mla and sides["P"].attn_tp != sides["D"].attn_tp
    refusal = None
    try:
        target_path(target_is_mla, sides["P"].attn_tp, sides["D"].attn_tp, staging)
    except DraftKVLayoutError as e:
        refusal = f"every request would fail at registration: {e}"
    out.add(
        "P+D",
        "staging buffer",
        f"SGLANG_DISAGG_STAGING_BUFFER={os.environ.get('SGLANG_DISAGG_STAGING_BUFFER', '(unset)')}"
        f"; target KV {'head-sliced' if sliced else 'whole pages'} between P and D",
        "plugin: draft_kv_registration.target_path_of; disaggregation/mooncake/conn.py:278",
        refusal,
    )
