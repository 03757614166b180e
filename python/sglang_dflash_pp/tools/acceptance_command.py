"""``sglang-dflash-pp acceptance``: compare a deployment's speculative acceptance with a
reference's, through their public ``/generate`` (a server or the PD router).

The same prompts go to both, greedy; the figures, the test and the verdict are
:mod:`sglang_dflash_pp.tools.acceptance`. Writes ``report.json`` (every figure, per request and
overall, with the test used) and ``acceptance.png`` (per-position acceptance of both) into
``--out``, and prints a table. Exit code 0 when the verdict is ``equal``, 1 otherwise.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import sys
import textwrap

from sglang_dflash_pp.tools.exit_codes import EXIT_FAILED, EXIT_OK

PROMPT_FIELDS = ("text", "prompt", "question")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "acceptance",
        help="compare a deployment's speculative acceptance with a reference's",
        description="Send the same prompts, greedy, to a reference (non-PD, or PD with a PP1 "
        "prefill) and to the deployment under test; compare acceptance per position.",
        epilog="exit codes: 0 equal, 1 drop or higher, 2 usage.",
    )
    p.add_argument("--reference", required=True, help="base URL of the reference")
    p.add_argument("--deployment", required=True, help="base URL of the deployment under test")
    p.add_argument("--prompts", required=True,
                   help="JSONL, one prompt per line in a 'text', 'prompt' or 'question' field "
                   "(a GSM8K test file works as it is)")  # fmt: skip
    p.add_argument("--num-prompts", type=int, help="the first N prompts (default: all)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--parallel", type=int, default=1, help="requests in flight per deployment")
    p.add_argument("--alpha", type=float, default=0.01, help="the test's level (default 0.01)")
    p.add_argument("--threshold", type=float, default=0.02,
                   help="relative change of the acceptance length still called equal")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--out", default="acceptance", help="directory for report.json and the plot")


def load_prompts(path: str, limit=None) -> list:
    prompts = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            field = next((k for k in PROMPT_FIELDS if k in row), None)
            if field is None:
                raise ValueError(f"{path}:{n}: no {' / '.join(PROMPT_FIELDS)} field")
            text = row[field]
            prompts.append(f"Question: {text}\nAnswer:" if field == "question" else text)
    return prompts[:limit] if limit else prompts


def generate(url: str, prompt: str, max_new_tokens: int, timeout: float) -> dict:
    import requests

    body = {"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens}}
    r = requests.post(url.rstrip("/") + "/generate", json=body, timeout=timeout)
    if r.status_code != 200:
        raise RuntimeError(f"POST {url}/generate -> {r.status_code}: {r.text[:500]}")
    return r.json()


def collect(url: str, name: str, prompts: list, args) -> list:
    from sglang_dflash_pp.tools.acceptance import Answer

    done, answers = 0, [None] * len(prompts)
    with concurrent.futures.ThreadPoolExecutor(max(1, args.parallel)) as pool:
        futures = {pool.submit(generate, url, p, args.max_new_tokens, args.timeout): i
                   for i, p in enumerate(prompts)}  # fmt: skip
        for future in concurrent.futures.as_completed(futures):
            answers[futures[future]] = Answer.from_response(future.result())
            done += 1
            print(f"\r{name}: {done}/{len(prompts)} answered", end="", file=sys.stderr)
    print(file=sys.stderr)
    return answers


def run(parser, args) -> int:
    from sglang_dflash_pp.tools import acceptance as acc

    prompts = load_prompts(args.prompts, args.num_prompts)
    if not prompts:
        parser.error(f"acceptance: {args.prompts} holds no prompt")
    ref = collect(args.reference, "reference", prompts, args)
    dep = collect(args.deployment, "deployment", prompts, args)
    summaries = dict(reference=acc.summarize(ref), deployment=acc.summarize(dep))
    comparison = acc.compare(summaries["reference"], summaries["deployment"], alpha=args.alpha,
                             threshold=args.threshold)  # fmt: skip
    rows = acc.per_request(ref, dep)
    report = dict(reference_url=args.reference, deployment_url=args.deployment,
                  prompts=args.prompts, requests=len(prompts), max_new_tokens=args.max_new_tokens,
                  outputs_equal=sum(r["outputs_equal"] for r in rows), **summaries,
                  comparison=comparison, per_request=rows)  # fmt: skip
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "report.json"), "w") as f:
        json.dump(report, f, indent=1)
    plot(report, os.path.join(args.out, "acceptance.png"))
    print(table(report))
    return EXIT_OK if comparison["verdict"] == "equal" else EXIT_FAILED


def table(report: dict) -> str:
    ref, dep, cmp = report["reference"], report["deployment"], report["comparison"]
    lines = [f"{'':44s} {'reference':>11s} {'deployment':>11s}"]
    for key, label in (
        ("verify_steps", "verify steps"),
        ("accept_length_verify_weighted", "accept length, verify-step weighted"),
        ("accept_length_per_request_mean", "accept length, per-request mean"),
        ("proposals_per_step", "draft proposals per verify step"),
        ("accepted_drafts_per_step", "accepted drafts per verify step"),
    ):
        lines.append(f"{label:44s} {_num(ref[key])} {_num(dep[key])}")
    lines.append(f"{'outputs equal':44s} {report['outputs_equal']:>11d} of {report['requests']}")
    lines += ["", "draft position  P(acc >= k) ref   dep   P(acc >= k | k-1) ref   dep   p-value"]
    for k, row in enumerate(cmp["positions"], 1):
        lines.append(f"{k:14d}  {_at(ref['position_acceptance'], k):13.3f} "
                     f"{_at(dep['position_acceptance'], k):5.3f}  {_rate(row['reference']):>21s} "
                     f"{_rate(row['deployment'])}  {row['p_value']:7.2g}")  # fmt: skip
    lines += ["", f"verdict: {cmp['text']}", f"test: {cmp['test']}"]
    return "\n".join(lines)


def _num(value) -> str:
    return f"{int(value):>11d}" if float(value).is_integer() else f"{value:>11.3f}"


def _rate(value) -> str:
    return "  n/a" if value is None else f"{value:5.3f}"


def _at(values: list, k: int) -> float:
    return values[k - 1] if k - 1 < len(values) else 0.0


def plot(report: dict, path: str) -> None:
    """Per-position acceptance of both deployments, the first parting position marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, style in (("reference", "o-"), ("deployment", "s--")):
        values = report[name]["position_acceptance"]
        ax.plot(range(1, len(values) + 1), values, style, label=name)
    parting = report["comparison"]["first_parting"]
    if parting is not None:
        ax.axvline(parting["position"], color="red", alpha=0.4,
                   label=f"first parting position ({parting['position']})")  # fmt: skip
    width = len(report["reference"]["position_acceptance"])
    ax.set(xlabel="draft position k", ylabel="verify steps accepting >= k drafts",
           ylim=(0, 1.05), xticks=range(1, width + 1))  # fmt: skip
    ax.set_title(textwrap.fill(report["comparison"]["text"], 80), fontsize=8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
