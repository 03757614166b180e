"""Per-request results and per-concurrency-level aggregation, including the two acceptance
definitions for speculative servers. Pure: no HTTP, no files.

What sglang 0.5.23 reports for a finished speculative request (``TokenizerManager.
_calculate_spec_decoding_metrics``; native ``meta_info``, and for the OpenAI-compatible API the
same names under ``sglext.spec_tokens_details`` when the request sets
``return_spec_tokens_details``). The keys are present only when the request had at least one
verify step:

* ``spec_verify_ct``            verify (target forward) steps of this request
* ``spec_num_correct_drafts``   draft tokens the target accepted, bonus token excluded
* ``spec_num_proposed_drafts``  ``spec_verify_ct * (speculative_num_draft_tokens - 1)``
* ``spec_accept_length``        ``completion_tokens / spec_verify_ct``
* ``spec_accept_rate``          ``spec_num_correct_drafts / spec_num_proposed_drafts``
* ``spec_correct_drafts_histogram``  index k: verify steps that accepted exactly k drafts
* ``completion_tokens``         output tokens (always present). On a PD decode server this
  includes the first token, which the prefill server sampled, so it is not a verify output.

The acceptance length is reported under two definitions, side by side and never mixed:

* **verify-step-weighted** = ``sum(completion_tokens) / sum(spec_verify_ct)`` over the requests
  of a level: tokens per verify step of the whole run. Long requests weigh more.
* **per-request mean** = ``mean(completion_tokens_r / spec_verify_ct_r)``: every request
  weighs the same, so short requests (where the extra prefill token and the final partial
  block count most) pull it away from the weighted value.

A field the server did not send (a non-speculative server, an OpenAI response without
``sglext``) is reported as ``"n/a"``, never as 0.
"""

from __future__ import annotations

import hashlib
import statistics
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Mapping, Optional, Sequence

from .answer import ParsedAnswer, format_number

NA = "n/a"

FAIL_HTTP = "http_error"  # non-2xx status, or the connection failed / was reset
FAIL_TIMEOUT = "timeout"
FAIL_EMPTY = "empty_output"  # 2xx, but no output text
FAIL_MALFORMED = "malformed_response"  # 2xx, but not a response this client understands
FAIL_ABORTED = "aborted"  # 2xx, but the server aborted the request (finish reason 'abort')
FAILURE_KINDS = (FAIL_HTTP, FAIL_TIMEOUT, FAIL_EMPTY, FAIL_MALFORMED, FAIL_ABORTED)

DEFINITIONS = {
    "accept_length_verify_weighted": (
        "sum over requests of completion_tokens / sum over requests of spec_verify_ct "
        "(tokens per verify step of the whole level)"
    ),
    "accept_length_per_request_mean": (
        "mean over requests of (completion_tokens / spec_verify_ct); equals the mean of "
        "sglang's per-request meta_info.spec_accept_length"
    ),
    "accept_rate_weighted": "sum(spec_num_correct_drafts) / sum(spec_num_proposed_drafts)",
    "accept_rate_per_request_mean": (
        "mean over requests of spec_num_correct_drafts / spec_num_proposed_drafts "
        "(sglang's meta_info.spec_accept_rate)"
    ),
    "proposals": "sum(spec_num_proposed_drafts) = sum(spec_verify_ct * (draft tokens - 1))",
    "bonus_tokens": "sum(spec_verify_ct): one target-sampled token per verify step",
    "tokens_outside_verify": (
        "sum(completion_tokens) - sum(spec_num_correct_drafts) - sum(spec_verify_ct); on a PD "
        "decode server about one per request (the prefill server's token)"
    ),
    "position_acceptance": (
        "entry k-1: fraction of verify steps that accepted at least k draft tokens, from the "
        "summed spec_correct_drafts_histogram"
    ),
    "accuracy": "correct / questions; a failed request counts as not correct",
    "invalid": "answered requests whose output holds no number",
    "truncated": "answered requests with finish reason 'length' (hit --max-new-tokens)",
    "output_tokens_per_s": "sum(completion_tokens) of answered requests / level wall time",
}


