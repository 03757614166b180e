"""``python -m sglang_dflash_pp``: the same as the ``sglang-dflash-pp`` console script."""

from sglang_dflash_pp.cli import main

raise SystemExit(main())
