"""The KV-write-only draft of the last PP stage of a prefill server (patches to 0.5.23's
``models/dflash.py`` and ``model_loader/weight_utils.py``).

Why: a prefill server only writes draft KV. Per draft layer that takes the K/V rows of
``qkv_proj``, ``k_norm`` and RoPE, and before the layers ``hidden_norm`` and, on the last PP
stage, only ``fc``'s column block of the features that stage captures (the earlier stages'
contributions arrive as the carried partial). Stock builds the whole draft there: query rows,
``o_proj``, the MLPs and all of ``fc``, about 2.2 GB per GPU at Kimi-K3 size under TP4 against
about 0.15 GB needed (``draft_weight_bytes``), lost on every stage since token capacity is the
minimum over stages. Stock DSpark prunes its own draft on a PD prefill server
(``DSparkDraftMixin.prune_to_ctx_kv_injection``, after loading); ``DFlashDraftModel`` has no
such method, so we prune while it is built instead, and never allocate most of what is pruned.

Active only inside :func:`kv_write_only_build`, which ``PPDFlashWorkerV2`` enters around its
stock ``__init__`` on the last stage of a DFLASH PP prefill server (the only place the draft
never runs a forward). Decode servers, PP1 and every other model build exactly as stock.

Hooks:

* AROUND ``DFlashAttention._build_qkv_proj``: builds the stock ``QKVParallelLinear`` with zero
  query heads (only the K/V rows, sharded and loaded as stock), and leaves
  ``total_num_heads`` at zero for the rest of the stock ``__init__``, so the ``o_proj`` it builds
  next has no input columns (no memory). The ``__init__`` hook below restores it.
* AROUND ``DFlashAttention.__init__``: restores ``total_num_heads``, drops ``o_proj`` and sets
  ``q_size = 0``, which is where the stock K/V slicing (``kv_proj_only``, the fused
  materialiser) starts.
* AROUND ``DFlashMLP.__init__``: built on the meta device (no memory); the model hook drops it.
* AROUND ``DFlashDraftModel.__init__``: after the stock build, drops the MLPs, replaces ``fc``
  by an ``nn.Linear`` of the stage's column block (the full ``fc`` is allocated once by the stock
  ``__init__`` and freed here, before any weight is loaded) and marks the model.
* AROUND ``DFlashDraftModel.load_weights``: on a marked model, skips query, ``o_proj`` and MLP
  weights, slices ``fc`` to the block and a fused ``qkv_proj`` to its K/V rows; everything else
  goes through the stock loader.
* AROUND ``weight_utils.initialize_dummy_weights`` (what ``DummyModelLoader`` calls): on a marked
  model,
  overwrites the pruned parameters with the slice of what the full draft's dummy load gives
  them (``dummy_draft_weights``), so dummy-weight PP and PP1 write the same draft KV.
"""

from __future__ import annotations

import contextvars
import re
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional, Sequence, Tuple

import torch
from torch import nn

from sglang_dflash_pp.hooks import PluginHook
from sglang_dflash_pp.srt.models.context_partial import fc_column_block, feature_columns
from sglang_dflash_pp.srt.models.dflash_fc_columns import FC_WEIGHT_NAMES
from sglang_dflash_pp.srt.models.dummy_draft_weights import (
    dummy_full_parameter,
    release_cached_memory,
)

_MARK_ATTR = "_dflash_pp_kv_write_only"
_FULL_HEADS_ATTR = "_dflash_pp_total_num_heads"
_PRUNED_WEIGHT = re.compile(r"\.(self_attn\.q_proj|self_attn\.o_proj|mlp)\.")
_FUSED_QKV = re.compile(r"\.self_attn\.qkv_proj\.(weight|bias)$")

_building: contextvars.ContextVar = contextvars.ContextVar(
    "sglang_dflash_pp_kv_write_only_build", default=None
)


@dataclass(frozen=True)
class KVWriteOnlyDraft:
    """A pruned draft's ``fc``: the column blocks of ``features`` out of ``num_features``."""

    features: Tuple[int, ...]
    num_features: int
    hidden: int


@contextmanager
def kv_write_only_build(features: Sequence[int]) -> Iterator[None]:
    """Build every DFlash draft constructed inside as KV-write-only for ``features``."""
    features = tuple(int(f) for f in features)
    feature_columns(features, 1)  # consecutive and non-empty, or raise
    token = _building.set(features)
    try:
        yield
    finally:
        _building.reset(token)


def kv_write_only(draft_model) -> Optional[KVWriteOnlyDraft]:
    return draft_model.__dict__.get(_MARK_ATTR)


def stage_fc_block(draft_model, features: Sequence[int], hidden: int) -> torch.Tensor:
    """``[H, k*H]`` of ``fc`` for the last stage's ``features``, pruned or stock."""
    pruned = kv_write_only(draft_model)
    if pruned is None:
        return fc_column_block(draft_model.fc.weight, features, hidden)
    if pruned.features != tuple(features):
        raise RuntimeError(
            f"The KV-write-only draft holds fc blocks {list(pruned.features)}, but the stage "
            f"projects features {list(features)}."
        )
    return draft_model.fc.weight


# -- construction ---------------------------------------------------------------------------


