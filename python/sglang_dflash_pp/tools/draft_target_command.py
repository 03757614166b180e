"""``sglang-dflash-pp check-draft``: the static draft/target checks on two checkpoints.

``check`` runs the same checks on the deployment's launch arguments; this command needs only the
two checkpoint directories (configs and tokenizer files; no weights are read).
"""

from __future__ import annotations

import json

from sglang_dflash_pp.tools.exit_codes import EXIT_MISMATCH, EXIT_OK


def add_parser(sub) -> None:
    p = sub.add_parser(
        "check-draft",
        help="check a DFlash draft's config and tokenizer against its target's",
        description="Compare a DFlash draft checkpoint with its target: vocabulary and tokenizer, "
        "mask token, target_layer_ids (and PP stages), RoPE, block size, layer types and "
        "sliding window, hidden size, dtypes.",
        epilog="exit codes: 0 the draft matches its target, 2 usage, 4 it does not.",
    )
    p.add_argument("--target", required=True, help="the target checkpoint directory")
    p.add_argument("--draft", required=True, help="the DFlash draft checkpoint directory")
    p.add_argument("--tokenizer", help="the target's tokenizer directory (default: --target)")
    p.add_argument("--num-draft-tokens", type=int,
                   help="the servers' --speculative-num-draft-tokens, if set")
    p.add_argument("--context-length", type=int, help="the servers' --context-length, if set")
    p.add_argument("--pp-size", type=int, default=1, help="the prefill's --pp-size")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--json", action="store_true", help="print the findings as JSON")


def run(parser, args) -> int:
    from sglang_dflash_pp.tools.draft_target import as_dicts, check_draft, render

    findings = check_draft(
        args.target, args.draft, tokenizer_path=args.tokenizer,
        num_draft_tokens=args.num_draft_tokens, context_length=args.context_length,
        pp_size=args.pp_size, trust_remote_code=args.trust_remote_code,
    )
    refused = [f for f in findings if f.refused]
    if args.json:
        print(json.dumps(dict(matches_target=not refused, findings=as_dicts(findings)), indent=1))
    else:
        print(f"sglang-dflash-pp check-draft: draft {args.draft} against target {args.target}")
        print("\n".join(render(findings)))
        print(f"\n{len(refused)} refusal(s)." if refused else "\nNo refusal.")
    return EXIT_MISMATCH if refused else EXIT_OK
