"""The GSM8K benchmark's pure parts on fixed, hand-checked inputs: the answer parser, both
acceptance definitions from sglang-shaped ``meta_info``, per-level aggregation, few-shot overlap,
baseline comparison, outputs, and the client's failure classification against local stub HTTP
servers (no SGLang needed)."""

from __future__ import annotations

import http.server
import json
import os
import socket
import sys
import threading
from fractions import Fraction

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmark.gsm8k import data as gsm_data  # noqa: E402
from benchmark.gsm8k import report  # noqa: E402
from benchmark.gsm8k.answer import format_number, gold_answer, parse_answer  # noqa: E402
from benchmark.gsm8k.client import API_NATIVE, API_OPENAI, API_OPENAI_CHAT, Client  # noqa: E402
from benchmark.gsm8k.metrics import (  # noqa: E402
    NA,
    RequestResult,
    compare_to_baseline,
    spec_counts,
    spec_summary,
    summarize_level,
)


# --- answer parser --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, value, source",
    [
        ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72", "72", "####"),
        ("#### 5\n\nThe next one: #### 9", "5", "####"),  # first #### is the answer
        ("#### -7", "-7", "####"),
        ("#### 1,000", "1000", "####"),
        ("#### $18.00", "18", "####"),
        ("So she has \\boxed{18} eggs left, 3 more than 15.", "18", "boxed"),
        ("The answer is $1,234.50.", "1234.5", "answer is"),
        ("Answer: 0.50 and then 7 more words", "0.5", "answer is"),
        ("He pays 3 * 4 = 12 dollars", "12", "last number"),
        ("the total is 18.", "18", "last number"),
        ("5-3 = 2", "2", "last number"),  # '-' after a digit is subtraction
        ("it costs -$5 in total", "-5", "last number"),
        ("version v1.2 says 7", "7", "last number"),  # digits glued to a word are not numbers
        ("half of them, 50%", "50", "last number"),
        ("no digits at all", None, None),
        ("", None, None),
    ],
)
def test_answer_parser(text, value, source):
    parsed = parse_answer(text)
    assert parsed.as_json() == value
    assert parsed.source == source
    assert parsed.valid == (value is not None)


def test_gold_and_number_formatting():
    assert gold_answer("3+4=<<3+4=7>>7\n#### 7") == 7
    assert gold_answer("... #### 1,250") == 1250
    with pytest.raises(ValueError, match="####"):
        gold_answer("no final line")
    assert format_number(Fraction(-1, 8)) == "-0.125"
    assert format_number(Fraction(21, 20)) == "1.05"
    assert format_number(Fraction(1, 3)) == "1/3"
    # 18, 18.0 and $18.00 are the same answer
    assert parse_answer("#### 18.0").value == parse_answer("so \\boxed{$18.00}").value == 18


# --- the two acceptance definitions ---------------------------------------------------------
# Three requests from a DFLASH decode server with 4 draft tokens per block (3 proposals per
# verify step), shaped as sglang 0.5.23's TokenizerManager._calculate_spec_decoding_metrics
# writes meta_info. completion_tokens = accepted drafts + one bonus per step + the prefill
# server's first token.
#   A: 4 steps accepting [3, 3, 2, 1] -> 9 correct, 12 proposed, 9 + 4 + 1 = 14 tokens (3.5/step)
#   B: 2 steps accepting [3, 3]       -> 6 correct,  6 proposed, 6 + 2 + 1 =  9 tokens (4.5/step)
#   C: 3 steps accepting [0, 0, 1]    -> 1 correct,  9 proposed, 1 + 3 + 1 =  5 tokens (5/3/step)
SPEC_META = [
    dict(completion_tokens=14, spec_verify_ct=4, spec_num_correct_drafts=9,
         spec_num_proposed_drafts=12, spec_accept_length=14 / 4, spec_accept_rate=9 / 12,
         spec_correct_drafts_histogram=[0, 1, 1, 2]),
    dict(completion_tokens=9, spec_verify_ct=2, spec_num_correct_drafts=6,
         spec_num_proposed_drafts=6, spec_accept_length=9 / 2, spec_accept_rate=1.0,
         spec_correct_drafts_histogram=[0, 0, 0, 2]),
    dict(completion_tokens=5, spec_verify_ct=3, spec_num_correct_drafts=1,
         spec_num_proposed_drafts=9, spec_accept_length=5 / 3, spec_accept_rate=1 / 9,
         spec_correct_drafts_histogram=[2, 1]),
]  # fmt: skip


