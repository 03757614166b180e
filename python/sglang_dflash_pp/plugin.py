"""Entry point of the ``sglang.srt.plugins`` group: the version gate and hook registration.

SGLang calls :func:`register` in every server process (launcher, schedulers, detokenizer) and
then applies all registered hooks. Every hook is inert unless the server is configured for what
this plugin exists for (DFLASH with ``--pp-size > 1`` on a PD prefill server, or a draft-KV
transfer whose P and D hold different draft heads per rank), so installing the package changes
nothing else.
"""

from __future__ import annotations

import importlib
import logging
from importlib.metadata import PackageNotFoundError, version
from typing import List, Optional

from sglang_dflash_pp import REQUIRED_SGLANG_VERSION
from sglang_dflash_pp.hooks import PluginHook, record_registered, registered_hooks

logger = logging.getLogger(__name__)

# Each module is "the patch to one upstream file" and exports HOOKS.
HOOK_MODULES = (
    "sglang_dflash_pp.srt.arg_groups.dflash_pp_gate",
    "sglang_dflash_pp.srt.models.dflash",
    "sglang_dflash_pp.srt.models.kv_write_draft",
    "sglang_dflash_pp.srt.models.pp_capture",
    "sglang_dflash_pp.srt.speculative.worker_selection",
    "sglang_dflash_pp.srt.managers.scheduler_pp_relay",
    "sglang_dflash_pp.srt.disaggregation.mha_layer_ids",
    "sglang_dflash_pp.srt.disaggregation.prefill_draft_kv",
    "sglang_dflash_pp.srt.disaggregation.mooncake_draft_kv",
    "sglang_dflash_pp.srt.disaggregation.draft_kv_staging",
    "sglang_dflash_pp.srt.disaggregation.kv_write_fence",
    "sglang_dflash_pp.srt.disaggregation.kv_digest_send",
    "sglang_dflash_pp.srt.disaggregation.kv_digest_verify",
    "sglang_dflash_pp.srt.managers.empty_prompt_refusal",
)


def _installed_sglang_version() -> Optional[str]:
    try:
        return version("sglang")
    except PackageNotFoundError:
        return None


def plugin_hooks() -> List[PluginHook]:
    hooks: List[PluginHook] = []
    for name in HOOK_MODULES:
        hooks.extend(importlib.import_module(name).HOOKS)
    return hooks


def register() -> bool:
    """Register our hooks with SGLang's ``HookRegistry``; return whether the plugin is active."""
    installed = _installed_sglang_version()
    if installed != REQUIRED_SGLANG_VERSION:
        logger.error(
            "sglang-dflash-pp is inactive: it requires sglang==%s, found %s. "
            "Install the pinned release (pip install sglang==%s) or uninstall sglang-dflash-pp.",
            REQUIRED_SGLANG_VERSION,
            installed,
            REQUIRED_SGLANG_VERSION,
        )
        return False
    if registered_hooks():
        return True  # a second call in the same process (tests, Engine + CLI)

    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    hooks = plugin_hooks()
    for h in hooks:
        HookRegistry.register(h.target, h.hook, HookType(h.hook_type))
    record_registered(hooks)
    logger.info("sglang-dflash-pp registered %d hooks on sglang %s", len(hooks), installed)
    return True
