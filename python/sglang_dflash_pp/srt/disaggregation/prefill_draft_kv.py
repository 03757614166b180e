"""The patch to ``sglang/srt/disaggregation/prefill.py`` for the draft KV (sglang 0.5.23).

Hook: AROUND ``PrefillBootstrapQueue._init_kv_manager``, which lists the prefill rank's
transfer entries (target KV, then the draft pool's K and V buffers) and builds its KV manager.

1. **Only the last pipeline stage appends draft entries.** 0.5.23 enforces that only on NPU
   (``not _is_npu or pp_group.is_last_rank``). Elsewhere a stage holding a draft pool would pair
   its draft entries with the decode's draft band by layer id and overwrite it with KV the
   draft never computed there. For an earlier stage the hook runs the original with the draft
   pool hidden, so the stage registers exactly what a stage without a draft registers. Our PP
   worker holds no draft pool on those stages either; this does not rely on it.
2. **Describe the DFLASH draft pool for the transfer layer** (``mooncake_draft_kv``): the
   draft's total KV heads, K and V head dims and element size, which ``KVArgs`` does not carry,
   and the pool buffers behind the draft entries (the pack reads them), in the registry
   ``draft_kv_source`` owns, with the rank's pack staging (``draft_kv_staging``: buffer, slots,
   prepared and compiled packs), so nothing of the send path is allocated or compiled while
   serving. Recorded before the original runs, because the KV manager registers the staging
   with the transfer engine and starts its bootstrap thread inside it, and decode
   registrations, which are checked against this record, can arrive at once.
3. **Refuse to start without the transfer hooks**: without them a decode with another attention
   TP would receive wrong draft bytes, silently.

With ``--pp-size 1`` and no DFLASH draft the hook only calls the original.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from sglang_dflash_pp.hooks import PluginHook, require_applied
from sglang_dflash_pp.srt.disaggregation.draft_kv_source import (
    describe_draft_pool,
    draft_total_kv_heads,
    record_draft_kv_source,
)

logger = logging.getLogger(__name__)


def _is_dflash(scheduler) -> bool:
    algorithm = getattr(scheduler, "spec_algorithm", None)
    return algorithm is not None and bool(getattr(algorithm, "is_dflash", lambda: False)())


def _uses_mooncake(queue) -> bool:
    backend = getattr(queue, "transfer_backend", None)
    return str(getattr(backend, "name", backend)).upper() == "MOONCAKE"


def _require_transfer_hooks() -> None:
    from sglang_dflash_pp.srt.disaggregation import (
        draft_kv_staging,
        kv_write_fence,
        mooncake_draft_kv,
    )

    mooncake_draft_kv.check_environment()
    require_applied(
        mooncake_draft_kv.HOOKS + draft_kv_staging.HOOKS + kv_write_fence.HOOKS,
        "DFLASH on a Mooncake PD prefill (without its draft KV transfer hooks a decode with "
        "another attention TP would receive wrong draft KV)",
    )


def init_kv_manager_around(original, self, *args, **kwargs):
    pool = self.draft_token_to_kv_pool
    if pool is None:
        return original(self, *args, **kwargs)
    if self.pp_size > 1 and self.pp_rank != self.pp_size - 1:
        logger.info(
            "PP stage %d of %d registers no draft KV entries: only the last stage holds the "
            "draft KV.",
            self.pp_rank,
            self.pp_size,
        )
        self.draft_token_to_kv_pool = None
        try:
            return original(self, *args, **kwargs)
        finally:
            self.draft_token_to_kv_pool = pool
    if _is_dflash(self.scheduler) and _uses_mooncake(self):
        _require_transfer_hooks()
        source = describe_draft_pool(pool, draft_total_kv_heads(self.scheduler, pool))
        if source.shape is None:
            logger.warning(
                "DFLASH draft KV can be sent only to decodes with this prefill's attention TP "
                "and draft layout: %s.",
                source.shape_unknown_reason,
            )
        else:
            staging = _build_staging(source, self.token_to_kv_pool.page_size)
            source = replace(source, staging=staging)
        record_draft_kv_source(source)
    return original(self, *args, **kwargs)


def attention_tp():
    """(size, rank) of this rank's attention TP group: how the KV manager shards the draft KV."""
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    return int(parallel.attn_tp_size), int(parallel.attn_tp_rank)


def _build_staging(source, page_size: int):
    """The rank's pack staging, before sglang builds the KV manager (which registers it)."""
    from sglang_dflash_pp.srt.disaggregation.draft_kv_staging import build_rank_staging

    tp_size, tp_rank = attention_tp()
    return build_rank_staging(source, page_size, tp_size, tp_rank)


HOOKS = (
    PluginHook(
        "sglang.srt.disaggregation.prefill.PrefillBootstrapQueue._init_kv_manager",
        init_kv_manager_around,
        "around",
        "only the last PP stage registers draft KV entries; record the DFLASH draft geometry",
    ),
)
