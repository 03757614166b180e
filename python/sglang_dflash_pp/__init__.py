"""sglang-dflash-pp: the tools around the DFLASH x PP patch series for SGLang.

The change itself is the series (``series/``, the files it adds under ``python/sglang/``); this
package applies it (``patch_series``) and checks a deployment against it (``tools``). Importing
it imports nothing from sglang.
"""

# The sglang release the series is written against (its anchors, the CI's wheel).
SGLANG_VERSION = "0.5.23"

__version__ = "0.2.0"
