"""Final-answer parser for GSM8K completions, and the gold answer of a GSM8K record.

Values are exact :class:`fractions.Fraction` so that ``18``, ``18.0`` and ``$18.00`` compare
equal and no float rounding decides correctness.

Where the final answer is taken from, first match wins:

1. ``#### N``: the GSM8K answer format the few-shot examples teach. The *first* one counts;
   anything after it is the model continuing past its own answer.
2. ``\\boxed{N}``: the last one.
3. ``answer is N`` / ``answer: N`` / ``answer = N`` (case-insensitive): the last one.
4. The last number anywhere in the text.

Numbers: optional sign, optional ``$``, thousands separators (``1,234``), decimals, a trailing
``%`` or sentence period is ignored. A ``-`` directly after a digit is subtraction, not a sign
(``5-3`` holds 5 and 3). No number at all is *invalid* (``value is None``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Optional

# One number: a sign only when not glued to a preceding digit/word; grouped thousands before plain.
_NUMBER = r"(?<![\w.])-?\$?\s?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?![\d])"
_NUMBER_RE = re.compile(_NUMBER)
_HASH_RE = re.compile(r"####\s*(" + _NUMBER.replace("(?<![\\w.])", "") + ")")
_BOXED_RE = re.compile(r"\\boxed\s*\{([^{}]*)\}")
_ANSWER_IS_RE = re.compile(
    r"answer\s*(?:is|:|=)\s*(?:\*\*)?\s*(" + _NUMBER.replace("(?<![\\w.])", "") + ")",
    re.IGNORECASE,
)

SOURCE_HASH = "####"
SOURCE_BOXED = "boxed"
SOURCE_ANSWER_IS = "answer is"
SOURCE_LAST_NUMBER = "last number"


@dataclass(frozen=True)
class ParsedAnswer:
    value: Optional[Fraction]  # None: invalid (no number found)
    source: Optional[str]  # which rule found it, None when invalid
    matched: Optional[str]  # the text the number was read from

    @property
    def valid(self) -> bool:
        return self.value is not None

    def as_json(self) -> Optional[str]:
        return format_number(self.value)


def to_number(token: str) -> Optional[Fraction]:
    """``'-$1,234.50'`` -> Fraction(-2469, 2); None if ``token`` holds no number."""
    cleaned = token.replace("$", "").replace(",", "").replace(" ", "").strip()
    cleaned = cleaned.rstrip(".%")
    if not cleaned or cleaned in ("-", "+"):
        return None
    try:
        return Fraction(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


def format_number(value: Optional[Fraction]) -> Optional[str]:
    """Canonical text of a value: ``'72'``, ``'-7'``, ``'3.5'``; exact fraction if not decimal."""
    if value is None:
        return None
    if value.denominator == 1:
        return str(value.numerator)
    den = value.denominator
    while den % 2 == 0:
        den //= 2
    while den % 5 == 0:
        den //= 5
    if den == 1:  # terminating decimal
        digits = 0
        scaled = value
        while scaled.denominator != 1:
            scaled *= 10
            digits += 1
        text = f"{abs(scaled.numerator):0{digits + 1}d}"
        sign = "-" if value < 0 else ""
        return f"{sign}{text[:-digits]}.{text[-digits:]}"
    return f"{value.numerator}/{value.denominator}"


def _last_number(text: str) -> Optional[str]:
    found = _NUMBER_RE.findall(text)
    return found[-1] if found else None


def parse_answer(text: str) -> ParsedAnswer:
    """The final numeric answer in a model completion (rules in the module docstring)."""
    if text is None:
        return ParsedAnswer(None, None, None)
    match = _HASH_RE.search(text)
    if match:
        value = to_number(match.group(1))
        if value is not None:
            return ParsedAnswer(value, SOURCE_HASH, match.group(0))
    boxed = _BOXED_RE.findall(text)
    for inner in reversed(boxed):
        number = _last_number(inner)
        value = to_number(number) if number else None
        if value is not None:
            return ParsedAnswer(value, SOURCE_BOXED, inner)
    answer_is = _ANSWER_IS_RE.findall(text)
    for token in reversed(answer_is):
        value = to_number(token)
        if value is not None:
            return ParsedAnswer(value, SOURCE_ANSWER_IS, token)
    number = _last_number(text)
    if number is not None:
        value = to_number(number)
        if value is not None:
            return ParsedAnswer(value, SOURCE_LAST_NUMBER, number)
    return ParsedAnswer(None, None, None)


def gold_answer(answer_field: str) -> Fraction:
    """The gold value of a GSM8K ``answer`` field (its ``#### N`` line). Raises on bad data."""
    match = _HASH_RE.search(answer_field or "")
    value = to_number(match.group(1)) if match else None
    if value is None:
        raise ValueError(f"GSM8K answer without a '#### <number>' line: {answer_field!r}")
    return value


def is_correct(parsed: ParsedAnswer, gold: Fraction) -> bool:
    return parsed.value is not None and parsed.value == gold
