"""``sglang-dflash-pp install``: apply the series to this environment's sglang."""

from __future__ import annotations

from sglang_dflash_pp.tools.exit_codes import EXIT_OK


def add_parser(sub) -> None:
    p = sub.add_parser(
        "install",
        help="apply the patch series to the sglang installed in this environment",
        description="Apply the patch series to the installed sglang, in place, from the "
        "wheel's own files (kept on the first run); run again after editing the series.",
    )
    p.add_argument("--upto", help="stop after this PR (its number or file name)")


def run(parser, args) -> int:
    from sglang_dflash_pp.patch_series.install import install

    install(args.upto)
    return EXIT_OK