@dataclass(frozen=True)
class SpecCounts:
    """Speculative counters of one finished request, as the server reported them."""

    completion_tokens: int
    verify_ct: int
    num_correct_drafts: Optional[int] = None
    num_proposed_drafts: Optional[int] = None
    correct_drafts_histogram: Sequence[int] = ()
    server_accept_length: Optional[float] = None
    server_accept_rate: Optional[float] = None

    @property
    def accept_length(self) -> float:
        return self.completion_tokens / self.verify_ct

    @property
    def accept_rate(self) -> Optional[float]:
        if self.num_correct_drafts is None or not self.num_proposed_drafts:
            return None
        return self.num_correct_drafts / self.num_proposed_drafts

    def as_json(self) -> dict:
        return {
            "completion_tokens": self.completion_tokens,
            "spec_verify_ct": self.verify_ct,
            "spec_num_correct_drafts": _or_na(self.num_correct_drafts),
            "spec_num_proposed_drafts": _or_na(self.num_proposed_drafts),
            "spec_correct_drafts_histogram": list(self.correct_drafts_histogram) or NA,
            "accept_length": self.accept_length,
            "accept_rate": _or_na(self.accept_rate),
            "server_spec_accept_length": _or_na(self.server_accept_length),
            "server_spec_accept_rate": _or_na(self.server_accept_rate),
        }


def spec_counts(fields: Optional[Mapping[str, Any]], completion_tokens: Optional[int]):
    """:class:`SpecCounts` from a ``meta_info`` dict or an OpenAI ``spec_tokens_details`` dict;
    None when the request reports no verify step (non-speculative server, field absent)."""
    if not fields or completion_tokens is None:
        return None
    verify_ct = fields.get("spec_verify_ct")
    if not isinstance(verify_ct, (int, float)) or verify_ct <= 0:
        return None

    def _int(name):
        v = fields.get(name)
        return int(v) if isinstance(v, (int, float)) else None

    def _float(name):
        v = fields.get(name)
        return float(v) if isinstance(v, (int, float)) else None

    hist = fields.get("spec_correct_drafts_histogram") or ()
    return SpecCounts(
        completion_tokens=int(completion_tokens),
        verify_ct=int(verify_ct),
        num_correct_drafts=_int("spec_num_correct_drafts"),
        num_proposed_drafts=_int("spec_num_proposed_drafts"),
        correct_drafts_histogram=tuple(int(x) for x in hist),
        server_accept_length=_float("spec_accept_length"),
        server_accept_rate=_float("spec_accept_rate"),
    )


@dataclass
class RequestResult:
    """One question at one concurrency level: answered (``failure is None``) or failed."""

    qid: int
    level: int
    gold: Any  # Fraction
    overlap: bool = False
    text: Optional[str] = None
    finish_reason: Optional[str] = None
    completion_tokens: Optional[int] = None
    prompt_tokens: Optional[int] = None
    latency_s: Optional[float] = None
    parsed: Optional[ParsedAnswer] = None
    spec: Optional[SpecCounts] = None
    failure: Optional[str] = None  # one of FAILURE_KINDS
    failure_detail: Optional[str] = None
    http_status: Optional[int] = None
    meta: Optional[dict] = None  # what the server returned besides the text
    question: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.failure is None

    @property
    def correct(self) -> bool:
        return self.ok and self.parsed is not None and self.parsed.value == self.gold

    @property
    def invalid(self) -> bool:
        return self.ok and (self.parsed is None or self.parsed.value is None)

    @property
    def truncated(self) -> bool:
        return self.ok and self.finish_reason == "length"

    def as_json(self) -> dict:
        return {
            "level": self.level,
            "qid": self.qid,
            "question": self.question,
            "gold": format_number(self.gold),
            "ok": self.ok,
            "failure": self.failure,
            "failure_detail": self.failure_detail,
            "http_status": self.http_status,
            "output": self.text,
            "parsed": self.parsed.as_json() if self.parsed else None,
            "parse_source": self.parsed.source if self.parsed else None,
            "correct": self.correct,
            "invalid": self.invalid,
            "finish_reason": self.finish_reason,
            "truncated": self.truncated,
            "completion_tokens": self.completion_tokens,
            "prompt_tokens": self.prompt_tokens,
            "latency_s": self.latency_s,
            "overlaps_few_shot": self.overlap,
            "spec": self.spec.as_json() if self.spec else NA,
            "meta": self.meta,
        }


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _or_na(value):
    return NA if value is None else value


def _mean(values: Sequence[float]):
    return statistics.fmean(values) if values else NA


