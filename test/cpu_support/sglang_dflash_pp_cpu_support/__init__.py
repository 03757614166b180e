"""Test-only CPU support for sglang servers on a CPU (never shipped, never installed).

The end-to-end tests start real ``python -m sglang.launch_server`` processes with
``--device cpu``. Stock 0.5.23 reaches a few CUDA-only spots on that path when it serves DFLASH
or PD; this package bypasses exactly those, through sglang's own plugin mechanism, so that the
rest of the server (scheduler, PP event loops, PD bootstrap, Mooncake, the DFLASH workers, the
real models) runs unchanged.

How it gets loaded: the tests put ``test/cpu_support`` on ``PYTHONPATH`` of the server processes
they start. That directory holds this package and a ``*.dist-info`` whose ``entry_points.txt``
declares it in the ``sglang.srt.plugins`` group, so ``importlib.metadata`` discovers it like an
installed plugin. Nothing else sees it: it is not in the wheel, not in the venv, not on the
pytest process's path, and the patch series never imports it.

Each patch lives in :mod:`.patches` and names the stock symbol it bypasses, why that symbol cannot
run on a CPU, and why bypassing it does not touch what the tests prove. Every patch is inert on a
CUDA tensor or a non-cpu device.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_dflash_pp_cpu_support import collective_trace, interpreter
    from sglang_dflash_pp_cpu_support.patches import PATCHES, install_process_patches

    install_process_patches()
    collective_trace.install()
    interpreter.install()
    for patch in PATCHES:
        HookRegistry.register(patch.target, patch.hook, HookType(patch.hook_type))
    logger.info("sglang-dflash-pp CPU test support: %d hooks registered", len(PATCHES))
    # Instruments registered only where a test asked for them by their variable.
    from sglang_dflash_pp_cpu_support import idle_check_trace, kv_misplacement

    for instrument in (idle_check_trace, kv_misplacement):
        if os.environ.get(instrument.ENV):
            hooks = getattr(instrument, "HOOKS", None) or (
                (instrument.TARGET, instrument.HOOK, instrument.HOOK_TYPE),)
            for target, hook, hook_type in hooks:
                HookRegistry.register(target, hook, HookType(hook_type))
                logger.info("sglang-dflash-pp CPU test support: %s on %s", instrument.__name__,
                            target)
