"""sglang-dflash-pp: DFlash speculative decoding on a pipeline-parallel PD prefill server,
with head-aware draft-KV transfer over Mooncake, as a plugin for stock ``sglang==0.5.23``.

Importing this package imports nothing from sglang; the hooks are registered by
:func:`sglang_dflash_pp.plugin.register`, which SGLang calls through the
``sglang.srt.plugins`` entry point in every server process.
"""

REQUIRED_SGLANG_VERSION = "0.5.23"

__version__ = "0.1.0"