def spec_summary(results: Iterable[RequestResult]) -> Dict[str, Any]:
    """Both acceptance definitions and the counters behind them, over answered requests that
    reported speculative fields. Every value is ``"n/a"`` when none did."""
    answered = [r for r in results if r.ok]
    specs = [r.spec for r in answered if r.spec is not None]
    out: Dict[str, Any] = {
        "requests_with_spec_fields": len(specs),
        "requests_without_spec_fields": len(answered) - len(specs),
    }
    keys = (
        "accept_length_verify_weighted",
        "accept_length_per_request_mean",
        "accept_length_per_request_min",
        "accept_length_per_request_max",
        "accept_rate_weighted",
        "accept_rate_per_request_mean",
        "sum_completion_tokens",
        "sum_verify_ct",
        "sum_correct_drafts",
        "proposals",
        "proposals_per_verify_step",
        "correct_drafts_per_verify_step",
        "bonus_tokens",
        "tokens_outside_verify",
        "correct_drafts_histogram",
        "position_acceptance",
        "server_accept_length_mean",
    )
    if not specs:
        out.update({k: NA for k in keys})
        return out
    per_request = [s.accept_length for s in specs]
    sum_tokens = sum(s.completion_tokens for s in specs)
    sum_verify = sum(s.verify_ct for s in specs)
    out["accept_length_verify_weighted"] = sum_tokens / sum_verify
    out["accept_length_per_request_mean"] = statistics.fmean(per_request)
    out["accept_length_per_request_min"] = min(per_request)
    out["accept_length_per_request_max"] = max(per_request)
    out["sum_completion_tokens"] = sum_tokens
    out["sum_verify_ct"] = sum_verify
    out["bonus_tokens"] = sum_verify

    have_drafts = all(
        s.num_correct_drafts is not None and s.num_proposed_drafts is not None for s in specs
    )
    if have_drafts:
        correct = sum(s.num_correct_drafts for s in specs)
        proposed = sum(s.num_proposed_drafts for s in specs)
        out["sum_correct_drafts"] = correct
        out["proposals"] = proposed
        out["proposals_per_verify_step"] = proposed / sum_verify
        out["correct_drafts_per_verify_step"] = correct / sum_verify
        out["accept_rate_weighted"] = correct / proposed if proposed else NA
        rates = [s.accept_rate for s in specs if s.accept_rate is not None]
        out["accept_rate_per_request_mean"] = _mean(rates)
        out["tokens_outside_verify"] = sum_tokens - correct - sum_verify
    else:
        for k in (
            "sum_correct_drafts",
            "proposals",
            "proposals_per_verify_step",
            "correct_drafts_per_verify_step",
            "accept_rate_weighted",
            "accept_rate_per_request_mean",
            "tokens_outside_verify",
        ):
            out[k] = NA

    hists = [s.correct_drafts_histogram for s in specs if s.correct_drafts_histogram]
    if hists:
        width = max(len(h) for h in hists)
        total = [0] * width
        for h in hists:
            for k, n in enumerate(h):
                total[k] += n
        steps = sum(total)
        out["correct_drafts_histogram"] = total
        out["position_acceptance"] = [
            sum(total[j] for j in range(k, width)) / steps for k in range(1, width)
        ] if steps else NA
    else:
        out["correct_drafts_histogram"] = NA
        out["position_acceptance"] = NA
    server = [s.server_accept_length for s in specs if s.server_accept_length is not None]
    out["server_accept_length_mean"] = _mean(server)
    return out


def _core(results: Sequence[RequestResult]) -> Dict[str, Any]:
    total = len(results)
    answered = [r for r in results if r.ok]
    correct = sum(r.correct for r in results)
    failures: Dict[str, int] = {}
    for r in results:
        if not r.ok:
            failures[r.failure] = failures.get(r.failure, 0) + 1
    return {
        "questions": total,
        "answered": len(answered),
        "correct": correct,
        "accuracy": correct / total if total else NA,
        "invalid": sum(r.invalid for r in results),
        "truncated": sum(r.truncated for r in results),
        "failed": total - len(answered),
        "failures_by_kind": failures,
    }


