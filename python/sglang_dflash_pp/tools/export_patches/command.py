"""The ``export-patches`` subcommand: arguments and exit codes.

Exit codes: 0 the series holds every finished PR (the export stopped at the first PR the
generator declares unfinished, or at ``--upto``), and with ``--verify`` every check passed; with
``--check``, every finished PR applies; 1 an edit did not apply (the message names the PR, the
file and the symbol; the series holds the PRs before it), a ``--verify`` check failed, or with
``--check`` some PR does not apply; 2 a usage error (not an sglang tree, uncommitted changes).
"""

from __future__ import annotations

import json

from sglang_dflash_pp.tools.exit_codes import EXIT_FAILED, EXIT_OK, EXIT_USAGE

DESCRIPTION = (
    "Generate the change as an in-tree patch series: apply the PR stack of "
    "docs/upstream/README.md to an sglang tree one PR at a time, commit each with the PR's title "
    "and description (and the unit tests that move with it, under test/registered/), and write "
    "git format-patch of the result to --out. --sglang-src is a tree laid out as sglang's "
    "repository: a checkout of sglang (its root or its python/sglang; the series goes on top "
    "of HEAD), or a directory holding a copy of the installed wheel's package as python/sglang "
    "(a git repository is made there if it is in none; its tree as found is the base commit). "
    "Per PR it prints the files and lines changed in upstream code, in new files and in moved "
    "tests; an edit whose anchor is missing stops the export, naming the PR, the file and the "
    "symbol."
)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "export-patches",
        help="generate the change as an in-tree patch series on an sglang tree",
        description=DESCRIPTION,
        epilog=(
            "exit codes: 0 done, 1 an edit did not apply or a check failed, 2 usage (not an "
            "sglang tree in sglang's layout, a dirty tree). Example: mkdir -p /tmp/tree/python && "
            "cp -r $(python -c 'import sglang,os;print(os.path.dirname(sglang.__file__))') "
            "/tmp/tree/python/sglang && sglang-dflash-pp export-patches --sglang-src /tmp/tree "
            "--out /tmp/series --verify"
        ),
    )
    p.add_argument(
        "--sglang-src", required=True, metavar="DIR",
        help="the sglang tree to patch: a root holding python/sglang (a checkout, or a copy of "
        "the wheel's package put there), or that python/sglang directory",
    )
    p.add_argument("--out", metavar="DIR", help="where the patches and report.json go")
    p.add_argument("--upto", metavar="PR", help="stop after this PR (e.g. 3b)")
    p.add_argument(
        "--check",
        action="store_true",
        help="apply every finished PR in memory only, past failures, and report which apply "
        "and which anchors moved (for another sglang release); writes nothing",
    )
    p.add_argument(
        "--verify",
        action="store_true",
        help="after the export, import every prefix's touched modules, run each finished "
        "bug-fix PR's reproduction and pytest over the moved tests (test/registered/) on the "
        "patched tree, without any plugin (subprocesses)",
    )
    p.add_argument("--stack-doc", metavar="PATH", help="default: docs/upstream/README.md here")
    p.add_argument("--json", action="store_true", help="print the report as JSON on stdout")


def run(parser, args) -> int:
    try:
        import libcst  # noqa: F401
    except ImportError:
        print("error: export-patches needs libcst: pip install 'sglang-dflash-pp[export]'")
        return EXIT_USAGE
    from sglang_dflash_pp.tools.export_patches import generator
    from sglang_dflash_pp.tools.export_patches.errors import ExportError

    if not args.check and not args.out:
        parser.error("export-patches needs --out (or --check)")
    log = (lambda s: None) if args.json else print
    try:
        if args.check:
            results = generator.check(args.sglang_src, stack_doc=args.stack_doc, log=log)
            if args.json:
                rows = [r.__dict__ for r in results]
                print(json.dumps(rows, indent=1, default=lambda o: o.__dict__))
            return EXIT_OK if all(r.status != "does not apply" for r in results) else EXIT_FAILED
        report = generator.export(
            args.sglang_src, args.out, stack_doc=args.stack_doc, upto=args.upto, log=log
        )
        ok = report.stop.kind != "failed"
        if args.verify and report.prs:
            ok = _verify(report, log) and ok
        if args.json:
            print(json.dumps(report.to_json(), indent=1))
        return EXIT_OK if ok else EXIT_FAILED
    except ExportError as e:
        print(f"error: {e}")
        return EXIT_USAGE


def _verify(report, log) -> bool:
    from sglang_dflash_pp.tools.export_patches.generator import registry_entry
    from sglang_dflash_pp.tools.export_patches.verify import (
        run_moved_tests,
        run_repro,
        verify_prefixes,
    )

    checks = verify_prefixes(report.sglang_tree, report.prs, log=log)
    ok = all(c.ok for c in checks)
    for r in report.prs:
        bug = registry_entry(r.pr).bug
        if bug is None:
            continue
        out = run_repro(bug, report.sglang_tree)
        res = out["result"]
        wrong = sorted(k for k in res["observed"] if res["observed"][k] != res["expected"][k])
        clean = out["from_tree"] and not out["hooks"] and not out["plugin_modules"]
        log(f"PR {r.pr}: {bug}/repro.py on the patched tree: "
            + ("right answer" if not wrong else f"still differs in {', '.join(wrong)}")
            + ("" if clean else " (NOT the stock patched tree: plugin or other sglang seen)"))
        ok = ok and clean and set(wrong) <= set(registry_entry(r.pr).bug_unshown)
    moved = report.moved_tests
    if moved:
        run = run_moved_tests(report.root)
        want = sum(len(t) for t in moved.values())
        log(f"moved tests on the patched tree: {len(run.passed)} of {len(run.collected)} "
            f"collected passed ({want} test functions in {len(moved)} files moved)"
            + ("" if run.from_tree and not run.hooks and not run.plugin_modules
               else " (NOT the stock patched tree: plugin or other sglang seen)"))
        same = {p: sorted(n) for p, n in run.by_file().items()} == {
            p: sorted(n) for p, n in moved.items()
        }
        if not same:
            log(f"pytest collected {run.by_file()}, not the moved tests {moved}")
        if not run.ok:
            log(run.output)
        ok = ok and run.ok and same
    return ok
