"""What one prefill rank of each PP stage sends per request (``check --prompt-tokens``), and
how long that takes on the link (``--link-gbps``): the stage that sends most sets the
request's transfer time.

Per stage, for the prefill rank ``check`` shows (``--prefill-rank``), to the decode ranks it
writes (the mapping of ``CommonKVReceiver._resolve_rank_mapping``):

- target: the KV of the stage's attention layers, all prompt positions in whole pages. An MLA
  latent goes whole to each decode rank it writes (a plain MLA pool at a smaller decode TP:
  from one prefill rank of each group, the others send none); MHA heads by
  ``compute_head_slice_params``.
- state: a hybrid linear-attention target's recurrent state of the stage's linear layers
  (``mamba2_cache_params`` at the prefill's attention TP), once per request.
- draft: the last stage's DFLASH draft KV, the writes ``check`` lists under "Draft KV".
"""

from __future__ import annotations

from typing import Optional


def stage_transfer(rep: dict, target, draft, kv_dtype, link_gbps: float) -> None:
    from sglang.srt.configs.hybrid_arch import mambaish_config
    from sglang.srt.configs.model_config import AttentionArch
    from sglang.srt.disaggregation.common.staging_buffer import compute_head_slice_params
    from sglang.srt.speculative.dflash_utils import (
        get_dflash_attention_sliding_window_size, get_dflash_layer_types)

    k = rep["draft_kv"]
    tp_p, tp_d, q, page = k["prefill_tp"], k["decode_tp"], k["prefill_rank"], k["page_size"]
    tokens, targets = k["pages"] * page, k["decode_ranks"]  # the D ranks P rank q writes
    hybrid = mambaish_config(target)
    state_layers, state_bytes_per_layer = [], 0
    if hybrid:
        params = hybrid.mamba2_cache_params
        state_layers = list(params.layers)
        state_bytes_per_layer = params.mamba_cache_per_req // len(state_layers)
    if target.attention_arch == AttentionArch.MLA:
        latent = (target.kv_lora_rank + target.qk_rope_head_dim) * kv_dtype.itemsize
        silent = rep["target"]["mla_pool"] and tp_d < tp_p and q % (tp_p // tp_d)
        per_layer = 0 if silent else latent * len(targets)
    else:
        total = target.get_total_num_kv_heads()
        heads = sum(compute_head_slice_params(tp_p, tp_d, q, d, total)[1] for d in targets)
        per_layer = 2 * heads * target.head_dim * kv_dtype.itemsize
    types = get_dflash_layer_types(draft.hf_config) or ()
    window = None if "full_attention" in types else (
        get_dflash_attention_sliding_window_size(draft.hf_config))
    draft_bytes = sum(w["bytes"] for w in k["writes"])
    stages = []
    for s in rep["stages"]:
        first, end = s["layers"]
        linear = sum(first <= i < end for i in state_layers)
        row = dict(
            stage=s["stage"],
            target_bytes=tokens * per_layer * (end - first - linear),
            state_bytes=state_bytes_per_layer * linear,
            draft_bytes=draft_bytes if s["holds_draft"] else 0,
        )
        row["total_bytes"] = row["target_bytes"] + row["state_bytes"] + row["draft_bytes"]
        row["link_ms"] = row["total_bytes"] / (link_gbps * 1e9) * 1e3
        stages.append(row)
    slowest = max(stages, key=lambda r: r["total_bytes"])
    rep["transfer"] = dict(
        prompt_tokens=k["prompt_tokens"], link_gbps=link_gbps, prefill_rank=q,
        decode_ranks=targets, stages=stages, slowest_stage=slowest["stage"],
        draft_window=_window(window, k, draft_bytes),
    )


def _window(window_left: Optional[int], k: dict, draft_bytes: int) -> Optional[dict]:
    """A sliding-window draft (every draft layer ``sliding_attention``): no query of the
    decode's draft sits before the prompt's last position L - 1, so none reads a position
    before L - 1 - window_left (sglang stores window_left = window - 1); the pages holding
    the positions it can read."""
    if window_left is None:
        return None
    page, length = k["page_size"], k["prompt_tokens"]
    pages = (length - 1) // page - max(0, length - 1 - window_left) // page + 1
    return dict(window=window_left + 1, pages=pages,
                draft_bytes_in_window=draft_bytes * pages // k["pages"])
