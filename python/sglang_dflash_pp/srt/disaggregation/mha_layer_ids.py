"""Layer ids for plain-MHA transfer entries under PP (the patch to ``disaggregation/utils.py`` of
sglang 0.5.23, and the decode side's ids as a prefill stage pairs against them).

Hook: AROUND ``disaggregation.utils.build_kv_layer_ids``.

Why: for a plain ``MHATokenToKVPool`` target (Llama, Qwen3, Qwen3-MoE, gpt-oss) 0.5.23 publishes
no layer ids, and the Mooncake send paths then pair prefill and decode entries by position
(``get_mha_kv_ptrs_with_pp``: this stage's K block against ``dst[start:end]``, its V block
against ``dst[N + start : N + end]`` with ``N`` = half the decode's entries). That split is right
only while neither side appends draft entries: a DFLASH decode lists ``K_0..K_{N-1},
V_0..V_{N-1}`` and then the draft's K and V, so a PP prefill stage's V block lands on the wrong
decode layers (or on the draft band), and the last stage's draft entries are taken for V.
With layer ids on both sides the same stock paths pair entries by id instead (``send_kvcache``'s
flat layout, ``send_kvcache_slice``'s id pairing), which is what Kimi-K3's hybrid pool already
does. So, only on a DFLASH PP prefill:

* this stage publishes ``model_layer_ids`` twice (its K then V entries) and, on the last stage,
  the draft band exactly as stock numbers it (``_draft_entry_layer_ids`` ->
  ``_remap_draft_layer_ids``);
* a decode that published no ids (a stock PP1 decode with a plain-MHA target) is given the ids
  of the layout it registers, ``0..N-1`` twice and then the same draft band, checked against its
  entry count and item lengths (:func:`decode_mha_layer_ids`); ``mooncake_draft_kv`` fills them in
  at registration, before any transfer reads the record.

Every other configuration, and any pool that already reports ids, gets the stock result.
"""

from __future__ import annotations

import threading
from typing import List, Optional, Sequence

from sglang_dflash_pp.hooks import PluginHook
from sglang_dflash_pp.srt.pp_prefill_role import serving_dflash_pp_prefill

_lock = threading.Lock()
_target_num_layers: Optional[int] = None  # set when this process published synthesized ids


def published_num_layers() -> Optional[int]:
    """The target's layer count if this prefill process synthesized MHA layer ids, else None."""
    with _lock:
        return _target_num_layers


def draft_band(num_hidden_layers: int, num_draft_entries: int) -> List[int]:
    """Stock's band for a plain draft pool (K per layer, then V): ``N + i`` for layer ``i``."""
    from sglang.srt.disaggregation.utils import _remap_draft_layer_ids

    layers = num_draft_entries // 2
    return _remap_draft_layer_ids(list(range(layers)) * 2, num_hidden_layers)


def decode_mha_layer_ids(
    num_hidden_layers: int, dst_item_lens: Sequence[int], num_dst_entries: int
) -> List[int]:
    """The ids of a PP1 decode's plain-MHA target entries plus its draft entries, or raise
    ``ValueError`` naming what does not fit that layout."""
    n = int(num_hidden_layers)
    extra = int(num_dst_entries) - 2 * n
    if extra < 0 or extra % 2:
        raise ValueError(
            f"the decode registered {num_dst_entries} KV entries, which is not {2 * n} target "
            "entries (K and V of every layer) plus a K and V entry per draft layer; run the "
            "decode with --pp-size 1 and the same target and draft"
        )
    lens = list(dst_item_lens or [])
    if lens and len(set(lens[: 2 * n])) != 1:
        raise ValueError(
            f"the decode's first {2 * n} KV entries have item lengths {sorted(set(lens[: 2 * n]))}, "
            "not one plain-MHA target layout"
        )
    return list(range(n)) * 2 + draft_band(n, extra)


def pairs_mha_by_layer_id(token_to_kv_pool) -> bool:
    """Whether this process publishes layer ids for a plain-MHA target: a DFLASH PP prefill."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return type(token_to_kv_pool) is MHATokenToKVPool and serving_dflash_pp_prefill()


def mha_layer_ids(
    token_to_kv_pool, draft_token_to_kv_pool, num_draft_entries: int, num_hidden_layers: int
) -> List[int]:
    """This stage's ids: its target layers for the K entries, again for the V entries, then the
    draft band (last stage only), as stock numbers a draft band."""
    target = list(token_to_kv_pool.model_layer_ids) * 2
    band = draft_band(num_hidden_layers, num_draft_entries) if draft_token_to_kv_pool else []
    global _target_num_layers
    with _lock:
        _target_num_layers = int(num_hidden_layers)
    return target + band


def fill_decode_layer_ids(kv_args, registration) -> Optional[str]:
    """A decode that published no layer ids (a PP1 plain-MHA decode), peered with a prefill
    stage that pairs by id: give ``registration`` the ids of the layout it registered. Returns
    why that layout does not fit, or None (also when there is nothing to fill)."""
    num_layers = published_num_layers()
    if num_layers is None or registration.dst_kv_layer_ids or not kv_args.kv_layer_ids:
        return None
    try:
        registration.dst_kv_layer_ids = decode_mha_layer_ids(
            num_layers, registration.dst_kv_item_lens, len(registration.dst_kv_ptrs)
        )
    except ValueError as e:
        return f"a DFLASH PP prefill pairs KV entries by layer id: {e}"
    return None


def build_kv_layer_ids_around(
    original, *, token_to_kv_pool, draft_token_to_kv_pool, num_draft_entries, num_hidden_layers
):
    ids = original(
        token_to_kv_pool=token_to_kv_pool,
        draft_token_to_kv_pool=draft_token_to_kv_pool,
        num_draft_entries=num_draft_entries,
        num_hidden_layers=num_hidden_layers,
    )
    if ids or not pairs_mha_by_layer_id(token_to_kv_pool):
        return ids
    return mha_layer_ids(
        token_to_kv_pool, draft_token_to_kv_pool, num_draft_entries, num_hidden_layers
    )


HOOKS = (
    PluginHook(
        "sglang.srt.disaggregation.utils.build_kv_layer_ids",
        build_kv_layer_ids_around,
        "around",
        "DFLASH PP prefill with a plain-MHA target: pair transfer entries by layer id",
    ),
)
