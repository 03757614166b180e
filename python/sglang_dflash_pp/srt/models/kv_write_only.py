"""The KV-write-only DFlash draft of the last PP stage of a DFLASH PP prefill server.

A prefill server only writes draft KV. Per draft layer that takes the K/V rows of ``qkv_proj``,
``k_norm`` and RoPE, and before the layers ``hidden_norm`` and, on the last PP stage, only
``fc``'s column block of the features that stage captures (the earlier stages' contributions
arrive as the carried partial). The full draft there holds query rows, ``o_proj``, the MLPs and
all of ``fc``: about 2.2 GB per GPU at Kimi-K3 size under TP4 against about 0.15 GB needed, lost
on every stage since token capacity is the minimum over stages.

While the last stage builds its draft (``dflash_last_stage_draft_build``, which names the
features the stage captures; or inside :func:`kv_write_only_build`),
:func:`building_kv_write_only` gives those features, and the draft is built KV-write-only:

* ``DFlashAttention`` builds ``qkv_proj`` with zero query heads (only the K/V rows, sharded and
  loaded as usual) and no ``o_proj``; ``DFlashDecoderLayer`` builds no MLP;
* after ``DFlashDraftModel.__init__``, :func:`finish_kv_write_only` replaces ``fc`` by an
  ``nn.Linear`` of the stage's column block, sets ``q_size = 0`` (where the K/V-only slicing
  starts) and marks the model (:func:`kv_write_only`);
* ``load_weights`` reads :func:`kv_write_weights`: query, ``o_proj`` and MLP weights skipped,
  ``fc`` sliced to the block, a fused ``qkv_proj`` to its K/V rows;
* under dummy weights :func:`dummy_kv_write_only` overwrites the sliced parameters with the slice
  of what the full draft's dummy load gives them, so a dummy PP prefill writes the same draft KV
  as a dummy PP1 prefill;
* ``project_target_hidden`` refuses to run on such a draft outside the PP context
  (:func:`require_full_fc`).

Decode servers, PP1 and every other model build exactly the full draft.
"""

from __future__ import annotations

import contextvars
import re
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Optional, Sequence, Tuple

import torch
from torch import nn

from sglang_dflash_pp.srt.models.context_partial import feature_columns
from sglang_dflash_pp.srt.models.dflash_fc_columns import FC_WEIGHT_NAMES, KV_WRITE_ONLY_ATTR
from sglang_dflash_pp.srt.models.dummy_draft_weights import (
    dummy_full_parameter,
    release_cached_memory,
)
from sglang_dflash_pp.srt.speculative.last_stage_draft_build import current_draft_build

_PRUNED_WEIGHT = re.compile(r"\.(self_attn\.q_proj|self_attn\.o_proj|mlp)\.")
_FUSED_QKV = re.compile(r"\.self_attn\.qkv_proj\.(weight|bias)$")

_building: contextvars.ContextVar = contextvars.ContextVar(
    "dflash_kv_write_only_build", default=None
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


def building_kv_write_only() -> Optional[Tuple[int, ...]]:
    """The features a DFlash draft constructed now is built KV-write-only for, or None."""
    features = _building.get()
    if features is not None:
        return features
    build = current_draft_build()
    if build is None:
        return None
    feature_columns(build.features, 1)  # consecutive and non-empty, or raise
    return build.features


def kv_write_only(draft_model) -> Optional[KVWriteOnlyDraft]:
    return draft_model.__dict__.get(KV_WRITE_ONLY_ATTR)


def require_full_fc(draft_model) -> None:
    """Refuse a context projection of a KV-write-only draft outside the PP context."""
    if kv_write_only(draft_model) is not None:
        raise RuntimeError(
            "The last PP stage's KV-write-only DFlash draft holds only its own fc column "
            "block; it projects through the PP context stash, never on its own."
        )


def finish_kv_write_only(draft_model, config) -> None:
    """After the draft's ``__init__``: keep only what writes the draft KV (see the module)."""
    features = building_kv_write_only()
    if features is None or KV_WRITE_ONLY_ATTR in draft_model.__dict__:
        return
    if draft_model.quantizable:
        raise RuntimeError(
            "The last PP stage builds its DFlash draft KV-write-only, which needs an "
            "unquantised fc; the PP gate should have refused this draft."
        )
    hidden = int(config.hidden_size)
    for layer in draft_model.layers:
        layer.mlp = None
        layer.self_attn.o_proj = None
        layer.self_attn.q_size = 0  # the qkv_proj rows start at K
    full_fc = draft_model.fc
    device, dtype = full_fc.weight.device, full_fc.weight.dtype
    draft_model.fc = nn.Linear(
        len(features) * hidden, hidden, bias=False, device=device, dtype=dtype
    )
    del full_fc
    draft_model.__dict__[KV_WRITE_ONLY_ATTR] = KVWriteOnlyDraft(
        features, int(draft_model.num_context_features), hidden
    )
    release_cached_memory(device)


def kv_write_weights(draft_model, pruned: KVWriteOnlyDraft, weights: Iterable) -> Iterator:
    """The checkpoint stream a KV-write-only draft loads: what it holds, sliced to its shapes."""
    columns = feature_columns(pruned.features, pruned.hidden)
    full_fc = (pruned.hidden, pruned.num_features * pruned.hidden)
    for name, weight in weights:
        if _PRUNED_WEIGHT.search(f".{name}"):
            continue
        if name in FC_WEIGHT_NAMES and tuple(weight.shape) == full_fc:
            weight = weight[:, columns]  # a wrong shape goes through: load_weights names it
        elif _FUSED_QKV.search(f".{name}"):
            layer = int(re.search(r"layers\.(\d+)\.", name).group(1))
            attn = draft_model.layers[layer].self_attn
            weight = weight[attn.total_num_heads * attn.head_dim :]
        yield name, weight


def dummy_kv_write_only(model, initialize: Callable[[nn.Module], None]) -> None:
    """After the dummy initialiser ``initialize`` filled a KV-write-only draft: give its sliced
    parameters the slices of what ``initialize`` gives the full-shape parameters."""
    pruned = kv_write_only(model)
    if pruned is None:
        return

    def full(name, param, shape):
        return dummy_full_parameter(name, shape, param.dtype, param.device, initialize)

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
