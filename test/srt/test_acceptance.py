"""The acceptance figures and the comparison of ``sglang-dflash-pp acceptance``, on responses
shaped as sglang's ``/generate`` returns them, with figures worked out by hand."""

from __future__ import annotations

import json

import pytest

from sglang_dflash_pp.tools.acceptance import Answer, compare, summarize
from sglang_dflash_pp.tools.acceptance_command import load_prompts


def response(hist, completion, draft_tokens=4, output_ids=(1, 2, 3)):
    steps = sum(hist)
    return {"output_ids": list(output_ids), "meta_info": {
        "completion_tokens": completion, "spec_verify_ct": steps,
        "spec_num_correct_drafts": sum(k * n for k, n in enumerate(hist)),
        "spec_num_proposed_drafts": steps * (draft_tokens - 1),
        "spec_correct_drafts_histogram": list(hist)}}  # fmt: skip


def answers(*rows):
    return [Answer.from_response(response(*row)) for row in rows]


def test_both_definitions_and_per_position_rates():
    # request 1: 4 steps accepting 0, 1, 1, 3 drafts (+1 bonus each) = 9 tokens;
    # request 2: 2 steps accepting 0, 0 = 2 tokens.
    s = summarize(answers(([1, 2, 0, 1], 9), ([2, 0, 0, 0], 2)))
    assert s["verify_steps"] == 6
    assert s["accept_length_verify_weighted"] == pytest.approx(11 / 6)
    assert s["accept_length_per_request_mean"] == pytest.approx((9 / 4 + 2 / 2) / 2)
    assert s["accepted_drafts_per_step"] == pytest.approx(5 / 6)
    assert s["proposals_per_step"] == 3
    assert s["histogram"] == [3, 2, 0, 1]
    assert s["steps_accepting_at_least"] == [6, 3, 1, 1]
    assert s["position_acceptance"] == pytest.approx([3 / 6, 1 / 6, 1 / 6])
    assert s["conditional_acceptance"] == pytest.approx([3 / 6, 1 / 3, 1.0])


def test_identical_runs_are_equal_and_a_drop_names_its_first_position():
    ref = summarize(answers(([20, 30, 30, 20], 270),) * 4)
    assert compare(ref, ref)["verdict"] == "equal"
    assert compare(ref, ref)["first_parting"] is None
    # the same first position, then far fewer second drafts accepted
    low = summarize(answers(([20, 70, 5, 5], 195),) * 4)
    cmp = compare(ref, low)
    assert cmp["verdict"] == "drop"
    assert cmp["first_parting"]["position"] == 2
    assert cmp["first_parting"]["reference"] == pytest.approx(200 / 320)
    assert cmp["first_parting"]["deployment"] == pytest.approx(40 / 320)
    assert "first parting draft position 2" in cmp["text"]
    assert compare(low, ref)["verdict"] == "higher"


def test_a_difference_within_noise_does_not_part():
    a = summarize(answers(([10, 10, 10, 10], 100),))
    b = summarize(answers(([11, 9, 10, 10], 99),))
    cmp = compare(a, b, threshold=0.05)
    assert cmp["first_parting"] is None and cmp["verdict"] == "equal"
    assert all(row["p_value"] > 0.1 for row in cmp["positions"])


def test_a_non_speculative_answer_is_refused_by_name():
    with pytest.raises(ValueError, match="spec_verify_ct"):
        Answer.from_response({"output_ids": [1], "meta_info": {"completion_tokens": 1}})


def test_prompts_from_text_or_gsm8k_questions(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"text": "a"}) + "\n\n" + json.dumps({"question": "1+1?"}) + "\n")
    assert load_prompts(str(path)) == ["a", "Question: 1+1?\nAnswer:"]
    assert load_prompts(str(path), 1) == ["a"]
    path.write_text(json.dumps({"other": 1}) + "\n")
    with pytest.raises(ValueError, match="no text / prompt / question field"):
        load_prompts(str(path))