def _result(qid, meta=None, *, text="#### 1", gold=1, finish="stop", failure=None, overlap=False,
            completion_tokens=None, latency=1.0):
    meta = meta or {}
    ct = completion_tokens if completion_tokens is not None else meta.get("completion_tokens", 10)
    r = RequestResult(qid=qid, level=8, gold=Fraction(gold), overlap=overlap, latency_s=latency)
    if failure:
        r.failure, r.failure_detail = failure, "stub"
        return r
    r.text, r.finish_reason, r.completion_tokens = text, finish, ct
    r.spec = spec_counts(meta, ct)
    r.parsed = parse_answer(text)
    return r


def test_acceptance_definitions_hand_checked():
    results = [_result(i, m) for i, m in enumerate(SPEC_META)]
    s = spec_summary(results)
    # verify-step-weighted: (14 + 9 + 5) / (4 + 2 + 3) = 28 / 9
    assert s["accept_length_verify_weighted"] == pytest.approx(28 / 9)
    # per-request mean: (3.5 + 4.5 + 5/3) / 3 = 29 / 9
    assert s["accept_length_per_request_mean"] == pytest.approx(29 / 9)
    assert s["accept_length_verify_weighted"] != pytest.approx(s["accept_length_per_request_mean"])
    assert s["accept_length_per_request_min"] == pytest.approx(5 / 3)
    assert s["accept_length_per_request_max"] == pytest.approx(4.5)
    # acceptance rate, weighted (16 / 27) and per-request mean ((3/4 + 1 + 1/9) / 3 = 67/108)
    assert s["accept_rate_weighted"] == pytest.approx(16 / 27)
    assert s["accept_rate_per_request_mean"] == pytest.approx(67 / 108)
    assert s["proposals"] == 27
    assert s["proposals_per_verify_step"] == pytest.approx(3.0)
    assert s["correct_drafts_per_verify_step"] == pytest.approx(16 / 9)
    assert s["sum_verify_ct"] == s["bonus_tokens"] == 9
    assert s["sum_completion_tokens"] == 28 and s["sum_correct_drafts"] == 16
    assert s["tokens_outside_verify"] == 3  # the prefill token of each of the 3 requests
    # summed histogram [2, 2, 1, 4] over 9 steps: >= 1 accepted 7/9, >= 2 5/9, >= 3 4/9
    assert s["correct_drafts_histogram"] == [2, 2, 1, 4]
    assert s["position_acceptance"] == pytest.approx([7 / 9, 5 / 9, 4 / 9])
    # our per-request value is exactly sglang's spec_accept_length
    assert s["server_accept_length_mean"] == pytest.approx(s["accept_length_per_request_mean"])
    assert s["requests_with_spec_fields"] == 3 and s["requests_without_spec_fields"] == 0


def test_requests_without_spec_fields_are_na_never_zero():
    plain = {"completion_tokens": 10, "finish_reason": {"type": "stop"}}
    assert spec_counts(plain, 10) is None
    assert spec_counts({"spec_verify_ct": 0, "completion_tokens": 1}, 1) is None
    s = spec_summary([_result(0, plain), _result(1, plain)])
    assert s["requests_with_spec_fields"] == 0 and s["requests_without_spec_fields"] == 2
    for key, value in s.items():
        if key.startswith("requests_"):
            continue
        assert value == NA, key
    # A mixed level: the request without fields is excluded, not counted as zero.
    mixed = spec_summary([_result(i, m) for i, m in enumerate(SPEC_META)] + [_result(9, plain)])
    assert mixed["accept_length_verify_weighted"] == pytest.approx(28 / 9)
    assert mixed["requests_without_spec_fields"] == 1


