"""Outputs: per-request JSONL (written as requests finish), JSON summary, markdown table, and a
PNG histogram of per-request acceptance lengths."""

from __future__ import annotations

import json
import threading
from typing import Any, Mapping, Sequence

from .metrics import DEFINITIONS, NA, RequestResult

RECORDS = "records.jsonl"
SUMMARY = "summary.json"
TABLE = "summary.md"
HISTOGRAM = "accept_length_hist.png"


class RecordWriter:
    """Appends one JSON line per finished request, flushed at once, so a run that dies still
    leaves every answer it got."""

    def __init__(self, path: str):
        self.path = path
        self._lock = threading.Lock()
        self._f = open(path, "w", encoding="utf-8")

    def write(self, result: RequestResult) -> None:
        line = json.dumps(result.as_json(), ensure_ascii=False, default=str)
        with self._lock:
            self._f.write(line + "\n")
            self._f.flush()

    def close(self) -> None:
        self._f.close()


def write_json(path: str, data: Mapping[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, ensure_ascii=False, default=str)
        f.write("\n")


def fmt(value: Any, digits: int = 4) -> str:
    if value is None or value == NA:
        return NA
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _pct(value: Any) -> str:
    return NA if not isinstance(value, (int, float)) else f"{100 * value:.2f}%"


def markdown(summary: Mapping[str, Any]) -> str:
    cfg = summary["config"]
    levels = summary["levels"]
    names = list(levels)
    lines = [
        f"# GSM8K: {cfg.get('tag') or cfg['base_url']}",
        "",
        f"{cfg['num_questions_evaluated']} questions from `{cfg['data_path']}`, "
        f"{cfg['num_shots']}-shot from `{cfg['train_path']}`, api `{cfg['api']}`, greedy, "
        f"max_new_tokens {cfg['max_new_tokens']}.",
        "",
        "| metric | " + " | ".join(f"C{n}" for n in names) + " |",
        "|---|" + "---|" * len(names),
    ]

    def row(label, fn):
        lines.append(f"| {label} | " + " | ".join(fn(levels[n]) for n in names) + " |")

    row("accuracy", lambda v: f"{v['correct']}/{v['questions']} ({_pct(v['accuracy'])})")
    row(
        "accuracy without few-shot overlap",
        lambda v: (
            f"{v['without_few_shot_overlap']['correct']}/{v['without_few_shot_overlap']['questions']}"
            f" ({_pct(v['without_few_shot_overlap']['accuracy'])})"
        ),
    )
    row("invalid answers", lambda v: str(v["invalid"]))
    row("truncated (finish length)", lambda v: str(v["truncated"]))
    row(
        "failed requests",
        lambda v: str(v["failed"])
        + (" (" + ", ".join(f"{k} {n}" for k, n in v["failures_by_kind"].items()) + ")" if v["failed"] else ""),
    )
    row("total wall time (s)", lambda v: fmt(v["wall_time_s"], 2))
    row("output tokens", lambda v: str(v["output_tokens"]))
    row("output tokens/s", lambda v: fmt(v["output_tokens_per_s"], 2))
    row("accept length, verify-step-weighted", lambda v: fmt(v["spec"]["accept_length_verify_weighted"]))
    row("accept length, per-request mean", lambda v: fmt(v["spec"]["accept_length_per_request_mean"]))
    row("accept rate, weighted", lambda v: fmt(v["spec"]["accept_rate_weighted"]))
    row("accept rate, per-request mean", lambda v: fmt(v["spec"]["accept_rate_per_request_mean"]))
    row("proposals (draft tokens)", lambda v: fmt(v["spec"]["proposals"]))
    row("proposals per verify step", lambda v: fmt(v["spec"]["proposals_per_verify_step"], 2))
    row("verify steps", lambda v: fmt(v["spec"]["sum_verify_ct"]))
    row(
        "requests with spec fields",
        lambda v: f"{v['spec']['requests_with_spec_fields']}/{v['answered']}",
    )
    overlap = summary["few_shot"]["overlapping_qids"]
    lines += [
        "",
        "Few-shot overlap: "
        + (
            f"questions {overlap} are also few-shot examples (with their solutions) in every prompt."
            if overlap
            else "none of the evaluated questions is a few-shot example."
        ),
        "",
        "Definitions (the two acceptance lengths are different quantities; compare like with like):",
        "",
    ]
    for key in (
        "accept_length_verify_weighted",
        "accept_length_per_request_mean",
        "accept_rate_weighted",
        "accept_rate_per_request_mean",
        "proposals",
        "accuracy",
        "invalid",
        "truncated",
        "output_tokens_per_s",
    ):
        lines.append(f"- `{key}`: {DEFINITIONS[key]}")
    lines.append(f"- `{NA}`: the server did not report the field (e.g. no speculative decoding).")
    base = summary.get("baseline_comparison")
    if base:
        lines += [
            "",
            f"## Against baseline `{base.get('baseline_tag')}`",
            "",
            "| metric | " + " | ".join(f"C{n}" for n in names) + " |",
            "|---|" + "---|" * len(names),
        ]
        b = base["levels"]

        def brow(label, fn):
            lines.append(
                f"| {label} | "
                + " | ".join(NA if b.get(n) in (None, NA) else fn(b[n]) for n in names)
                + " |"
            )

        brow("speedup, output tokens/s", lambda v: fmt(v["speedup_output_tokens_per_s"], 3))
        brow("speedup, wall time", lambda v: fmt(v["speedup_wall_time"], 3))
        brow(
            "accuracy delta (points)",
            lambda v: NA if v["accuracy_delta"] == NA else f"{100 * v['accuracy_delta']:+.2f}",
        )
        brow("same parsed answer", lambda v: f"{v['same_parsed_answer']}/{v['questions']}")
        brow("identical output text", lambda v: f"{v['identical_output_text']}/{v['questions']}")
        for note in base.get("notes", []):
            lines.append(f"\nNote: {note}")
    return "\n".join(lines) + "\n"


def histogram_png(
    path: str,
    per_level: Mapping[str, Sequence[float]],
    summary_levels: Mapping[str, Mapping[str, Any]],
    title: str = "",
) -> None:
    """Histogram of per-request acceptance lengths, one panel per concurrency level, with the
    per-request mean and the verify-step-weighted value marked. A level without speculative
    fields gets a panel that says so."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary_levels)
    fig, axes = plt.subplots(1, max(1, len(names)), figsize=(5 * max(1, len(names)), 3.6), squeeze=False)
    for ax, name in zip(axes[0], names):
        values = list(per_level.get(name) or [])
        spec = summary_levels[name]["spec"]
        ax.set_title(f"C{name}: per-request acceptance length")
        if not values:
            ax.text(0.5, 0.5, "n/a: the server reported no\nspeculative fields", ha="center", va="center",
                    transform=ax.transAxes)
            ax.set_xticks([])
            ax.set_yticks([])
            continue
        ax.hist(values, bins=min(30, max(5, len(values))), color="#4C72B0", alpha=0.85)
        ax.axvline(spec["accept_length_per_request_mean"], color="#C44E52", linestyle="--",
                   label=f"per-request mean {spec['accept_length_per_request_mean']:.3f}")
        ax.axvline(spec["accept_length_verify_weighted"], color="#55A868", linestyle="-",
                   label=f"verify-step-weighted {spec['accept_length_verify_weighted']:.3f}")
        ax.set_xlabel("completion_tokens / spec_verify_ct")
        ax.set_ylabel("requests")
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
