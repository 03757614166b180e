"""GSM8K files, the few-shot prompt, and which evaluated questions the few-shot block contains.

Prompt format is the one of SGLang's ``benchmark/gsm8k/bench_sglang.py``: ``k`` solved examples
``"Question: Q\\nAnswer: A\\n\\n"`` followed by ``"Question: Q\\nAnswer:"``, generation stopped
at ``Question`` / ``Assistant:`` / ``<|separator|>``.

Upstream takes its few-shot examples from the first ``k`` lines of the *test* file and then
evaluates the first ``N`` lines of the same file, so the first ``k`` evaluated questions are in
the prompt together with their solutions. Here the examples come from ``--train-path``; when that
is the test file again (or is omitted) the overlap is detected and reported, and every metric is
also given without the overlapping questions.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import List, Sequence

from .answer import gold_answer

STOP = ["Question", "Assistant:", "<|separator|>"]


@dataclass(frozen=True)
class Question:
    qid: int  # 0-based line index in the test file
    question: str
    answer: str  # the full GSM8K solution text
    gold: Fraction


def read_jsonl(path: str) -> List[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON: {e}") from None
            if "question" not in row or "answer" not in row:
                raise ValueError(f"{path}:{lineno}: needs 'question' and 'answer' fields")
            rows.append(row)
    return rows


def load_questions(path: str, num_questions: int) -> List[Question]:
    """The first ``num_questions`` questions of a GSM8K jsonl (all of them if fewer)."""
    rows = read_jsonl(path)
    if num_questions is not None and num_questions >= 0:
        rows = rows[:num_questions]
    return [
        Question(qid=i, question=r["question"], answer=r["answer"], gold=gold_answer(r["answer"]))
        for i, r in enumerate(rows)
    ]


def format_example(question: str, answer: str = None) -> str:
    text = "Question: " + question + "\nAnswer:"
    if answer is not None:
        text += " " + answer
    return text


def few_shot_block(shots: Sequence[dict]) -> str:
    return "".join(format_example(s["question"], s["answer"]) + "\n\n" for s in shots)


def build_prompt(block: str, question: Question) -> str:
    return block + format_example(question.question)


def normalize_question(text: str) -> str:
    """Whitespace-collapsed, case-folded question text: the identity used for overlap."""
    return re.sub(r"\s+", " ", text or "").strip().casefold()


def few_shot_overlap(questions: Sequence[Question], shots: Sequence[dict]) -> List[int]:
    """``qid`` of every evaluated question whose text equals a few-shot example's question."""
    shot_keys = {normalize_question(s["question"]) for s in shots}
    return [q.qid for q in questions if normalize_question(q.question) in shot_keys]


def question_set_sha(questions: Sequence[Question]) -> str:
    """Identity of the evaluated question set (order-sensitive), to match a baseline run."""
    h = hashlib.sha256()
    for q in questions:
        h.update(normalize_question(q.question).encode())
        h.update(b"\0")
    return h.hexdigest()[:16]