# --- per-level aggregation -----------------------------------------------------------------


def test_level_summary_counts_every_request():
    results = [
        _result(0, SPEC_META[0], text="so #### 1", overlap=True),  # correct, overlapping
        _result(1, SPEC_META[1], text="#### 2"),  # wrong
        _result(2, SPEC_META[2], text="no number", finish="length"),  # invalid and truncated
        _result(3, failure="http_error"),
        _result(4, failure="timeout"),
    ]
    lv = summarize_level(results, wall_time_s=4.0)
    assert lv["questions"] == 5 and lv["answered"] == 3
    assert lv["correct"] == 1 and lv["accuracy"] == pytest.approx(1 / 5)  # failures not dropped
    assert lv["invalid"] == 1 and lv["truncated"] == 1
    assert lv["failed"] == 2 and lv["failures_by_kind"] == {"http_error": 1, "timeout": 1}
    assert [f["qid"] for f in lv["failed_requests"]] == [3, 4]
    assert lv["output_tokens"] == 28 and lv["output_tokens_per_s"] == pytest.approx(7.0)
    assert lv["spec"]["accept_length_verify_weighted"] == pytest.approx(28 / 9)
    assert lv["overlapping_qids"] == [0]
    rest = lv["without_few_shot_overlap"]
    assert rest["questions"] == 4 and rest["correct"] == 0 and rest["failed"] == 2
    assert rest["accept_length_verify_weighted"] == pytest.approx((9 + 5) / (2 + 3))
    assert rest["accept_length_per_request_mean"] == pytest.approx((4.5 + 5 / 3) / 2)
    assert lv["answers"]["0"]["correct"] and lv["answers"]["3"]["parsed"] is None


def test_few_shot_overlap_and_prompt():
    rows = [
        {"question": "How many  legs do 2 cats have?", "answer": "2*4=8\n#### 8"},
        {"question": "What is 3+3?", "answer": "#### 6"},
    ]
    qs = [gsm_data.Question(i, r["question"], r["answer"], gold_answer(r["answer"])) for i, r in enumerate(rows)]
    shots = [{"question": "how many legs do 2 cats HAVE?", "answer": "#### 8"}, {"question": "x?", "answer": "#### 1"}]
    assert gsm_data.few_shot_overlap(qs, shots) == [0]
    block = gsm_data.few_shot_block(shots)
    assert block == "Question: how many legs do 2 cats HAVE?\nAnswer: #### 8\n\nQuestion: x?\nAnswer: #### 1\n\n"
    assert gsm_data.build_prompt(block, qs[1]).endswith("\n\nQuestion: What is 3+3?\nAnswer:")
    assert gsm_data.question_set_sha(qs) != gsm_data.question_set_sha(qs[:1])


def _summary(sha, levels):
    return {"config": {"question_set_sha": sha, "few_shot_sha": "f", "max_new_tokens": 512,
                       "api": "native", "tag": "t", "num_questions_evaluated": 2},
            "levels": levels}


def test_baseline_comparison():
    ours_level = summarize_level([_result(0, SPEC_META[0]), _result(1, SPEC_META[1], text="The answer is 3")], 2.0)
    base_level = summarize_level([_result(0, text="#### 1"), _result(1, text="#### 3", gold=3)], 5.0)
    ours = _summary("abc", {"8": ours_level})
    base = _summary("abc", {"8": base_level})
    cmp = compare_to_baseline(ours, base)["levels"]["8"]
    assert cmp["speedup_wall_time"] == pytest.approx(2.5)
    assert cmp["speedup_output_tokens_per_s"] == pytest.approx(
        ours_level["output_tokens_per_s"] / base_level["output_tokens_per_s"]
    )
    assert cmp["accuracy"] == 0.5 and cmp["baseline_accuracy"] == 1.0
    assert cmp["accuracy_delta"] == pytest.approx(-0.5)
    assert cmp["same_parsed_answer"] == 2 and cmp["identical_output_text"] == 1
    with pytest.raises(ValueError, match="different question set"):
        compare_to_baseline(ours, _summary("other", {"8": base_level}))


