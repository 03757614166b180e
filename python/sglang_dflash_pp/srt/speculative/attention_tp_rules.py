"""Which head and width counts a TP size must divide, as sglang 0.5.23's model constructors
assert them, and at which TP the DFlash draft runs on a server.

Why this exists: these assertions fire while the model is built, after ``ServerArgs`` resolution
has succeeded, so a check that only resolves arguments cannot see them. A 56-query-head draft
resolves fine for a TP32 decode, which then dies in ``DFlashAttention.__init__``. Each rule below
mirrors one stock assertion (cited by file:line of sglang 0.5.23) and, when it fails, says which
flag or config file to change. ``sglang-dflash-pp check`` evaluates them for both PD sides.

Pure: no sglang import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional


@dataclass(frozen=True)
class DraftAttentionTP:
    """The TP size the DFlash draft's attention and MLP are sharded over on one server."""

    size: int
    group: str  # which group, in words, for reports


def draft_attention_tp(
    *, tp_size: int, attn_tp_size: int, attn_dp_size: int, attn_cp_size: int
) -> DraftAttentionTP:
    """As ``DFlashWorkerV2.__init__`` places the draft (speculative/dflash_worker_v2.py:420-427):
    ``resolve_draft_parallel_layout(collapse_cp=True)`` (speculative/draft_parallel.py:53-68) runs
    a SINGLE_GROUP draft (``DFlashDraftModel.draft_parallel_spec``, models/dflash.py:680) in its
    own group only under attention DP or CP, namely ``draft_attn_parallel_group()``
    (runtime_context.py:489-498); otherwise the draft sees the target's TP group unchanged, and
    ``DFlashAttention`` reads ``get_parallel().tp_size`` (models/dflash.py:205)."""
    if attn_dp_size > 1:
        return DraftAttentionTP(
            int(attn_tp_size), f"its attention-TP group (attention DP {attn_dp_size})"
        )
    if attn_cp_size > 1:
        return DraftAttentionTP(int(tp_size), f"the whole TP group (attention CP {attn_cp_size})")
    return DraftAttentionTP(int(tp_size), "the target's TP group (no attention DP or CP)")


def heads_over_tp_problem(num_heads: int, num_kv_heads: int, tp: int) -> Optional[str]:
    """What the GQA constructors assert (``DFlashAttention`` models/dflash.py:215-229; the same
    in ``QKVParallelLinear`` layers/linear.py:1139-1144, ``Qwen3Attention`` models/qwen3.py:166-176,
    ``LlamaAttention`` models/llama.py:183-193): query heads divisible by TP; KV heads divisible
    by TP when at least TP, else TP divisible by them. None when all hold."""
    if num_heads % tp:
        return f"{num_heads} query heads are not divisible by TP {tp}"
    if num_kv_heads >= tp and num_kv_heads % tp:
        return f"{num_kv_heads} KV heads are not divisible by TP {tp}"
    if num_kv_heads < tp and tp % num_kv_heads:
        return f"TP {tp} is not divisible by {num_kv_heads} KV heads"
    return None


def width_over_tp_problem(name: str, width: int, tp: int) -> Optional[str]:
    """``MergedColumnParallelLinear`` asserts every output size divisible by TP
    (layers/linear.py:693) and ``RowParallelLinear`` divides its input size by TP."""
    if width % tp:
        return f"{name} {width} is not divisible by TP {tp}"
    return None


def working_tps(num_heads: int, num_kv_heads: int, widths: List[int], up_to: int) -> List[int]:
    """TP sizes up to ``up_to`` that satisfy every rule above, ascending."""
    return [
        t
        for t in range(1, up_to + 1)
        if heads_over_tp_problem(num_heads, num_kv_heads, t) is None
        and all(w % t == 0 for w in widths)
    ]


@dataclass(frozen=True)
class DraftModelShape:
    """What ``DFlashAttention`` and ``DFlashMLP`` read from the draft's config.json."""

    num_heads: int  # num_attention_heads
    num_kv_heads: int  # num_key_value_heads
    intermediate_size: int


