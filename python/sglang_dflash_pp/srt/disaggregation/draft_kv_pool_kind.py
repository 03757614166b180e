"""Which KV pool class sglang 0.5.23 will build for the DFLASH draft, predicted from the launch
settings, and whether the head-aware transfer can serve it.

Why: the transfer path reads the draft's geometry off a plain NHD ``MHATokenToKVPool``
(``draft_kv_source.describe_draft_pool``); any other pool is served only to a decode with the
prefill's own draft attention TP and item lengths (``draft_kv_peer.peer_verdict``), and refused
at registration otherwise. Registration happens after both servers have started, so ``check``
predicts the class from the settings that select it, in the order
``KVCacheConfigurator`` applies them.

Pure: no sglang import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

PLAIN_POOL = "MHATokenToKVPool"
FP4_KV_DTYPES = ("nvfp4", "fp4_mx_block16")


@dataclass(frozen=True)
class DraftPoolKind:
    name: str  # the class (and layout) sglang builds
    plain: Optional[bool]  # True: plain NHD MHATokenToKVPool; None: decided only at startup
    setting: Optional[str]  # the flag or env that selected a non-plain pool
    where: str  # sglang 0.5.23 source of the decision


def draft_pool_kind(
    *,
    draft_kv_cache_dtype: str,
    enable_unified_memory: bool = False,
    prefill_only_disable_kv_cache: bool = False,
    enable_page_major_kv_layout: bool = False,
    enable_kv_cache_sharding: bool = False,
    use_hnd_kv_cache: bool = False,
) -> DraftPoolKind:
    """The draft pool a DFLASH draft worker builds (its draft config is plain MHA, never MLA or
    hybrid SWA). ``draft_kv_cache_dtype``: ``--speculative-draft-kv-cache-dtype`` when given,
    else ``--kv-cache-dtype``."""
    if enable_unified_memory:
        return DraftPoolKind(
            "bound to the target's unified buffer, or a private pool when the target placed none",
            None,
            "--enable-unified-memory",
            "mem_cache/kv_cache_configurator.py:652-700",
        )
    if draft_kv_cache_dtype == "mxfp8":
        return DraftPoolKind(
            "MHATokenToKVPoolMXFP8",
            False,
            "--kv-cache-dtype / --speculative-draft-kv-cache-dtype mxfp8",
            "mem_cache/kv_cache_configurator.py:2745-2746",
        )
    if prefill_only_disable_kv_cache:
        return DraftPoolKind(
            "NoOpMHATokenToKVPool",
            False,
            "--prefill-only-disable-kv-cache",
            "mem_cache/kv_cache_configurator.py:2747-2751",
        )
    if enable_page_major_kv_layout:
        return DraftPoolKind(
            "PageMajorMHATokenToKVPool",
            False,
            "--enable-page-major-kv-layout",
            "mem_cache/kv_cache_configurator.py:1797-1806, 2149-2155",
        )
    if enable_kv_cache_sharding:
        return DraftPoolKind(
            "PageInterleaveMHATokenToKVPool (KV-cache sharding)",
            False,
            "--enable-kv-cache-sharding",
            "mem_cache/kv_cache_configurator.py:2758-2774",
        )
    if draft_kv_cache_dtype in FP4_KV_DTYPES:
        return DraftPoolKind(
            f"MHATokenToKVPool with the {draft_kv_cache_dtype} quant method (packed FP4 + scales)",
            False,
            f"--kv-cache-dtype / --speculative-draft-kv-cache-dtype {draft_kv_cache_dtype}",
            "mem_cache/kv_cache_configurator.py:436-455",
        )
    if use_hnd_kv_cache:
        return DraftPoolKind(
            "MHATokenToKVPool in HND layout",
            False,
            "SGLANG_USE_HND_KVCACHE",
            "mem_cache/memory_pool.py:2250-2266",
        )
    return DraftPoolKind(
        f"{PLAIN_POOL} (NHD)", True, None, "mem_cache/kv_cache_configurator.py:2742-2793"
    )


def pool_transfer_refusal(
    kind: DraftPoolKind, *, prefill_draft_tp: int, decode_draft_tp: int
) -> Optional[str]:
    """The plugin's registration verdict for a pool it cannot describe
    (``draft_kv_peer.peer_verdict``): served only at equal draft attention TP."""
    if kind.plain is not False or prefill_draft_tp == decode_draft_tp:
        return None
    return (
        f"the prefill's DFLASH draft KV pool would be a {kind.name} (set by {kind.setting}), "
        "which the head-aware transfer cannot read head by head; it serves only a decode with "
        f"the prefill's own draft attention TP ({prefill_draft_tp}), and this decode runs "
        f"{decode_draft_tp}: every request to it would fail at registration. Drop "
        f"{kind.setting} on the prefill, or run both servers at the same draft attention TP."
    )