def summarize_level(
    results: Sequence[RequestResult], wall_time_s: float
) -> Dict[str, Any]:
    """Everything reported for one concurrency level."""
    level = _core(results)
    answered = [r for r in results if r.ok]
    output_tokens = sum(r.completion_tokens or 0 for r in answered)
    level["output_tokens"] = output_tokens
    level["wall_time_s"] = wall_time_s
    level["output_tokens_per_s"] = output_tokens / wall_time_s if wall_time_s > 0 else NA
    latencies = [r.latency_s for r in answered if r.latency_s is not None]
    level["latency_mean_s"] = _mean(latencies)
    level["latency_max_s"] = max(latencies) if latencies else NA
    level["spec"] = spec_summary(results)
    level["failed_requests"] = [
        {"qid": r.qid, "failure": r.failure, "detail": r.failure_detail, "http_status": r.http_status}
        for r in sorted(results, key=lambda r: r.qid)
        if not r.ok
    ]
    rest = [r for r in results if not r.overlap]
    overlap_ids = sorted(r.qid for r in results if r.overlap)
    without = _core(rest)
    spec_rest = spec_summary(rest)
    without["accept_length_verify_weighted"] = spec_rest["accept_length_verify_weighted"]
    without["accept_length_per_request_mean"] = spec_rest["accept_length_per_request_mean"]
    level["overlapping_qids"] = overlap_ids
    level["without_few_shot_overlap"] = without
    level["answers"] = {
        str(r.qid): {
            "parsed": r.parsed.as_json() if (r.ok and r.parsed) else None,
            "correct": r.correct,
            "output_sha": hashlib.sha1(r.text.encode()).hexdigest()[:16] if r.ok and r.text else None,
        }
        for r in sorted(results, key=lambda r: r.qid)
    }
    return level


def compare_to_baseline(summary: Mapping[str, Any], baseline: Mapping[str, Any]) -> Dict[str, Any]:
    """Speedup and accuracy delta against a run of the same questions without speculation.

    Raises ValueError when the baseline evaluated a different question set."""
    ours_cfg, base_cfg = summary["config"], baseline.get("config", {})
    if ours_cfg.get("question_set_sha") != base_cfg.get("question_set_sha"):
        raise ValueError(
            "baseline evaluated a different question set "
            f"({base_cfg.get('question_set_sha')} vs {ours_cfg.get('question_set_sha')}; "
            f"{base_cfg.get('num_questions_evaluated')} vs {ours_cfg.get('num_questions_evaluated')} "
            "questions): rerun the baseline with the same --data-path and --num-questions"
        )
    notes = []
    for key in ("few_shot_sha", "max_new_tokens", "api"):
        if ours_cfg.get(key) != base_cfg.get(key):
            notes.append(f"{key} differs: {base_cfg.get(key)!r} (baseline) vs {ours_cfg.get(key)!r}")
    base_spec_levels = [
        lvl for lvl, v in baseline.get("levels", {}).items()
        if v.get("spec", {}).get("requests_with_spec_fields", 0)
    ]
    if base_spec_levels:
        notes.append(f"baseline reports speculative fields at levels {base_spec_levels}: is it really a no-spec run?")
    levels = {}
    for lvl, ours in summary["levels"].items():
        base = baseline.get("levels", {}).get(lvl)
        if base is None:
            levels[lvl] = NA
            continue
        agree = identical = 0
        for qid, a in ours["answers"].items():
            b = base.get("answers", {}).get(qid)
            if b is None:
                continue
            agree += a["parsed"] is not None and a["parsed"] == b["parsed"]
            identical += a["output_sha"] is not None and a["output_sha"] == b["output_sha"]

        def ratio(x, y):
            return x / y if _is_number(x) and _is_number(y) and y > 0 else NA

        levels[lvl] = {
            "speedup_output_tokens_per_s": ratio(ours["output_tokens_per_s"], base["output_tokens_per_s"]),
            "speedup_wall_time": ratio(base["wall_time_s"], ours["wall_time_s"]),
            "accuracy": ours["accuracy"],
            "baseline_accuracy": base["accuracy"],
            "accuracy_delta": (
                ours["accuracy"] - base["accuracy"]
                if _is_number(ours["accuracy"]) and _is_number(base["accuracy"])
                else NA
            ),
            "same_parsed_answer": agree,
            "identical_output_text": identical,
            "questions": ours["questions"],
        }
    return {"baseline_tag": base_cfg.get("tag"), "notes": notes, "levels": levels}
