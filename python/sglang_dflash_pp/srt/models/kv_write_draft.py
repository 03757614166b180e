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

Active only inside :func:`kv_write_only_build`, or while ``PPDFlashWorkerV2`` builds its draft
on the last stage of a DFLASH PP prefill server (``last_stage_draft_build``, around its stock
``__init__``: the only place the draft never runs a forward). Decode servers, PP1 and every other model build exactly as stock.

The logic is ``kv_write_only`` (the module that moves in-tree); the hooks here call it.

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

import torch

from sglang_dflash_pp.hooks import PluginHook
from sglang_dflash_pp.srt.models.dflash_fc_columns import stage_fc_block  # noqa: F401 (tests)
from sglang_dflash_pp.srt.models.kv_write_only import (  # noqa: F401 (tests' names)
    KVWriteOnlyDraft,
    building_kv_write_only,
    dummy_kv_write_only,
    finish_kv_write_only,
    kv_write_only,
    kv_write_only_build,
    kv_write_weights,
)

_FULL_HEADS_ATTR = "_dflash_pp_total_num_heads"

# -- construction ---------------------------------------------------------------------------


def build_qkv_proj_around(original, self, *args, **kwargs):
    if building_kv_write_only() is None:
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
    if building_kv_write_only() is None:
        return original(self, *args, **kwargs)
    with torch.device("meta"):
        return original(self, *args, **kwargs)


def draft_init_around(original, self, config, *args, **kwargs):
    result = original(self, config, *args, **kwargs)
    finish_kv_write_only(self, config)
    return result


# -- weights --------------------------------------------------------------------------------


def load_weights_around(original, self, weights, *args, **kwargs):
    pruned = kv_write_only(self)
    if pruned is None:
        return original(self, weights, *args, **kwargs)
    return original(self, kv_write_weights(self, pruned, weights), *args, **kwargs)


def initialize_dummy_weights_around(original, model, *args, **kwargs):
    result = original(model, *args, **kwargs)
    dummy_kv_write_only(model, lambda m: original(m, *args, **kwargs))
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
