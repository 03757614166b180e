"""PP scheduler relay parity for DFLASH (the patch to ``managers/scheduler_pp_mixin.py``, 0.5.23).

Under PP the last stage's result reaches the other ranks through the output ring, and every rank
rebuilds ``batch.spec_info`` from it; the PD prefill result processor then asserts
``batch.spec_info is result.next_draft_input`` and forwards the first token to decode. Stock
special-cases DSPARK here (it rebuilds a ``DFlashDraftInputV2``); DFLASH would fall into the EAGLE
relay, ship the empty ``(bs, 0)`` topk/hidden tensors of ``DFlashDraftInputV2`` around the ring and
rebuild an ``EagleDraftInput`` on every rank: harmless, but the wrong type on the PD path.

Hooks (both inert for every other algorithm and for PP1, where these methods are not called):

* AFTER ``SchedulerPPMixin._pp_prepare_tensor_dict``: drop the EAGLE draft relay keys for DFLASH.
* AFTER ``SchedulerPPMixin._pp_prep_batch_result``: rebuild ``DFlashDraftInputV2`` from the relayed
  next tokens on every rank and bind it to both ``batch.spec_info`` and the result.
"""

from __future__ import annotations

from sglang_dflash_pp.hooks import PluginHook

_EAGLE_RELAY_KEYS = (
    "draft_topk_p",
    "draft_topk_index",
    "draft_hidden_states",
    "draft_dsa_topk_indices",
)


def _is_dflash(batch) -> bool:
    return batch.spec_algorithm.is_dflash()


def drop_eagle_relay_keys(tensor_dict, scheduler, result, batch, *args, **kwargs):
    if _is_dflash(batch):
        for key in _EAGLE_RELAY_KEYS:
            tensor_dict.pop(key, None)
    return tensor_dict


def rebuild_dflash_draft_input(output_result, scheduler, batch, mb_metadata, pp_outputs, *a, **k):
    if not _is_dflash(batch) or output_result.accept_lens is not None:
        return output_result  # not DFLASH, or a gated PP-spec verify round (refused for DFLASH)
    from sglang.srt.speculative.draft_worker_common import make_draft_input_v2

    next_draft_input = make_draft_input_v2(
        bonus_tokens=pp_outputs["next_token_ids"], new_seq_lens=batch.seq_lens
    )
    batch.spec_info = next_draft_input
    output_result.next_draft_input = next_draft_input
    return output_result


HOOKS = (
    PluginHook(
        "sglang.srt.managers.scheduler_pp_mixin.SchedulerPPMixin._pp_prepare_tensor_dict",
        drop_eagle_relay_keys,
        "after",
        "DFLASH under PP: no EAGLE draft relay around the output ring",
    ),
    PluginHook(
        "sglang.srt.managers.scheduler_pp_mixin.SchedulerPPMixin._pp_prep_batch_result",
        rebuild_dflash_draft_input,
        "after",
        "DFLASH under PP: every rank rebuilds DFlashDraftInputV2 from the relayed first token",
    ),
)
