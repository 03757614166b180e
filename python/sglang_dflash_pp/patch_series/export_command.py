"""``sglang-dflash-pp export-patches``: the series as ``git am``-able commits on an sglang tree.

Exit codes: 0 every PR committed (or, with ``--check``, every PR applies); 1 an edit did not
apply (the PRs before it are committed and written), or with ``--check`` some PR does not
apply; 2 usage: not an sglang tree in sglang's layout, a dirty tree, an exported ``HEAD``.
"""

from __future__ import annotations

import sys

from sglang_dflash_pp.tools.exit_codes import EXIT_FAILED, EXIT_OK, EXIT_USAGE


def add_parser(sub) -> None:
    p = sub.add_parser(
        "export-patches",
        help="write the patch series as commits on an sglang tree, and git format-patch them",
        description="Apply the PRs of series/ to an sglang tree one at a time, commit each with "
        "its title and description, and write git format-patch of the commits and report.json "
        "to --out. --sglang-src is a tree in sglang's repository layout: a checkout, or a "
        "directory holding a copy of the installed package as python/sglang (a git repository "
        "is made there if it is in none; the tree as found is the base commit).",
        epilog="exit codes: 0 done, 1 an edit did not apply (--check: some PR does not "
        "apply), 2 usage",
    )
    p.add_argument("--sglang-src", required=True, metavar="DIR",
                   help="the root holding python/sglang (a checkout or a copy), or that dir")
    p.add_argument("--out", metavar="DIR", help="where the patches and report.json go")
    p.add_argument("--upto", metavar="PR", help="stop after this PR (its number or file name)")
    p.add_argument("--check", action="store_true",
                   help="only report, in memory, which PRs apply and which anchors are "
                   "missing (for another sglang release); writes nothing")


def run(parser, args) -> int:
    from sglang_dflash_pp.patch_series.errors import ExportError

    if not args.check and not args.out:
        parser.error("export-patches needs --out (or --check)")
    try:
        if args.check:
            from sglang_dflash_pp.patch_series.export_check import check

            results = check(args.sglang_src, args.upto)
            return EXIT_OK if all(r.applies for r in results) else EXIT_FAILED
        from sglang_dflash_pp.patch_series.export import export

        _, failure = export(args.sglang_src, args.out, args.upto)
        return EXIT_OK if failure is None else EXIT_FAILED
    except ExportError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
