"""``sglang-dflash-pp check``: its arguments, and the exit code of its report.

The prefill's launch arguments come from ``--example`` (packaged config stand-ins, so it runs on
a machine with no GPU and no checkpoint), from what follows ``--``, or both: launch arguments
after an example are appended to its own, so argparse's last-wins rule lets them override it.
"""

from __future__ import annotations

import json

from sglang_dflash_pp.tools import examples
from sglang_dflash_pp.tools.exit_codes import EXIT_MISMATCH, EXIT_OK, EXIT_REFUSED

# What follows ``--`` is the prefill's launch command line.
TAKES_LAUNCH_ARGUMENTS = True


def add_parser(sub) -> None:
    p = sub.add_parser(
        "check",
        allow_abbrev=False,  # launch arguments share names with ours: no prefix may match one
        help="topology report and startup refusals of a DFLASH P/D deployment",
        description="Resolve the prefill's launch arguments (after '--') with sglang's ServerArgs; "
        "report its PP stages, draft KV transfer and every refusal startup would raise.",
        epilog="exit codes: 0 accepted, 2 usage, 3 refused, 4 the draft does not match its "
        "target. Example: sglang-dflash-pp check --example kimi-k3",
    )
    p.add_argument("--example", choices=sorted(examples.NAMES), help="a packaged deployment")
    p.add_argument("--decode-tp-size", type=int, help="D attention TP (required without --example)")
    p.add_argument("--prompt-tokens", type=int, help="prompt length per request (default 4096)")
    p.add_argument("--page-size", type=int, help="P and D --page-size")
    p.add_argument("--prefill-rank", type=int, default=0, help="the P rank whose writes are shown")
    p.add_argument("--link-gbps", type=float, default=50.0,
                   help="GB/s of a prefill rank's link, for the transfer time per stage (50)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--verbose", action="store_true", help="keep sglang's INFO logs (stderr)")


def run(parser, args) -> int:
    from sglang_dflash_pp.tools.check import CheckInputs, UsageError, run_check
    from sglang_dflash_pp.tools.check_text import render
    from sglang_dflash_pp.tools.resolve import launch_argv

    launch = [a for a in args.rest or [] if a != "--"]
    decode_tp, tokens, label = args.decode_tp_size, args.prompt_tokens, "prefill launch arguments"
    if args.example:
        ex = examples.load(args.example)
        launch = ex.prefill_argv() + launch
        decode_tp, tokens = decode_tp or ex.decode_tp_size, tokens or ex.prompt_tokens
        label = f"example {ex.name} ({ex.description})"
    if not launch or not decode_tp:
        parser.error("check: give --example, or the prefill's launch arguments after '--' and "
                     "--decode-tp-size (the decode's attention TP)")
    if args.page_size:
        launch += ["--page-size", str(args.page_size)]
    inputs = CheckInputs(launch_argv(launch), decode_tp, tokens or 4096, args.prefill_rank, label,
                         args.link_gbps)
    try:
        report = run_check(inputs, verbose=args.verbose)
    except UsageError as e:
        parser.error(f"check: {e}")
    print(json.dumps(report, indent=1) if args.json else render(report))
    if not report["accepted"]:
        return EXIT_REFUSED
    return EXIT_OK if report.get("draft_matches_target", True) else EXIT_MISMATCH
