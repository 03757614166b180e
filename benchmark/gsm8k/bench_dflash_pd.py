"""GSM8K C1/C8 benchmark against an SGLang server or router (PD DFlash or not).

    python benchmark/gsm8k/bench_dflash_pd.py --host ROUTER --port 8000 \\
        --data-path test.jsonl --train-path train.jsonl --num-questions 64 --parallel 1,8

Per concurrency level: accuracy (robust final-answer parser), invalid and truncated answers,
failures per request, wall time, output tokens/s and, from each response, the speculative
counters with the two acceptance definitions side by side (see ``metrics.py``). Writes
``records.jsonl``, ``summary.json``, ``summary.md`` and ``accept_length_hist.png`` to
``--output-dir``. Exits 1 when any request failed, unless ``--allow-failures``; 2 on bad input.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import List, Optional, Sequence

if __package__ in (None, ""):  # run as a script: make `benchmark.gsm8k` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    __package__ = "benchmark.gsm8k"

from benchmark.gsm8k import data as gsm_data  # noqa: E402
from benchmark.gsm8k.answer import parse_answer  # noqa: E402
from benchmark.gsm8k.client import APIS, API_NATIVE, Client  # noqa: E402
from benchmark.gsm8k.metrics import (  # noqa: E402
    DEFINITIONS,
    RequestResult,
    compare_to_baseline,
    summarize_level,
)
from benchmark.gsm8k import report  # noqa: E402

logger = logging.getLogger("gsm8k")

EXIT_OK, EXIT_FAILURES, EXIT_USAGE = 0, 1, 2


def parse_levels(text: str) -> List[int]:
    try:
        levels = [int(x) for x in str(text).replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--parallel takes a list like 1,8, got {text!r}") from None
    if not levels or any(n < 1 for n in levels):
        raise argparse.ArgumentTypeError(f"--parallel needs positive integers, got {text!r}")
    return levels


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="server or router host")
    p.add_argument("--port", type=int, default=30000, help="server or router port")
    p.add_argument("--base-url", default=None, help="overrides --host/--port, e.g. http://h:8000")
    p.add_argument("--api", choices=APIS, default=API_NATIVE,
                   help="native /generate (full meta_info), openai (/v1/completions) or "
                        "openai-chat (/v1/chat/completions); both OpenAI forms request "
                        "sglext.spec_tokens_details")
    p.add_argument("--model", default="default", help="model name sent to the OpenAI API")
    p.add_argument("--data-path", default="test.jsonl", help="GSM8K test jsonl (local file)")
    p.add_argument("--train-path", default=None,
                   help="jsonl the few-shot examples come from (GSM8K train). Default: the "
                        "--data-path file, as upstream does; the overlap is then reported")
    p.add_argument("--num-questions", type=int, default=200, help="first N questions of --data-path")
    p.add_argument("--num-shots", type=int, default=5, help="few-shot examples (first K of --train-path)")
    p.add_argument("--parallel", type=parse_levels, default=[1, 8],
                   help="concurrency levels, run in order, e.g. 1,8")
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--output-dir", default="gsm8k_results", help="where the outputs go")
    p.add_argument("--tag", default=None, help="name of this run in the outputs")
    p.add_argument("--baseline", default=None,
                   help="summary.json of a no-speculation run of the same questions: adds speedup "
                        "and accuracy delta")
    p.add_argument("--flush-cache", action="store_true",
                   help="POST /flush_cache before every level, so no level reuses the previous "
                        "level's prefix cache")
    p.add_argument("--allow-failures", action="store_true",
                   help="exit 0 even if requests failed (they are still counted and reported)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def run_level(client: Client, prompts, questions, level: int, overlap: set, writer,
              progress: bool) -> tuple:
    from tqdm import tqdm

    results: List[RequestResult] = []
    bar = tqdm(total=len(questions), desc=f"C{level}", unit="req", disable=not progress,
               file=sys.stderr, dynamic_ncols=True)
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=level) as pool:
        futures = {pool.submit(client.generate, prompts[q.qid]): q for q in questions}
        for fut in as_completed(futures):
            q = futures[fut]
            reply = fut.result()
            result = RequestResult(
                qid=q.qid,
                level=level,
                gold=q.gold,
                question=q.question,
                overlap=q.qid in overlap,
                text=reply.text,
                finish_reason=reply.finish_reason,
                completion_tokens=reply.completion_tokens,
                prompt_tokens=reply.prompt_tokens,
                latency_s=reply.latency_s,
                spec=reply.spec,
                failure=reply.failure,
                failure_detail=reply.failure_detail,
                http_status=reply.http_status,
                meta=reply.meta,
            )
            if result.ok:
                result.parsed = parse_answer(reply.text)
            results.append(result)
            writer.write(result)
            bar.update(1)
            bar.set_postfix(failed=sum(not r.ok for r in results), correct=sum(r.correct for r in results))
    wall = time.perf_counter() - start
    bar.close()
    results.sort(key=lambda r: r.qid)
    return results, wall


def main(argv: Optional[Sequence[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = build_parser().parse_args(argv)
    base_url = args.base_url or f"http://{args.host}:{args.port}"
    train_path = args.train_path or args.data_path
    try:
        questions = gsm_data.load_questions(args.data_path, args.num_questions)
        shots = gsm_data.read_jsonl(train_path)[: args.num_shots]
    except (OSError, ValueError) as e:
        logger.error("cannot read GSM8K data: %s (see benchmark/gsm8k/README.md to fetch it)", e)
        return EXIT_USAGE
    if not questions:
        logger.error("no questions in %s", args.data_path)
        return EXIT_USAGE
    if len(shots) < args.num_shots:
        logger.error("%s has %d examples, --num-shots is %d", train_path, len(shots), args.num_shots)
        return EXIT_USAGE
    baseline = None
    if args.baseline:
        import json

        try:
            with open(args.baseline, encoding="utf-8") as f:
                baseline = json.load(f)
        except (OSError, ValueError) as e:
            logger.error("cannot read --baseline %s: %s", args.baseline, e)
            return EXIT_USAGE

    block = gsm_data.few_shot_block(shots)
    prompts = {q.qid: gsm_data.build_prompt(block, q) for q in questions}
    overlap = set(gsm_data.few_shot_overlap(questions, shots))
    if overlap:
        logger.warning("questions %s are also few-shot examples; results are reported with and "
                       "without them", sorted(overlap))

    os.makedirs(args.output_dir, exist_ok=True)
    client = Client(base_url, api=args.api, model=args.model, max_new_tokens=args.max_new_tokens,
                    stop=gsm_data.STOP, timeout_s=args.request_timeout)
    config = {
        "tag": args.tag,
        "base_url": base_url,
        "api": args.api,
        "model": args.model if args.api != API_NATIVE else None,
        "data_path": os.path.abspath(args.data_path),
        "train_path": os.path.abspath(train_path),
        "num_questions_requested": args.num_questions,
        "num_questions_evaluated": len(questions),
        "num_shots": args.num_shots,
        "few_shot_sha": hashlib.sha256(block.encode()).hexdigest()[:16],
        "question_set_sha": gsm_data.question_set_sha(questions),
        "levels": args.parallel,
        "max_new_tokens": args.max_new_tokens,
        "temperature": 0.0,
        "stop": gsm_data.STOP,
        "request_timeout_s": args.request_timeout,
        "flush_cache": args.flush_cache,
    }
    writer = report.RecordWriter(os.path.join(args.output_dir, report.RECORDS))
    levels, accept_lengths = {}, {}
    try:
        for level in args.parallel:
            if args.flush_cache and not client.flush_cache():
                logger.warning("POST /flush_cache failed before C%d", level)
            results, wall = run_level(client, prompts, questions, level, overlap, writer,
                                      progress=not args.no_progress)
            levels[str(level)] = summarize_level(results, wall)
            accept_lengths[str(level)] = [r.spec.accept_length for r in results if r.ok and r.spec]
            lv = levels[str(level)]
            logger.info(
                "C%d: accuracy %d/%d, invalid %d, truncated %d, failed %d, wall %.2f s, "
                "output %.2f tok/s, accept length weighted %s / per-request mean %s",
                level, lv["correct"], lv["questions"], lv["invalid"], lv["truncated"], lv["failed"],
                wall, lv["output_tokens_per_s"], report.fmt(lv["spec"]["accept_length_verify_weighted"]),
                report.fmt(lv["spec"]["accept_length_per_request_mean"]),
            )
    finally:
        writer.close()

    failed = sum(lv["failed"] for lv in levels.values())
    summary = {
        "config": config,
        "definitions": DEFINITIONS,
        "few_shot": {
            "source": os.path.abspath(train_path),
            "num_shots": args.num_shots,
            "questions": [s["question"] for s in shots],
            "overlapping_qids": sorted(overlap),
        },
        "levels": levels,
        "failed_requests_total": failed,
        "allow_failures": args.allow_failures,
    }
    status = EXIT_FAILURES if failed and not args.allow_failures else EXIT_OK
    if baseline is not None:
        try:
            summary["baseline_comparison"] = compare_to_baseline(summary, baseline)
        except ValueError as e:
            logger.error("--baseline: %s", e)
            summary["baseline_comparison"] = {"error": str(e)}
            status = EXIT_USAGE
    summary["exit_status"] = status
    report.write_json(os.path.join(args.output_dir, report.SUMMARY), summary)
    if "error" in (summary.get("baseline_comparison") or {}):
        summary.pop("baseline_comparison")
    table = report.markdown(summary)
    with open(os.path.join(args.output_dir, report.TABLE), "w", encoding="utf-8") as f:
        f.write(table)
    report.histogram_png(os.path.join(args.output_dir, report.HISTOGRAM), accept_lengths, levels,
                         title=args.tag or base_url)
    print(table)
    if failed:
        logger.error("%d request(s) failed (per request in %s); %s", failed,
                     os.path.join(args.output_dir, report.RECORDS),
                     "exit 0 because of --allow-failures" if args.allow_failures else "exit 1")
    return status


if __name__ == "__main__":
    sys.exit(main())
