"""Acceptance above 1 through a real PP2 DFLASH prefill, with a pair whose behaviour is known.

A random draft is never accepted, so the deployments of ``test_llama_pd_dflash`` can only show
that acceptance statistics agree. Here the target and the draft are constructed
(``e2e_models``): the target's greedy output cycles 0 -> 1 -> 2 -> 0 whatever the prompt, and the
draft proposes token 0 at every block position. On each verify step the draft's first token is
accepted exactly when the last committed token is 2, so the tokens per verify step, the verify
count and the acceptance length follow in closed form (``e2e_models.verify_steps``), computed
here without sglang.

Deployment (c) of the issue with this pair: P = DFLASH PP2 prefill -> Mooncake ->
D = DFLASH decode -> the real router. Also the GSM8K benchmark client
(``benchmark/gsm8k/bench_dflash_pd.py``) against it: its acceptance figures come from a real
DFLASH run and must equal the closed form. And ``sglang-dflash-pp acceptance`` comparing it with
a non-PD server ``A`` of the same pair (verdict equal, the closed form's figures), and ``A``
with a server ``B`` whose draft never agrees with the target (``write_disagreeing_draft``):
verdict drop, first parting at draft position 1. Last, a draft whose proposal depends on its
context KV (``write_context_draft``) through a second PP2 PD deployment: equal to its non-PD
server ``A2``, then, with test support zeroing each request's transferred draft KV on the
decode, a drop at draft position 1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import cpu_servers
import e2e_models as models
from deployments import Deployment
from deployment_args import DECODE_ARGS, prefill_args, server_args
from kv_checksum_counts import CHECKED_DECODE, CHECKSUM, INJECT_ENV, verified_exactly

pytestmark = pytest.mark.slow

REPO = os.path.dirname(cpu_servers.TEST_ROOT)
BENCH = os.path.join(REPO, "benchmark", "gsm8k", "bench_dflash_pd.py")
MAX_NEW_TOKENS = 20
PROMPTS = ["hello world, this is", "x", "The quick brown fox jumps over the lazy dog. " * 3, "ab"]


@pytest.fixture(scope="module")
def pair(e2e_root, stub_root):
    root = os.path.join(e2e_root, "constructed")
    target = models.write_cycling_target(os.path.join(root, "target"))
    draft = models.write_dflash_draft(os.path.join(root, "draft"), zero_final_norm=True)
    dep = Deployment("constructed pair")
    boot = cpu_servers.free_port()
    try:
        dep.add(cpu_servers.launch_server(
            "P2", root, target,
            server_args(draft, *prefill_args(boot), "--pp-size", "2", CHECKSUM),
            stub_root=stub_root, spec=True, pd=True, ranks=2))
        dep.add(cpu_servers.launch_server(
            "D", root, target, server_args(draft, *DECODE_ARGS, *CHECKED_DECODE),
            stub_root=stub_root, spec=True,
            pd=True))
        dep.add(cpu_servers.launch_pd_router("router", root, [(dep["P2"].base_url, boot)],
                                             [dep["D"].base_url]))
        wrong = models.write_disagreeing_draft(os.path.join(root, "wrong_draft"))
        context = models.write_context_draft(os.path.join(root, "context_draft"))
        for name, d in (("A", draft), ("B", wrong), ("A2", context)):
            dep.add(cpu_servers.launch_server(name, root, target, server_args(d),
                                              stub_root=stub_root, spec=True))
        # The context-dependent draft through PD, on a decode that zeroes the transferred draft
        # KV of the requests sent while the control file says so (cpu_support/kv_misplacement).
        boot_c, inject = cpu_servers.free_port(), os.path.join(root, "misplace")
        open(inject, "w").close()
        dep.add(cpu_servers.launch_server(
            "P2c", root, target, server_args(context, *prefill_args(boot_c), "--pp-size", "2"),
            stub_root=stub_root, spec=True, pd=True, ranks=2))
        dep.add(cpu_servers.launch_server(
            "Dc", root, target, server_args(context, *DECODE_ARGS), stub_root=stub_root,
            spec=True, pd=True, env={INJECT_ENV: inject}))
        dep.add(cpu_servers.launch_pd_router("router-c", root, [(dep["P2c"].base_url, boot_c)],
                                             [dep["Dc"].base_url]))
        dep.wait()
        yield {"dep": dep, "root": root, "target": target, "inject": inject}
    finally:
        dep.kill()


def _tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def test_acceptance_length_through_a_pp2_prefill_matches_the_closed_form(pair):
    tok = _tokenizer(pair["target"])
    url = pair["dep"]["router"].base_url
    for prompt in PROMPTS:
        ids = tok(prompt, add_special_tokens=False)["input_ids"]
        with verified_exactly(pair["dep"]["D"], 1):
            response = cpu_servers.generate(url, prompt, MAX_NEW_TOKENS)
        meta = response["meta_info"]
        expected = models.cycling_output(ids[-1], MAX_NEW_TOKENS)
        assert response["output_ids"] == expected, prompt
        steps = models.verify_steps(expected)
        assert meta["spec_verify_ct"] == len(steps), (prompt, steps)
        assert meta["spec_num_correct_drafts"] == sum(accepted for accepted, _ in steps)
        assert meta["spec_accept_length"] == pytest.approx(MAX_NEW_TOKENS / len(steps))
        assert meta["spec_accept_length"] > 1.3  # every third step accepts one draft token


def test_gsm8k_benchmark_reports_real_acceptance_figures(pair, tmp_path):
    data, train = tmp_path / "test.jsonl", tmp_path / "train.jsonl"
    questions = [("What is 2 plus 3?", "2+3=5\n#### 5"), ("How many legs do 2 cats have?", "2*4=8\n#### 8"),
                 ("What is 10 minus 4?", "10-4=6\n#### 6")]
    for path, rows in ((data, questions), (train, questions[:1])):
        path.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in rows))
    out = tmp_path / "out"
    url = pair["dep"]["router"].base_url
    cmd = [sys.executable, BENCH, "--base-url", url, "--data-path", str(data), "--train-path",
           str(train), "--num-shots", "1", "--num-questions", "3", "--parallel", "1,2",
           "--max-new-tokens", str(MAX_NEW_TOKENS), "--output-dir", str(out), "--no-progress"]
    with verified_exactly(pair["dep"]["D"], 6):  # 3 questions at concurrency 1 and 2
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    tok = _tokenizer(pair["target"])
    records = [json.loads(line) for line in open(out / "records.jsonl")]
    summary = json.load(open(out / "summary.json"))
    assert len(records) == 6 and all(r["ok"] for r in records)
    for level in ("1", "2"):
        recs = [r for r in records if r["level"] == int(level)]
        verify_steps = []
        for r in recs:
            ids = tok(r["output"], add_special_tokens=False)["input_ids"]
            assert len(ids) == r["completion_tokens"] == MAX_NEW_TOKENS
            assert ids == models.cycling_output((ids[0] - 1) % models.CYCLE, len(ids))
            steps = models.verify_steps(ids)
            assert r["meta"]["spec_verify_ct"] == len(steps)
            verify_steps.append(len(steps))
        spec = summary["levels"][level]["spec"]
        weighted = sum(r["completion_tokens"] for r in recs) / sum(verify_steps)
        per_request = sum(MAX_NEW_TOKENS / v for v in verify_steps) / len(verify_steps)
        assert spec["accept_length_verify_weighted"] == pytest.approx(weighted)
        assert spec["accept_length_per_request_mean"] == pytest.approx(per_request)
        assert spec["requests_with_spec_fields"] == 3 and weighted > 1.3


# Enough verify steps (about 250 per deployment) for the test to see a rate of 1/2 against 1/3.
TOOL_PROMPTS = PROMPTS + ["Numbers: 1 2 3", "zz"]
TOOL_NEW_TOKENS = 64


def _acceptance(url_ref: str, url_dep: str, tmp_path, name: str, prompts=TOOL_PROMPTS,
                new_tokens=TOOL_NEW_TOKENS):
    from sglang_dflash_pp.cli import main

    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps({"text": p}) + "\n" for p in prompts))
    out = tmp_path / name
    code = main(["acceptance", "--reference", url_ref, "--deployment", url_dep, "--prompts",
                 str(path), "--max-new-tokens", str(new_tokens), "--parallel", "2",
                 "--out", str(out)])
    return code, json.load(open(out / "report.json")), out


def _closed_form(target, prompts, new_tokens, proposal=0):
    tok = _tokenizer(target)
    steps = [models.verify_steps(models.cycling_output(
        tok(p, add_special_tokens=False)["input_ids"][-1], new_tokens), proposal=proposal)
        for p in prompts]
    hist = [0] * models.BLOCK_SIZE
    for request in steps:
        for accepted, _ in request:
            hist[accepted] += 1
    return hist


def test_acceptance_tool_finds_a_pp2_pd_deployment_equal_to_non_pd(pair, tmp_path, capsys):
    dep = pair["dep"]
    with verified_exactly(dep["D"], len(TOOL_PROMPTS)):
        code, report, out = _acceptance(dep["A"].base_url, dep["router"].base_url, tmp_path, "pd")
    printed = capsys.readouterr().out
    assert code == 0 and report["comparison"]["verdict"] == "equal", printed
    assert report["outputs_equal"] == len(TOOL_PROMPTS)
    tok = _tokenizer(pair["target"])
    steps = [models.verify_steps(models.cycling_output(
        tok(p, add_special_tokens=False)["input_ids"][-1], TOOL_NEW_TOKENS))
        for p in TOOL_PROMPTS]
    expected_hist = _closed_form(pair["target"], TOOL_PROMPTS, TOOL_NEW_TOKENS)
    for side in ("reference", "deployment"):
        assert report[side]["verify_steps"] == sum(len(s) for s in steps)
        assert report[side]["histogram"] == expected_hist
        assert report[side]["accept_length_verify_weighted"] == pytest.approx(
            len(TOOL_PROMPTS) * TOOL_NEW_TOKENS / sum(len(s) for s in steps))
        assert report[side]["proposals_per_step"] == models.BLOCK_SIZE - 1
    assert report["reference"]["position_acceptance"][0] == pytest.approx(
        sum(a >= 1 for s in steps for a, _ in s) / sum(len(s) for s in steps))
    assert "verdict: equal" in printed and os.path.getsize(out / "acceptance.png") > 1000


def test_acceptance_tool_names_the_drop_of_a_wrong_draft(pair, tmp_path, capsys):
    dep = pair["dep"]
    code, report, out = _acceptance(dep["A"].base_url, dep["B"].base_url, tmp_path, "wrong")
    printed = capsys.readouterr().out
    cmp = report["comparison"]
    assert code == 1 and cmp["verdict"] == "drop", printed
    assert cmp["first_parting"]["position"] == 1
    assert cmp["first_parting"]["reference"] == pytest.approx(0.5, abs=0.02)
    assert cmp["first_parting"]["deployment"] == 0.0
    assert report["deployment"]["histogram"] == [report["deployment"]["verify_steps"], 0, 0, 0]
    assert report["outputs_equal"] == len(TOOL_PROMPTS)  # the target decides every token
    assert "first parting draft position 1" in printed
    assert os.path.getsize(out / "acceptance.png") > 1000


# Long enough for the context-dependent draft's context to outweigh its block (80 tokens).
CONTEXT_PROMPTS = [f"{i} The quick brown fox jumps over the lazy dog. " * 2 for i in range(6)]
CONTEXT_NEW_TOKENS = 16  # fewer than the 20 a zeroed decode needs to regain token 1


def test_acceptance_tool_names_the_drop_of_a_decode_whose_draft_kv_was_zeroed(pair, tmp_path):
    """A draft whose proposal depends on its context KV (``write_context_draft``), served
    non-PD (``A2``) and through a PP2 PD deployment: equal, with the closed form of a draft
    proposing token 1; then the same deployment while test support zeroes each request's
    transferred draft KV on the decode: drop, first parting at draft position 1, and the
    outputs still equal (the target decides every token)."""
    dep, router = pair["dep"], pair["dep"]["router-c"].base_url
    hist = _closed_form(pair["target"], CONTEXT_PROMPTS, CONTEXT_NEW_TOKENS, proposal=1)
    assert hist[1] > 0  # the closed form accepts drafts
    code, report, _ = _acceptance(dep["A2"].base_url, router, tmp_path, "intact",
                                  CONTEXT_PROMPTS, CONTEXT_NEW_TOKENS)
    assert code == 0 and report["comparison"]["verdict"] == "equal", report["comparison"]
    assert report["reference"]["histogram"] == report["deployment"]["histogram"] == hist
    with open(pair["inject"], "w") as f:
        f.write("zero-draft")
    try:
        code, report, out = _acceptance(dep["A2"].base_url, router, tmp_path, "zeroed",
                                        CONTEXT_PROMPTS, CONTEXT_NEW_TOKENS)
    finally:
        open(pair["inject"], "w").close()
    cmp = report["comparison"]
    assert code == 1 and cmp["verdict"] == "drop", cmp["text"]
    assert cmp["first_parting"]["position"] == 1 and cmp["first_parting"]["deployment"] == 0
    assert report["deployment"]["histogram"] == [report["deployment"]["verify_steps"], 0, 0, 0]
    assert report["outputs_equal"] == len(CONTEXT_PROMPTS)
    assert os.path.getsize(out / "acceptance.png") > 1000
