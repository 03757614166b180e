"""Speculative acceptance of a deployment against a reference, position by position. Pure.

A wrong draft KV, a lost recurrent state or a draft that does not belong to its target never
changes a greedy output token: the target verifies every draft token. What changes is
acceptance. Both deployments answer the same prompts greedily; from what each ``/generate``
returns in ``meta_info`` (sglang's ``spec_verify_ct``, ``spec_num_correct_drafts``,
``spec_num_proposed_drafts``, ``spec_correct_drafts_histogram``, ``completion_tokens``) this
module computes, per deployment:

* the acceptance length under both definitions, named and never mixed: **verify-step
  weighted** ``sum(completion_tokens) / sum(spec_verify_ct)`` and **per-request mean**
  ``mean(completion_tokens / spec_verify_ct)`` (a PD decode counts the prefill's first token
  in ``completion_tokens``, the same on both sides of a comparison of PD deployments);
* proposals per verify step (``spec_num_proposed_drafts / spec_verify_ct``) and accepted
  draft tokens per step (``spec_num_correct_drafts / spec_verify_ct``, the bonus token not
  counted);
* per draft position ``k``: the share of verify steps that accepted at least ``k`` drafts,
  and the conditional rate ``P(accepted >= k | accepted >= k - 1)``, from the summed
  histograms.

Where the deployments part: at each position, the two conditional rates are compared with a
two-sided two-proportion z-test (pooled variance), Bonferroni-corrected over the positions;
the first position whose p-value is below ``alpha / positions`` is where they part. Greedy runs
of the same weights give identical counts (z = 0), so any parting is beyond noise by
construction of the test, not by a tolerance picked per run.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

SPEC_KEYS = ("spec_verify_ct", "spec_num_correct_drafts", "spec_num_proposed_drafts",
             "spec_correct_drafts_histogram")  # fmt: skip
TEST = ("two-sided two-proportion z-test (pooled) of the conditional acceptance rate "
        "P(accepted >= k | accepted >= k - 1) at each draft position k, Bonferroni-corrected "
        "over the positions")  # fmt: skip


@dataclass
class Answer:
    """What one ``/generate`` returned, reduced to what acceptance needs."""

    output_ids: List[int]
    completion_tokens: int
    verify_steps: int
    accepted_drafts: int
    proposed_drafts: int
    histogram: List[int]

    @classmethod
    def from_response(cls, body: dict) -> "Answer":
        meta = body["meta_info"]
        missing = [k for k in SPEC_KEYS if k not in meta]
        if missing:
            raise ValueError(f"the server returned no {', '.join(missing)}: it is not a "
                             "speculative server, or the request had no verify step")  # fmt: skip
        return cls(
            output_ids=list(body.get("output_ids") or []),
            completion_tokens=int(meta["completion_tokens"]),
            verify_steps=int(meta["spec_verify_ct"]),
            accepted_drafts=int(meta["spec_num_correct_drafts"]),
            proposed_drafts=int(meta["spec_num_proposed_drafts"]),
            histogram=[int(x) for x in meta["spec_correct_drafts_histogram"]],
        )


def summarize(answers: Sequence[Answer]) -> dict:
    """One deployment's figures over its answers."""
    # sglang's histogram ends at the largest count seen; every step proposes the same number
    steps = sum(a.verify_steps for a in answers)
    proposals = round(sum(a.proposed_drafts for a in answers) / steps)
    width = max(max(len(a.histogram) for a in answers), proposals + 1)
    hist = [sum(a.histogram[k] if k < len(a.histogram) else 0 for a in answers)
            for k in range(width)]  # fmt: skip
    at_least = [sum(hist[k:]) for k in range(width)]  # at_least[0]: every verify step
    return dict(
        requests=len(answers),
        verify_steps=steps,
        completion_tokens=sum(a.completion_tokens for a in answers),
        accept_length_verify_weighted=sum(a.completion_tokens for a in answers) / steps,
        accept_length_per_request_mean=statistics.mean(
            a.completion_tokens / a.verify_steps for a in answers),
        proposals_per_step=sum(a.proposed_drafts for a in answers) / steps,
        accepted_drafts_per_step=sum(a.accepted_drafts for a in answers) / steps,
        histogram=hist,
        steps_accepting_at_least=at_least,
        position_acceptance=[at_least[k] / at_least[0] for k in range(1, width)],
        conditional_acceptance=[_rate(at_least, k) for k in range(1, width)],
    )


def _two_proportion_p(s1: int, n1: int, s2: int, n2: int) -> float:
    if not n1 or not n2:
        return 1.0
    pooled = (s1 + s2) / (n1 + n2)
    var = pooled * (1 - pooled) * (1 / n1 + 1 / n2)
    if var == 0:
        return 1.0 if s1 * n2 == s2 * n1 else 0.0
    z = (s1 / n1 - s2 / n2) / math.sqrt(var)
    return math.erfc(abs(z) / math.sqrt(2))


def compare(reference: dict, deployment: dict, *, alpha: float = 0.01,
            threshold: float = 0.02) -> dict:  # fmt: skip
    """Per position, the p-value of the two conditional rates; the first position where the
    deployments part; and the verdict: ``equal``, ``drop`` or ``higher``."""
    ref, dep = reference["steps_accepting_at_least"], deployment["steps_accepting_at_least"]
    width = max(len(ref), len(dep))
    ref, dep = ref + [0] * (width - len(ref)), dep + [0] * (width - len(dep))
    positions, parting = [], None
    bound = alpha / max(1, width - 1)
    for k in range(1, width):
        p = _two_proportion_p(ref[k], ref[k - 1], dep[k], dep[k - 1])
        row = dict(position=k, reference=_rate(ref, k), deployment=_rate(dep, k), p_value=p)
        positions.append(row)
        if parting is None and p < bound:
            parting = row
    a, b = reference["accept_length_verify_weighted"], deployment["accept_length_verify_weighted"]
    change = (b - a) / a
    if parting is None and abs(change) <= threshold:
        verdict, text = "equal", (
            f"equal: {a:.3f} vs {b:.3f} tokens per verify step (verify-step weighted), no "
            f"draft position parts (alpha {alpha})")
    else:
        lower = change < 0 if parting is None else parting["deployment"] < parting["reference"]
        verdict = "drop" if lower else "higher"
        where = "no single draft position parts" if parting is None else (
            f"first parting draft position {parting['position']}: conditional acceptance "
            f"{parting['reference']:.3f} -> {parting['deployment']:.3f} "
            f"(p = {parting['p_value']:.2g})")
        text = (f"{verdict}: {a:.3f} -> {b:.3f} tokens per verify step (verify-step weighted, "
                f"{change:+.1%}); {where}")
    return dict(verdict=verdict, text=text, test=TEST, alpha=alpha, threshold=threshold,
                bonferroni_bound=bound, positions=positions, first_parting=parting,
                accept_length_change=change)  # fmt: skip


def _rate(at_least: List[int], k: int) -> Optional[float]:
    return at_least[k] / at_least[k - 1] if at_least[k - 1] else None


def per_request(reference: Sequence[Answer], deployment: Sequence[Answer]) -> List[Dict]:
    return [dict(index=i, outputs_equal=r.output_ids == d.output_ids,
                 reference_verify_steps=r.verify_steps, deployment_verify_steps=d.verify_steps,
                 reference_accept_length=r.completion_tokens / r.verify_steps,
                 deployment_accept_length=d.completion_tokens / d.verify_steps)
            for i, (r, d) in enumerate(zip(reference, deployment))]  # fmt: skip