def draft_tp_refusal(
    shape: DraftModelShape, tp: DraftAttentionTP, *, side: str, draft_config: str, tp_flag: str
) -> Optional[str]:
    """Why the draft cannot be built at ``tp`` on ``side`` (and what to change), or None.

    ``tp_flag`` names how that side set its draft TP (e.g. ``--tp-size 32``)."""
    problem = heads_over_tp_problem(shape.num_heads, shape.num_kv_heads, tp.size) or (
        width_over_tp_problem("intermediate_size", shape.intermediate_size, tp.size)
    )
    if problem is None:
        return None
    ok = working_tps(shape.num_heads, shape.num_kv_heads, [shape.intermediate_size], tp.size)
    best = ok[-1] if ok else 1
    dp_hint = ""
    if tp.size % best == 0 and best < tp.size:
        dp_hint = (
            f", or --attn-dp-size {tp.size // best} --enable-dp-lm-head so the draft runs at "
            f"attention TP {best}"
        )
    heads_needed = tp.size * -(-shape.num_heads // tp.size)
    return (
        f"the {side} server builds the DFlash draft at TP {tp.size} ({tp_flag}, {tp.group}), "
        f"and {problem}: stock DFlashAttention / DFlashMLP assert this while the model is "
        f"built (sglang/srt/models/dflash.py:215-229, layers/linear.py:693), so the {side} "
        f"server dies at startup. Use a draft whose num_attention_heads "
        f"(now {shape.num_heads}) is a multiple of {tp.size} (e.g. {heads_needed}) in "
        f"{draft_config}, or run the {side} server with a TP that divides the draft "
        f"(largest: {best}){dp_hint}."
    )


TARGET_HEAD_ASSERTIONS = {
    # architecture: (TP the attention reads, where stock asserts)
    "Qwen3ForCausalLM": ("attention TP", "models/qwen3.py:166-176"),
    "Qwen3MoeForCausalLM": ("attention TP", "models/qwen3_moe.py:506-516"),
    "LlamaForCausalLM": ("TP", "models/llama.py:183-193"),
    # MLA query heads (DeepseekV2AttentionMLA) and KDA heads, each over attention TP.
    "KimiK3ForConditionalGeneration": (
        "attention TP",
        "models/deepseek_v2.py:2057 (MLA), models/kimi_k3.py:1542 (KDA)",
    ),
    "KimiK3LinearForCausalLM": (
        "attention TP",
        "models/deepseek_v2.py:2057 (MLA), models/kimi_k3.py:1542 (KDA)",
    ),
}


def target_tp_refusal(
    architectures: List[str],
    num_heads: int,
    num_kv_heads: Optional[int],
    *,
    tp_size: int,
    attn_tp_size: int,
    side: str,
    tp_flag: str,
    linear_heads: Optional[int] = None,
) -> Optional[str]:
    """The target's own head assertion on ``side`` for the classes listed above (others: None,
    not modelled here). ``num_kv_heads`` None: MLA (query heads only); ``linear_heads``: the
    KDA heads of a Kimi-K3 target."""
    arch = next((a for a in architectures if a in TARGET_HEAD_ASSERTIONS), None)
    if arch is None:
        return None
    which, where = TARGET_HEAD_ASSERTIONS[arch]
    tp = attn_tp_size if which == "attention TP" else tp_size
    kv = num_heads if num_kv_heads is None else num_kv_heads
    problem = heads_over_tp_problem(num_heads, kv, tp)
    if problem is None and linear_heads is not None and linear_heads % tp:
        problem = f"{linear_heads} linear-attention (KDA) heads are not divisible by TP {tp}"
    if problem is None:
        return None
    widths = [linear_heads] if linear_heads is not None else []
    best = working_tps(num_heads, kv, widths, tp)[-1]
    return (
        f"the {side} server's target {arch} shards attention over {which} {tp} ({tp_flag}), and "
        f"{problem}: stock asserts this while building the model (sglang/srt/{where}). Use a "
        f"{side} {which} that divides the target's heads (e.g. {best})."
    )
