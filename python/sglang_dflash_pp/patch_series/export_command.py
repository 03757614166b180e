"""``sglang-dflash-pp export-patches`` (the series as ``git am``-able commits on an sglang tree)
and ``update-patches`` (a tree's commits written back to ``patches/``).

Exit codes: 0 done (with ``--check``: every patch applies); 1 a patch did not apply (the ones
before it are committed and written; with ``--check``: some patch does not apply); 2 usage: not
an sglang tree in sglang's layout, a dirty tree, an exported ``HEAD``, no base tag.
"""

from __future__ import annotations

import sys

from sglang_dflash_pp.tools.exit_codes import EXIT_FAILED, EXIT_OK, EXIT_USAGE


def add_parser(sub) -> None:
    p = sub.add_parser(
        "export-patches",
        help="apply the patch series to an sglang tree as commits, and git format-patch them",
        description="Apply patches/ to an sglang tree with git am, one commit per PR, and "
        "write git format-patch of the commits and report.json to --out. --sglang-src is a "
        "tree in sglang's repository layout: a checkout, or a directory holding a copy of the "
        "installed package as python/sglang (a git repository is made there if it is in none; "
        "the tree as found is the base commit, tagged sglang-dflash-pp-base).",
        epilog="exit codes: 0 done, 1 a patch did not apply (--check: some patch does not "
        "apply), 2 usage",
    )
    p.add_argument("--sglang-src", required=True, metavar="DIR",
                   help="the root holding python/sglang (a checkout or a copy), or that dir")
    p.add_argument("--out", metavar="DIR", help="where the patches and report.json go")
    p.add_argument("--upto", metavar="PR", help="stop after this patch (its number or name)")
    p.add_argument("--check", action="store_true",
                   help="only report which patches apply to the tree (another sglang "
                   "release, say), naming each failing hunk; writes nothing")
    u = sub.add_parser(
        "update-patches",
        help="write an exported tree's commits back to patches/ (after changing the series)",
        description="git format-patch the commits of --sglang-src since its base tag "
        "(sglang-dflash-pp-base, set by export-patches) into patches/, replacing the series.",
    )
    u.add_argument("--sglang-src", required=True, metavar="DIR",
                   help="a tree export-patches made, with the series' commits edited")


def run(parser, args) -> int:
    from sglang_dflash_pp.patch_series.errors import ExportError

    try:
        if args.command == "update-patches":
            from sglang_dflash_pp.patch_series.export import update_patches

            update_patches(args.sglang_src)
            return EXIT_OK
        if not args.check and not args.out:
            parser.error("export-patches needs --out (or --check)")
        if args.check:
            from sglang_dflash_pp.patch_series.export import check

            results = check(args.sglang_src, args.upto)
            return EXIT_OK if all(why is None for _, why in results) else EXIT_FAILED
        from sglang_dflash_pp.patch_series.export import export

        _, failure = export(args.sglang_src, args.out, args.upto)
        return EXIT_OK if failure is None else EXIT_FAILED
    except ExportError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