def test_markdown_and_histogram_from_fixed_results(tmp_path):
    results = [_result(i, m) for i, m in enumerate(SPEC_META)]
    lv = summarize_level(results, 3.0)
    summary = {
        "config": {"tag": "fixed", "base_url": "http://x", "num_questions_evaluated": 3,
                   "data_path": "t.jsonl", "num_shots": 5, "train_path": "tr.jsonl",
                   "api": "native", "max_new_tokens": 512},
        "levels": {"8": lv},
        "few_shot": {"overlapping_qids": []},
    }
    md = report.markdown(summary)
    assert "| accept length, verify-step-weighted | 3.1111 |" in md
    assert "| accept length, per-request mean | 3.2222 |" in md
    assert "| accept rate, weighted | 0.5926 |" in md
    assert "| proposals (draft tokens) | 27 |" in md
    assert "sum over requests of completion_tokens / sum over requests of spec_verify_ct" in md
    png = tmp_path / "h.png"
    report.histogram_png(str(png), {"8": [r.spec.accept_length for r in results]}, {"8": lv})
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


# --- client: response shapes and failure classification ------------------------------------


def test_client_reads_spec_fields_from_native_and_openai_shapes():
    meta = dict(SPEC_META[0], finish_reason={"type": "length", "length": 14}, prompt_tokens=50)
    native = Client("http://x", api=API_NATIVE).parse({"text": "#### 3", "meta_info": meta})
    assert native.failure is None and native.finish_reason == "length"
    assert native.spec.verify_ct == 4 and native.spec.accept_length == 3.5
    details = {k: v for k, v in SPEC_META[0].items() if k != "completion_tokens"}
    body = {"choices": [{"text": "#### 3", "finish_reason": "stop"}],
            "usage": {"completion_tokens": 14, "prompt_tokens": 50},
            "sglext": {"spec_tokens_details": details}}
    oa = Client("http://x", api=API_OPENAI).parse(body)
    assert oa.spec == native.spec and oa.finish_reason == "stop"
    chat = {"choices": [{"message": {"role": "assistant", "content": "#### 3"}, "finish_reason": "length"}],
            "usage": {"completion_tokens": 14}}
    no_ext = Client("http://x", api=API_OPENAI_CHAT).parse(chat)
    assert no_ext.failure is None and no_ext.spec is None  # reported as n/a
    empty = Client("http://x").parse({"text": "  ", "meta_info": {"completion_tokens": 1}})
    assert empty.failure == "empty_output"
    bad = Client("http://x").parse({"unexpected": 1})
    assert bad.failure == "malformed_response"
    aborted = Client("http://x").parse(
        {"text": "", "meta_info": {"completion_tokens": 0,
                                   "finish_reason": {"type": "abort", "message": "out of memory"}}}
    )
    assert aborted.failure == "aborted" and "out of memory" in aborted.failure_detail


class _StubHandler(http.server.BaseHTTPRequestHandler):
    status = 500
    body = b'{"error": "boom"}'

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(self.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


@pytest.fixture
def stub_http():
    servers = []

    def start(status, body):
        handler = type("H", (_StubHandler,), {"status": status, "body": json.dumps(body).encode()})
        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return f"http://127.0.0.1:{srv.server_address[1]}"

    yield start
    for srv in servers:
        srv.shutdown()
        srv.server_close()


def test_client_failure_kinds(stub_http):
    r = Client(stub_http(500, {"error": "boom"})).generate("q")
    assert r.failure == "http_error" and r.http_status == 500 and "boom" in r.failure_detail
    r = Client(stub_http(200, {"text": "", "meta_info": {"completion_tokens": 1}})).generate("q")
    assert r.failure == "empty_output" and r.http_status == 200
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    r = Client(f"http://127.0.0.1:{closed}").generate("q")
    assert r.failure == "http_error" and "connection failed" in r.failure_detail
    # accepts the connection, never answers
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        r = Client(f"http://127.0.0.1:{silent.getsockname()[1]}", timeout_s=0.5).generate("q")
    assert r.failure == "timeout"
