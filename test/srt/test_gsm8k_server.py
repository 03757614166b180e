"""The GSM8K benchmark CLI against a real CPU SGLang server (``python -m sglang.launch_server``
with a tiny random Llama, cpu-harness.md item 5): every request answered, every metric computed
from the real responses, every output written; the OpenAI-compatible APIs; the baseline
comparison; and a server killed mid-run giving counted failures and a non-zero exit.

This server is not speculative, so these tests also prove that the speculative metrics are
reported as "n/a" rather than invented. The acceptance figures of a real DFLASH run (through a
PP2 prefill, checked against a closed form) are in test/e2e/test_constructed_acceptance.py; the
acceptance definitions on fixed inputs in test_gsm8k_metrics.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmark.gsm8k.answer import parse_answer  # noqa: E402

CLI = os.path.join(REPO, "benchmark", "gsm8k", "bench_dflash_pd.py")

QUESTIONS = [
    ("Janet has 3 apples and buys 4 more. How many apples does she have?", "3+4=<<3+4=7>>7\n#### 7"),
    ("A box holds 12 eggs. How many eggs are in 3 boxes?", "12*3=<<12*3=36>>36\n#### 36"),
    ("Tom had 1,000 dollars and spent 250. How much is left?", "1000-250=<<1000-250=750>>750\n#### 750"),
    ("A car drives 60 miles per hour for 2 hours. How far does it go?", "60*2=<<60*2=120>>120\n#### 120"),
    ("Sam reads 15 pages a day. How many pages in a week?", "15*7=<<15*7=105>>105\n#### 105"),
    ("There are 9 birds and 4 fly away. How many remain?", "9-4=<<9-4=5>>5\n#### 5"),
]
TRAIN = [
    ("Mia has 2 cats and 3 dogs. How many pets does she have?", "2+3=<<2+3=5>>5\n#### 5"),
    # the same text as test question 2, with other spacing and case: an overlap
    ("tom had 1,000 dollars   and spent 250.  How much is LEFT?", "1000-250=750\n#### 750"),
]
MAX_NEW_TOKENS = 12


def _write_jsonl(path, rows):
    with open(path, "w") as f:
        for q, a in rows:
            f.write(json.dumps({"question": q, "answer": a}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def gsm8k_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gsm8k_data")
    return _write_jsonl(root / "test.jsonl", QUESTIONS), _write_jsonl(root / "train.jsonl", TRAIN)


def _run(server_url, out_dir, test_path, train_path, *extra, timeout=300):
    port = server_url.rsplit(":", 1)[1]
    cmd = [
        sys.executable, CLI, "--host", "127.0.0.1", "--port", port,
        "--data-path", test_path, "--train-path", train_path,
        "--num-shots", "2", "--max-new-tokens", str(MAX_NEW_TOKENS),
        "--output-dir", str(out_dir), *extra,
    ]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)


def _records(out_dir):
    with open(os.path.join(out_dir, "records.jsonl")) as f:
        return [json.loads(line) for line in f]


def _summary(out_dir):
    with open(os.path.join(out_dir, "summary.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def native_run(cpu_server_factory, gsm8k_files, tmp_path_factory):
    server = cpu_server_factory.ensure_running()
    out = tmp_path_factory.mktemp("native_run")
    proc = _run(server.base_url, out, *gsm8k_files, "--num-questions", "6", "--parallel", "1,2",
                "--tag", "cpu-native")
    return proc, str(out)


def test_native_run_answers_every_request_and_computes_metrics_from_responses(native_run):
    proc, out = native_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "C1: 100%" in proc.stderr and "6/6" in proc.stderr  # the progress bar ran
    records = _records(out)
    summary = _summary(out)
    assert sorted((r["level"], r["qid"]) for r in records) == [(lv, q) for lv in (1, 2) for q in range(6)]
    for r in records:
        assert r["ok"] and r["failure"] is None and r["http_status"] == 200, r
        assert r["output"].strip()
        meta = r["meta"]
        # every metric input is the server's own field, not ours
        assert r["completion_tokens"] == meta["completion_tokens"] and 1 <= r["completion_tokens"] <= MAX_NEW_TOKENS
        assert r["prompt_tokens"] == meta["prompt_tokens"] > 0
        assert r["finish_reason"] == meta["finish_reason"]["type"]
        assert r["truncated"] == (meta["finish_reason"]["type"] == "length")
        if r["truncated"]:
            assert r["completion_tokens"] == MAX_NEW_TOKENS
        parsed = parse_answer(r["output"])
        assert r["parsed"] == parsed.as_json() and r["invalid"] == (parsed.value is None)
        assert r["correct"] == (r["parsed"] == r["gold"])
        assert r["overlaps_few_shot"] == (r["qid"] == 2)
        # a non-speculative server sends no spec_* field, and the record says n/a
        assert not any(k.startswith("spec_") for k in meta)
        assert r["spec"] == "n/a"
    assert summary["few_shot"]["overlapping_qids"] == [2]
    assert summary["failed_requests_total"] == 0 and summary["exit_status"] == 0
    for level in ("1", "2"):
        lv = summary["levels"][level]
        recs = [r for r in records if r["level"] == int(level)]
        assert lv["questions"] == lv["answered"] == 6 and lv["failed"] == 0
        assert lv["correct"] == sum(r["correct"] for r in recs)
        assert lv["accuracy"] == pytest.approx(lv["correct"] / 6)
        assert lv["invalid"] == sum(r["invalid"] for r in recs)
        assert lv["truncated"] == sum(r["truncated"] for r in recs)
        assert lv["output_tokens"] == sum(r["completion_tokens"] for r in recs) > 0
        assert lv["wall_time_s"] > 0
        assert lv["output_tokens_per_s"] == pytest.approx(lv["output_tokens"] / lv["wall_time_s"])
        assert lv["wall_time_s"] >= max(r["latency_s"] for r in recs)
        spec = lv["spec"]
        assert spec["requests_with_spec_fields"] == 0 and spec["requests_without_spec_fields"] == 6
        assert spec["accept_length_verify_weighted"] == spec["accept_length_per_request_mean"] == "n/a"
        assert spec["accept_rate_weighted"] == spec["proposals"] == "n/a"
        rest = lv["without_few_shot_overlap"]
        assert rest["questions"] == 5
        assert rest["correct"] == sum(r["correct"] for r in recs if r["qid"] != 2)
    table = open(os.path.join(out, "summary.md")).read()
    assert "| accept length, verify-step-weighted | n/a | n/a |" in table
    assert "| accept length, per-request mean | n/a | n/a |" in table
    assert "| failed requests | 0 | 0 |" in table
    assert table.strip() in proc.stdout
    png = open(os.path.join(out, "accept_length_hist.png"), "rb").read()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("api", ["openai", "openai-chat"])
def test_openai_compatible_apis(cpu_server, gsm8k_files, tmp_path, api):
    proc = _run(cpu_server.base_url, tmp_path, *gsm8k_files, "--api", api, "--num-questions", "3",
                "--parallel", "2", "--no-progress")
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = _records(tmp_path)
    assert len(records) == 3
    for r in records:
        assert r["ok"] and r["output"].strip()
        usage = r["meta"]["usage"]
        assert r["completion_tokens"] == usage["completion_tokens"] > 0
        assert r["finish_reason"] in ("stop", "length")
        assert r["meta"]["sglext"] is None and r["spec"] == "n/a"  # asked for, not sent
    lv = _summary(tmp_path)["levels"]["2"]
    assert lv["answered"] == 3 and lv["spec"]["accept_length_verify_weighted"] == "n/a"
    assert lv["output_tokens"] == sum(r["completion_tokens"] for r in records)


def test_baseline_comparison_against_a_real_run(native_run, cpu_server, gsm8k_files, tmp_path):
    _, base_out = native_run
    baseline = os.path.join(base_out, "summary.json")
    proc = _run(cpu_server.base_url, tmp_path / "run", *gsm8k_files, "--num-questions", "6",
                "--parallel", "2", "--baseline", baseline, "--flush-cache", "--no-progress")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours, base = _summary(tmp_path / "run"), _summary(base_out)
    cmp = ours["baseline_comparison"]["levels"]["2"]
    assert cmp["speedup_output_tokens_per_s"] == pytest.approx(
        ours["levels"]["2"]["output_tokens_per_s"] / base["levels"]["2"]["output_tokens_per_s"]
    )
    assert cmp["speedup_wall_time"] == pytest.approx(
        base["levels"]["2"]["wall_time_s"] / ours["levels"]["2"]["wall_time_s"]
    )
    assert cmp["accuracy_delta"] == pytest.approx(ours["levels"]["2"]["accuracy"] - base["levels"]["2"]["accuracy"])
    assert 0 <= cmp["identical_output_text"] <= 6
    assert "Against baseline" in open(tmp_path / "run" / "summary.md").read()
    # A baseline of other questions is refused (exit 2), not compared.
    proc = _run(cpu_server.base_url, tmp_path / "other", *gsm8k_files, "--num-questions", "1",
                "--parallel", "1", "--baseline", baseline, "--no-progress")
    assert proc.returncode == 2 and "different question set" in proc.stderr


def test_server_killed_mid_run_gives_counted_failures_and_nonzero_exit(
    cpu_server_factory, gsm8k_files, tmp_path
):
    """Last in this module on purpose: it kills the session's server (a later user restarts it)."""
    server = cpu_server_factory.ensure_running()
    test_path, train_path = gsm8k_files
    many = _write_jsonl(tmp_path / "many.jsonl", QUESTIONS * 2)  # 12 questions
    port = server.base_url.rsplit(":", 1)[1]
    out = tmp_path / "out"
    cmd = [
        sys.executable, CLI, "--port", port, "--data-path", many, "--train-path", train_path,
        "--num-shots", "2", "--num-questions", "12", "--parallel", "1",
        "--max-new-tokens", "48", "--output-dir", str(out), "--no-progress",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        records_path = out / "records.jsonl"
        deadline = time.monotonic() + 120
        while not (records_path.exists() and records_path.read_text().count("\n") >= 2):
            assert proc.poll() is None, "benchmark finished before the server could be killed"
            assert time.monotonic() < deadline, "no request answered within 120 s"
            time.sleep(0.05)
        server.kill()  # SIGKILL to the launcher, scheduler and detokenizer
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, stderr[-3000:]
    records = _records(out)
    summary = _summary(out)
    lv = summary["levels"]["1"]
    assert len(records) == 12 and sorted(r["qid"] for r in records) == list(range(12))  # none dropped
    answered = [r for r in records if r["ok"]]
    failed = [r for r in records if not r["ok"]]
    assert len(answered) >= 2 and len(failed) >= 1
    assert lv["answered"] == len(answered) and lv["failed"] == len(failed) == summary["failed_requests_total"]
    assert lv["failures_by_kind"] == {"http_error": len(failed)}
    assert [f["qid"] for f in lv["failed_requests"]] == sorted(r["qid"] for r in failed)
    for r in failed:
        assert r["failure"] == "http_error" and "connection" in r["failure_detail"].lower()
        assert r["correct"] is False and r["parsed"] is None
    assert lv["accuracy"] == pytest.approx(sum(r["correct"] for r in records) / 12)
    assert summary["exit_status"] == 1
    assert f"{len(failed)} request(s) failed" in stderr
    # The same dead server with --allow-failures: every request counted as failed, exit 0.
    proc = subprocess.run(cmd[:-3] + ["--output-dir", str(tmp_path / "allowed"), "--no-progress",
                                      "--allow-failures"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    allowed = _summary(tmp_path / "allowed")
    assert allowed["failed_requests_total"] == 12 and allowed["levels"]["1"]["answered"] == 0
    assert allowed["levels"]["1"]["accuracy"] == 0.0
