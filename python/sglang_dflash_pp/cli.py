"""``sglang-dflash-pp``: plan and verify a DFLASH P/D deployment.

* ``check``: resolve the prefill's launch arguments with sglang's real ``ServerArgs`` and this
  plugin, and report the PP partition, feature ownership, carry bytes, draft-KV geometry, writer
  map, per-request transfer counts and every startup refusal.
* ``preflight``: run the real draft-KV data path on CPU for a scaled-down geometry with the
  deployment's topology ratios (PP stages in separate processes over gloo, the real draft model,
  the real Mooncake engine over TCP on 127.0.0.1) and verify every decode byte.

Exit codes: 0 accepted / verified; 1 a verification or run failure; 2 a usage error;
3 the configuration would be refused at startup.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional

from sglang_dflash_pp.tools import examples
from sglang_dflash_pp.tools.exit_codes import EXIT_OK, EXIT_REFUSED

EPILOG = "exit codes: 0 accepted/verified, 1 verification or run failure, 2 usage, 3 refused"


def _check_parser(sub) -> None:
    p = sub.add_parser(
        "check",
        help="topology report and startup refusals for a DFLASH P/D deployment",
        description=(
            "Resolve the prefill (P) launch arguments with sglang's real ServerArgs and the "
            "plugin, then report the PP partition, the context features each stage owns, the "
            "carry bytes per token per hop, the draft-KV geometry of P and D, the writer map, "
            "one request's bytes and descriptors, and every refusal startup would raise. P "
            "arguments come from --example, from the shortcuts below, or verbatim after '--' "
            "(what you would pass to python -m sglang.launch_server)."
        ),
        epilog=EPILOG + ". Example: sglang-dflash-pp check --example kimi-k3",
    )
    p.add_argument(
        "--example",
        choices=sorted(examples.NAMES),
        help="a packaged deployment (config stand-ins, no weights)",
    )
    p.add_argument("--model-path", help="target checkpoint directory or its config.json")
    p.add_argument("--draft-model-path", help="DFlash draft directory or its config.json")
    p.add_argument("--tp-size", type=int, help="P --tp-size (shortcut form)")
    p.add_argument("--pp-size", type=int, help="P --pp-size (shortcut form)")
    p.add_argument(
        "--trust-remote-code", action="store_true", help="P --trust-remote-code (shortcut form)"
    )
    p.add_argument(
        "--decode-tp-size", type=int, help="D attention TP size (required unless --example)"
    )
    p.add_argument(
        "--prompt-tokens", type=int, help="prompt length for per-request counts (default 4096)"
    )
    p.add_argument(
        "--page-size", type=int, help="P and D --page-size (default: what resolution gives)"
    )
    p.add_argument("--device", help="device to resolve for (default cuda; no CUDA call is made)")
    p.add_argument(
        "--carry-dtype",
        choices=["float32", "bfloat16"],
        help="carry dtype to report (default: SGLANG_DFLASH_PP_CARRY_DTYPE, as servers read it)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    p.add_argument("--verbose", action="store_true", help="keep sglang's INFO logs (stderr)")


def _preflight_parser(sub) -> None:
    from sglang_dflash_pp.tools.preflight import add_arguments

    p = sub.add_parser(
        "preflight",
        help="run the draft-KV data path on CPU (gloo, real draft, real Mooncake) and verify it",
        description=(
            "Run the real DFLASH draft-KV data path on CPU for a scaled-down geometry with the "
            "deployment's topology ratios, and verify every decode byte against a "
            "single-process reference. Defaults: the Kimi-K3 example's P PP8 x TP4 -> D TP32, "
            "8 draft KV heads, hidden 64."
        ),
        epilog=EPILOG,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_arguments(p)


def _export_patches_parser(sub) -> None:
    from sglang_dflash_pp.tools.export_patches.command import add_parser

    add_parser(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sglang-dflash-pp",
        description="Plan and verify a DFLASH P/D deployment.",
        epilog=EPILOG,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _check_parser(sub)
    _preflight_parser(sub)
    _export_patches_parser(sub)
    return parser


def _split_launch_args(argv: List[str]):
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, None


def _check_inputs(parser, args, launch: Optional[List[str]]):
    from sglang_dflash_pp.tools.check import CheckInputs, example_inputs, strip_launch_prefix

    shortcuts = [args.model_path, args.draft_model_path, args.tp_size, args.pp_size]
    forms = sum([bool(args.example), launch is not None, any(x is not None for x in shortcuts)])
    if forms != 1:
        parser.error(
            "give exactly one of --example, the shortcut flags, or P launch arguments after '--'"
        )
    if args.example:
        return example_inputs(
            args.example,
            page_size=args.page_size,
            decode_tp=args.decode_tp_size,
            prompt_tokens=args.prompt_tokens,
            device=args.device,
        )
    if args.decode_tp_size is None:
        parser.error("--decode-tp-size is required (the decode server's attention TP)")
    if launch is not None:
        argv = strip_launch_prefix(launch)
        label = "prefill launch arguments"
    else:
        if not (args.model_path and args.draft_model_path):
            parser.error("the shortcut form needs --model-path and --draft-model-path")
        argv = [
            "--model-path", args.model_path,
            "--speculative-algorithm", "DFLASH",
            "--speculative-draft-model-path", args.draft_model_path,
            "--tp-size", str(args.tp_size or 1),
            "--pp-size", str(args.pp_size or 1),
            "--disaggregation-mode", "prefill",
            "--disaggregation-transfer-backend", "mooncake",
        ]  # fmt: skip
        if args.trust_remote_code:
            argv.append("--trust-remote-code")
        label = f"{args.model_path} with draft {args.draft_model_path}"
    if args.page_size:
        argv += ["--page-size", str(args.page_size)]
    if args.device:
        argv += ["--device", args.device]
    return CheckInputs(
        prefill_argv=argv,
        decode_tp=args.decode_tp_size,
        prompt_tokens=args.prompt_tokens or 4096,
        label=label,
    )


def _run_check(parser, args, launch) -> int:
    from sglang_dflash_pp.tools.check import run_check
    from sglang_dflash_pp.tools.check_text import render

    inputs = _check_inputs(parser, args, launch)
    inputs.carry_dtype = args.carry_dtype
    report = run_check(inputs, verbose=args.verbose)
    if args.json:
        print(json.dumps(report, indent=1, default=str))
    else:
        print(render(report))
    return EXIT_OK if report["accepted"] else EXIT_REFUSED


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    argv, launch = _split_launch_args(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "check":
        return _run_check(parser, args, launch)
    if args.command == "export-patches":
        from sglang_dflash_pp.tools.export_patches.command import run

        return run(parser, args)
    if launch is not None:
        parser.error("preflight takes no launch arguments after '--'")
    from sglang_dflash_pp.tools.preflight import run_preflight_cli

    return run_preflight_cli(args, argv[1:])
