#!/usr/bin/env bash
# GSM8K, 64 fixed questions, concurrency 1 then 8, through the router. Run from any host that
# reaches the router, in a checkout of sglang-dflash-pp.
#
#   GSM8K_TEST=/data/gsm8k/test.jsonl GSM8K_TRAIN=/data/gsm8k/train.jsonl \
#   ROUTER_ADDR=10.0.2.1 bash examples/kimi_k3/bench.sh
#
# Baseline: relaunch P and D with DFLASH=0, run this with TAG=baseline OUT=results/baseline,
# then run the DFLASH deployment with BASELINE=results/baseline/summary.json.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
require GSM8K_TEST GSM8K_TRAIN ROUTER_ADDR
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
TAG="${TAG:-kimi-k3-pd-dflash-p-tp4pp8ep4-d-tp32ep4}"
OUT="${OUT:-results/$TAG}"

ARGS=(
    # The router (router.sh); the benchmark could equally talk to a single server.
    --host "$ROUTER_ADDR"
    # Router port.
    --port "$ROUTER_PORT"
    # Native /generate: its meta_info carries every spec_* counter.
    --api native
    # GSM8K test split (local jsonl; benchmark/gsm8k/README.md says how to fetch it).
    --data-path "$GSM8K_TEST"
    # Few-shot examples from the train split, so no evaluated question is in the prompt (the
    # summary reports any overlap; GSM8K_TRAIN=$GSM8K_TEST reproduces upstream's prompt).
    --train-path "$GSM8K_TRAIN"
    # The fixed first 64 test questions.
    --num-questions 64
    # 5-shot, as SGLang's benchmark/gsm8k.
    --num-shots 5
    # C1, then C8.
    --parallel 1,8
    # Answers longer than 512 tokens count as truncated.
    --max-new-tokens 512
    # Flush the prefix cache before each level, so C8 does not reuse C1's prompts.
    --flush-cache
    # Name of the run in the outputs.
    --tag "$TAG"
    # records.jsonl, summary.json, summary.md, accept_length_hist.png.
    --output-dir "$OUT"
)
if [[ -n "${BASELINE:-}" ]]; then
    # summary.json of the DFLASH=0 run: adds speedup and accuracy delta.
    ARGS+=(--baseline "$BASELINE")
fi
launch "$PYTHON" "$REPO/benchmark/gsm8k/bench_dflash_pd.py" "${ARGS[@]}"
