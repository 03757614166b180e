"""Draft weight bytes per GPU on the last PP stage of a prefill server: the stock draft against the
KV-write-only draft (``kv_write_draft``).

Why a formula and not a measurement: token capacity is the minimum over PP stages, and the
operator needs the figure before any GPU is up (``sglang-dflash-pp check``). The test builds the
real draft both ways and compares this with its parameter bytes.

What each draft holds per TP rank, as 0.5.23's ``DFlashDraftModel`` builds it:

* stock: ``fc`` ``[H, K*H]`` (replicated), ``hidden_norm`` and ``norm``; per layer the two layer
  norms, ``qkv_proj`` over this rank's query and K/V heads, ``o_proj`` over its query heads (its
  bias, if any, full-width), ``q_norm``/``k_norm`` and the MLP (``gate_up`` and ``down`` over
  ``intermediate_size / tp``);
* KV-write-only: ``fc``'s column block of the stage's own features ``[H, k*H]``, the same norms,
  and per layer only the K/V rows of ``qkv_proj`` (no query rows, no ``o_proj``, no MLP).

K/V heads are replicated when ``tp > num_key_value_heads`` (one head per rank, as
``QKVParallelLinear`` does). Grouped convolutions, attention sinks, a draft-owned embedding and
DFlash2's candidate selector are not counted: the example drafts have none (both variants would
hold them alike). Pure: no sglang or torch import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4}


@dataclass(frozen=True)
class DraftWeightBytes:
    stock: int
    kv_write_only: int

    @property
    def saved(self) -> int:
        return self.stock - self.kv_write_only


def _get(config: Any, key: str, default=None):
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


def dtype_bytes(config: Any, dtype: Any = None) -> int:
    """Bytes per element of ``dtype`` (a name), else of the config's ``torch_dtype``."""
    name = str(dtype if dtype not in (None, "auto") else _get(config, "torch_dtype", "bfloat16"))
    name = name.replace("torch.", "")
    if name not in DTYPE_BYTES:
        raise ValueError(f"unknown draft dtype {name!r}; expected one of {sorted(DTYPE_BYTES)}")
    return DTYPE_BYTES[name]


def last_stage_draft_weight_bytes(
    draft_config: Any,
    *,
    tp_size: int,
    num_features: int,
    last_stage_features: int,
    dtype: Any = None,
) -> DraftWeightBytes:
    """Draft weight bytes on one GPU of the last PP stage, stock and KV-write-only.

    ``num_features``: ``K``, the draft's context features (``len(target_layer_ids)``);
    ``last_stage_features``: how many of them the last stage captures itself."""
    hidden = int(_get(draft_config, "hidden_size"))
    heads = int(_get(draft_config, "num_attention_heads"))
    kv_heads = int(_get(draft_config, "num_key_value_heads", heads))
    head_dim = int(_get(draft_config, "head_dim", None) or hidden // heads)
    intermediate = int(_get(draft_config, "intermediate_size"))
    layers = int(_get(draft_config, "num_hidden_layers"))
    bias = bool(_get(draft_config, "attention_bias", False))
    tp = int(tp_size)
    if heads % tp or intermediate % tp:
        raise ValueError(
            f"num_attention_heads={heads} and intermediate_size={intermediate} must divide "
            f"by tp_size={tp}"
        )
    q_rows = heads // tp * head_dim
    kv_rows = 2 * (kv_heads // tp if kv_heads >= tp else 1) * head_dim

    norms = 2 * hidden + 2 * head_dim  # input/post-attention layer norms, q_norm, k_norm
    kv = kv_rows * hidden + (kv_rows if bias else 0)
    q = q_rows * hidden + (q_rows if bias else 0)
    o = hidden * q_rows + (hidden if bias else 0)
    mlp = 3 * (intermediate // tp) * hidden
    shared = 2 * hidden  # hidden_norm, norm

    stock = int(num_features) * hidden * hidden + shared + layers * (norms + kv + q + o + mlp)
    pruned = int(last_stage_features) * hidden * hidden + shared + layers * (norms + kv)
    size = dtype_bytes(draft_config, dtype)
    return DraftWeightBytes(stock=stock * size, kv_write_only=pruned * size)