def build_qkv_proj_around(original, self, *args, **kwargs):
    if _building.get() is None:
        return original(self, *args, **kwargs)
    self.__dict__[_FULL_HEADS_ATTR] = self.total_num_heads
    self.total_num_heads = 0  # stays 0 until attention_init_around: o_proj gets no columns
    return original(self, *args, **kwargs)


def attention_init_around(original, self, *args, **kwargs):
    result = original(self, *args, **kwargs)
    full_heads = self.__dict__.pop(_FULL_HEADS_ATTR, None)
    if full_heads is not None:
        self.total_num_heads = full_heads
        self.o_proj = None
        self.q_size = 0  # the qkv_proj rows start at K
    return result


def mlp_init_around(original, self, *args, **kwargs):
    if _building.get() is None:
        return original(self, *args, **kwargs)
    with torch.device("meta"):
        return original(self, *args, **kwargs)


def draft_init_around(original, self, config, *args, **kwargs):
    result = original(self, config, *args, **kwargs)
    features = _building.get()
    if features is None or _MARK_ATTR in self.__dict__:
        return result
    if self.quantizable:
        raise RuntimeError(
            "The last PP stage builds its DFlash draft KV-write-only, which needs an "
            "unquantised fc; the PP gate should have refused this draft."
        )
    hidden = int(config.hidden_size)
    for layer in self.layers:
        layer.mlp = None
    full_fc = self.fc
    device, dtype = full_fc.weight.device, full_fc.weight.dtype
    self.fc = nn.Linear(len(features) * hidden, hidden, bias=False, device=device, dtype=dtype)
    del full_fc
    self.__dict__[_MARK_ATTR] = KVWriteOnlyDraft(features, int(self.num_context_features), hidden)
    release_cached_memory(device)
    return result


# -- weights --------------------------------------------------------------------------------


def _kv_write_weights(model, pruned: KVWriteOnlyDraft, weights: Iterable) -> Iterator:
    columns = feature_columns(pruned.features, pruned.hidden)
    full_fc = (pruned.hidden, pruned.num_features * pruned.hidden)
    for name, weight in weights:
        if _PRUNED_WEIGHT.search(f".{name}"):
            continue
        if name in FC_WEIGHT_NAMES and tuple(weight.shape) == full_fc:
            weight = weight[:, columns]  # a wrong shape goes through: stock names the mismatch
        elif _FUSED_QKV.search(f".{name}"):
            attn = model.layers[int(re.search(r"layers\.(\d+)\.", name).group(1))].self_attn
            weight = weight[attn.total_num_heads * attn.head_dim :]
        yield name, weight


def load_weights_around(original, self, weights, *args, **kwargs):
    pruned = kv_write_only(self)
    if pruned is None:
        return original(self, weights, *args, **kwargs)
    return original(self, _kv_write_weights(self, pruned, weights), *args, **kwargs)


def initialize_dummy_weights_around(original, model, *args, **kwargs):
    result = original(model, *args, **kwargs)
    pruned = kv_write_only(model)
    if pruned is None:
        return result

    def full(name, param, shape):
        return dummy_full_parameter(
            name, shape, param.dtype, param.device, lambda m: original(m, *args, **kwargs)
        )

    with torch.no_grad():
        fc = model.fc.weight
        fc_shape = (pruned.hidden, pruned.num_features * pruned.hidden)
        columns = feature_columns(pruned.features, pruned.hidden)
        fc.copy_(full("fc.weight", fc, fc_shape)[:, columns])
        for i, layer in enumerate(model.layers):
            attn = layer.self_attn
            q_rows = attn.num_heads * attn.head_dim
            for kind in ("weight", "bias"):
                param = getattr(attn.qkv_proj, kind, None)
                if param is not None:
                    shape = (q_rows + param.shape[0],) + tuple(param.shape[1:])
                    name = f"layers.{i}.self_attn.qkv_proj.{kind}"
                    param.copy_(full(name, param, shape)[q_rows:])
    release_cached_memory(model.fc.weight.device)
    return result


HOOKS = (
    PluginHook(
        "sglang.srt.models.dflash.DFlashAttention._build_qkv_proj",
        build_qkv_proj_around,
        "around",
        "last PP stage of a prefill server: draft qkv_proj without query rows",
    ),
    PluginHook(
        "sglang.srt.models.dflash.DFlashAttention.__init__",
        attention_init_around,
        "around",
        "last PP stage of a prefill server: draft attention without o_proj",
    ),
    PluginHook(
        "sglang.srt.models.dflash.DFlashMLP.__init__",
        mlp_init_around,
        "around",
        "last PP stage of a prefill server: draft MLP never allocated",
    ),
    PluginHook(
        "sglang.srt.models.dflash.DFlashDraftModel.__init__",
        draft_init_around,
        "around",
        "last PP stage of a prefill server: KV-write-only draft (fc block, no MLP)",
    ),
    PluginHook(
        "sglang.srt.models.dflash.DFlashDraftModel.load_weights",
        load_weights_around,
        "around",
        "last PP stage of a prefill server: load only the weights the draft KV write uses",
    ),
    PluginHook(
        "sglang.srt.model_loader.weight_utils.initialize_dummy_weights",
        initialize_dummy_weights_around,
        "around",
        "dummy weights: a KV-write-only draft gets the full draft's dummy values",
    ),
)
