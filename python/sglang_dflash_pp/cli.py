"""``sglang-dflash-pp``: the operator's commands around the patch series.

* ``check``: resolve a DFLASH prefill's launch arguments with the patched tree's real
  ``ServerArgs`` and report what each PP stage and each decode rank will do, or why startup
  would refuse it.
* ``acceptance``: compare a deployment's speculative acceptance with a reference's, position
  by position, through their public ``/generate``.
* ``check-draft``: check a DFlash draft's config and tokenizer against its target's.
* ``export-patches``: apply the series as commits onto an sglang tree (``git am``-able);
  ``update-patches``: write such a tree's commits back to ``patches/``.
* ``install``: apply the series to the sglang installed in this environment.

Each command lives in its own module, which gives ``add_parser(sub)`` and ``run(args)``; only
one that sets ``TAKES_LAUNCH_ARGUMENTS`` (``check``) is given arguments it does not define.
Exit codes: :mod:`sglang_dflash_pp.tools.exit_codes`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import List, Optional

COMMANDS = {
    "acceptance": "sglang_dflash_pp.tools.acceptance_command",
    "check": "sglang_dflash_pp.tools.check_command",
    "check-draft": "sglang_dflash_pp.tools.draft_target_command",
    "export-patches": "sglang_dflash_pp.patch_series.export_command",
    "install": "sglang_dflash_pp.patch_series.install_command",
    "update-patches": "sglang_dflash_pp.patch_series.export_command",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sglang-dflash-pp",
        description="DFLASH x pipeline parallelism on an SGLang PD prefill: the patch series "
        "and the deployment check.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for module in dict.fromkeys(COMMANDS.values()):  # a module may add several commands
        importlib.import_module(module).add_parser(sub)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    command = importlib.import_module(COMMANDS[args.command])
    if rest and not getattr(command, "TAKES_LAUNCH_ARGUMENTS", False):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.rest = rest
    return command.run(parser, args)
