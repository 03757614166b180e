"""``sglang-dflash-pp check`` on the patched tree: the Kimi-K3 example and each refusal.

Every case runs ``cli.main`` in this process, so the sglang import (most of the time) is paid
once. The example's numbers asserted here are the deployment's facts (93 layers at PP8, draft
features at layers 19, 37, 54, 66, 78, 90, 8 draft KV heads x 128 bf16, P TP4 -> D TP32, page
64, a 4096-token prompt), worked out by hand, not read back from the tool.
"""

from __future__ import annotations

import json
import os

import pytest

from sglang_dflash_pp.cli import main
from sglang_dflash_pp.tools.examples import load

EXIT_OK, EXIT_USAGE, EXIT_REFUSED = 0, 2, 3


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in ("SGLANG_PP_LAYER_PARTITION", "SGLANG_DISAGG_STAGING_BUFFER"):
        monkeypatch.delenv(name, raising=False)


def check_json(capsys, *argv):
    code = main(["check", "--json", *argv])
    return code, json.loads(capsys.readouterr().out)  # stdout holds the JSON only


@pytest.fixture(scope="module")
def example(patched_sglang):
    """The example's JSON report (resolved once per module; capsys is per test)."""
    import contextlib
    import io

    out = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out):
        mp.delenv("SGLANG_PP_LAYER_PARTITION", raising=False)
        mp.delenv("SGLANG_DISAGG_STAGING_BUFFER", raising=False)
        code = main(["check", "--json", "--example", "kimi-k3"])
    return code, json.loads(out.getvalue())


def test_example_is_accepted(example):
    code, r = example
    assert code == EXIT_OK and r["accepted"] and r["refusals"] == []
    p = r["prefill"]
    assert (p["tp_size"], p["pp_size"], p["ep_size"], p["page_size"]) == (4, 8, 4, 64)
    assert p["speculative_num_draft_tokens"] == 16  # the draft's block_size
    assert r["target"]["model_class"] == "KimiK3ForConditionalGeneration"
    assert r["target"]["num_layers"] == 93 and not r["target"]["mla_pool"]  # hybrid MLA + KDA
    assert r["target"]["kv_layer_ids"]  # a hybrid pool publishes them


def test_example_stages_and_carry(example):
    r = example[1]
    assert [s["layers"] for s in r["stages"]] == [
        [0, 11], [11, 22], [22, 33], [33, 45], [45, 57], [57, 69], [69, 81], [81, 93]
    ]
    # Feature L is read at layer L + 1's input: 20 on stage 1, 38 on 3, ..., 91 on 7.
    assert [s["features"] for s in r["stages"]] == [[], [0], [], [1], [2], [3], [4], [5]]
    captured = [[], [19], [], [37], [54], [66], [78], [90]]
    assert [s["captured_layers"] for s in r["stages"]] == captured
    assert [s["receives_partial"] for s in r["stages"]] == [False, False] + [True] * 6
    assert [s["holds_draft"] for s in r["stages"]] == [False] * 7 + [True]
    assert [c["partial_fp32"] for c in r["carry"]] == [0] + [4 * 7168] * 6
    assert [c["raw_captures"] for c in r["carry"]] == [2 * 7168 * k for k in (0, 1, 1, 2, 3, 4, 5)]


def test_example_draft_kv_heads_and_writes(example):
    k = example[1]["draft_kv"]
    assert (k["dtype"], k["entries"], k["prefill_tp"], k["decode_tp"]) == ("bfloat16", 12, 4, 32)
    assert k["prefill_heads"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert k["decode_heads"] == [[r // 4] for r in range(32)]  # 8 heads, each on 4 D ranks
    assert (k["pages"], k["chunks"]) == (64, 1)
    # P rank 0 writes D ranks 0-7: its head 0 to 0-3, its head 1 to 4-7. Per 4096-token request
    # and D rank: 4096 rows x 12 entries x 256 B, packed on CUDA (2 heads per P rank, one taken):
    # one page run per entry.
    assert [(w["decode_rank"], w["heads"]) for w in k["writes"]] == [
        (d, [d // 4]) for d in range(8)
    ]
    assert {(w["bytes"], w["descriptors"], w["send"]) for w in k["writes"]} == {
        (4096 * 12 * 128 * 2, 12, "packed")
    }


def test_other_prefill_rank_and_decode_tp_sizes(capsys, patched_sglang):
    code, r = check_json(capsys, "--example", "kimi-k3", "--prefill-rank", "3")
    assert code == EXIT_OK
    assert [(w["decode_rank"], w["heads"]) for w in r["draft_kv"]["writes"]] == [
        (d, [6 + (d - 24) // 4]) for d in range(24, 32)
    ]
    # A 20000-token request: chunks of 8192, 8192, 3616 tokens (57 pages), each packed.
    code, r = check_json(capsys, "--example", "kimi-k3", "--prompt-tokens", "20000")
    k = r["draft_kv"]
    assert code == EXIT_OK and (k["chunks"], k["pages"]) == (3, 128 + 128 + 57)
    assert {(w["bytes"], w["descriptors"]) for w in k["writes"]} == {(313 * 64 * 12 * 256, 36)}
    code, r = check_json(capsys, "--example", "kimi-k3", "--decode-tp-size", "4")
    assert code == EXIT_OK and r["draft_kv"]["writes"] == [dict(
        decode_rank=0, heads=[0, 1], bytes=4096 * 12 * 2 * 256, descriptors=12, send="page runs")]
    # D TP2 < P TP4: P rank 3 fills heads 6, 7 of D rank 1 (which holds 4-7) row by row.
    code, r = check_json(capsys, "--example", "kimi-k3", "--decode-tp-size", "2",
                         "--prefill-rank", "3")
    k = r["draft_kv"]
    assert code == EXIT_OK and k["decode_heads"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert k["writes"] == [dict(decode_rank=1, heads=[6, 7], bytes=4096 * 12 * 2 * 256,
                                descriptors=4096 * 12, send="head by head")]


def test_a_replica_prefill_rank_writes_nothing(capsys, tmp_path, patched_sglang):
    # 4 draft heads at P TP8 (each head on 2 P ranks) to D TP2: P rank 1 holds head 0, which
    # P rank 0 writes to D rank 0 (send_kvcache_slice leaves it to the rank before it).
    argv = ["--example", "kimi-k3", "--decode-tp-size", "2", "--prefill-rank", "1", "--",
            "--tp-size", "8", "--ep-size", "8", "--speculative-draft-model-path",
            _draft_with(tmp_path, num_key_value_heads=4)]
    code, r = check_json(capsys, *argv)
    assert code == EXIT_OK and r["draft_kv"]["writes"] == [dict(
        decode_rank=0, heads=[0], send="silent: P rank 0 writes them", bytes=0, descriptors=0)]
    assert r["transfer"]["stages"][-1]["draft_bytes"] == 0


def test_transfer_per_stage(capsys, patched_sglang):
    code, r = check_json(capsys, "--example", "kimi-k3", "--prompt-tokens", "32768")
    t = r["transfer"]
    assert code == EXIT_OK and (t["prompt_tokens"], t["link_gbps"]) == (32768, 50.0)
    assert t["decode_ranks"] == list(range(8))
    # 0-based full-attention (MLA) layers 3, 7, ..., 91 and 92; the others are KDA. Stage 0
    # [0, 11) holds 2 MLA + 9 KDA layers, stages 1-2 3 + 8, 3-6 3 + 9, stage 7 [81, 93) 4 + 8.
    mla = [2, 3, 3, 3, 3, 3, 3, 4]
    kda = [11 - 2, 11 - 3, 11 - 3, 12 - 3, 12 - 3, 12 - 3, 12 - 3, 12 - 4]
    # The latent (512 + 64) x bf16 of every position, whole to each of the 8 D ranks.
    assert [s["target_bytes"] for s in t["stages"]] == [32768 * m * 1152 * 8 for m in mla]
    # A KDA layer's state at TP4: 16 heads x 128 x 128 fp32 + 3 convs of 2048 x 3 bf16.
    assert [s["state_bytes"] for s in t["stages"]] == [k * (16 * 128 * 128 * 4 + 36864) for k in kda]
    draft = 8 * 32768 * 12 * 256  # every position's draft head to each D rank
    assert [s["draft_bytes"] for s in t["stages"]] == [0] * 7 + [draft]
    last = t["stages"][7]
    assert last["total_bytes"] == 32768 * 4 * 1152 * 8 + 8 * 1085440 + draft
    assert last["link_ms"] == pytest.approx(last["total_bytes"] / 50e9 * 1e3)
    assert t["slowest_stage"] == 7
    # The draft's window (4096 tokens) covers the last 64 of the 512 pages it is sent.
    assert t["draft_window"] == dict(window=4096, pages=64, draft_bytes_in_window=draft // 8)
    assert r["draft_kv"]["gathers"] == 4  # one per 8192-token chunk, for all 8 D ranks
    code, r = check_json(capsys, "--example", "kimi-k3", "--prompt-tokens", "32768",
                         "--link-gbps", "100")
    assert r["transfer"]["stages"][7]["link_ms"] == pytest.approx(last["link_ms"] / 2)


def test_transfer_per_stage_of_a_dense_target(capsys, model_dirs, patched_sglang):
    def config(name):
        with open(os.path.join(model_dirs[name], "config.json")) as f:
            return json.load(f)

    target, draft = config("target"), config("draft_dense")
    code, r = check_json(capsys, "--decode-tp-size", "1", "--prompt-tokens", "100", "--",
                         "--model-path", model_dirs["target"], "--speculative-draft-model-path",
                         model_dirs["draft_dense"], "--speculative-algorithm", "DFLASH",
                         "--pp-size", "2", "--disaggregation-mode", "prefill",
                         "--disaggregation-transfer-backend", "mooncake",
                         "--cuda-graph-backend-prefill", "disabled", "--page-size", "16")
    t = r["transfer"]
    assert code == EXIT_OK and t["draft_window"] is None  # a draft of full attention
    rows = 7 * 16  # 100 tokens in whole pages
    # 4 layers a stage, K and V of each, bf16; the draft's layers on stage 1.
    assert (target["num_hidden_layers"], draft["torch_dtype"]) == (8, "bfloat16")
    per_token = 2 * target["num_key_value_heads"] * target["head_dim"] * 2
    target = rows * 4 * per_token
    draft = rows * draft["num_hidden_layers"] * 2 * draft["num_key_value_heads"] * (
        draft["head_dim"] * 2)
    assert [(s["target_bytes"], s["state_bytes"], s["draft_bytes"]) for s in t["stages"]] == [
        (target, 0, 0), (target, 0, draft)]
    assert t["slowest_stage"] == 1


def test_text_output(capsys, patched_sglang):
    assert main(["check", "--example", "kimi-k3"]) == EXIT_OK
    text = capsys.readouterr().out
    assert "stage 7  layers [81, 93)  features: 5 (layer 90)" in text
    assert "D rank 7: heads [1], 12,582,912 B, 12 descriptors (packed)" in text
    assert "in all: 100,663,296 B, 96 descriptors" in text
    assert "packed by 1 gather(s) on the GPU" in text
    assert "  stage 7: target    150,994,944 B  state   8,683,520 B  draft    100,663,296 B  = " \
        "    5.21 ms  <- slowest" in text
    assert text.rstrip().endswith("Startup would accept this deployment.")


def _draft_with(tmp_path, **fields) -> str:
    config = load("kimi-k3").config("draft")
    config.update(fields)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def _quantized_draft(tmp_path) -> str:
    config = load("kimi-k3").config("draft")
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def _qwen2(model_dirs):
    return ["--model-path", model_dirs["qwen2_target"], "--speculative-draft-model-path",
            model_dirs["draft"], "--speculative-algorithm", "DFLASH", "--pp-size", "2",
            "--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", "mooncake",
            "--cuda-graph-backend-prefill", "disabled", "--page-size", "16"]


REFUSED = {
    "pp_on_decode": (
        lambda d, t: ["--example", "kimi-k3", "--", "--disaggregation-mode", "decode"],
        "Pipeline parallel DFLASH requires disaggregation-mode=prefill",
    ),
    "attention_dp": (
        lambda d, t: ["--example", "kimi-k3", "--", "--attn-dp-size", "2",
                      "--enable-dp-lm-head"],
        "Pipeline parallel DFLASH does not support attention DP",
    ),
    # 56 query heads: 14 per rank at the prefill's TP4, not divisible over the decode's TP32.
    "draft_the_decode_cannot_build": (
        lambda d, t: ["--example", "kimi-k3", "--", "--speculative-draft-model-path",
                      _draft_with(t, num_attention_heads=56)],
        "[decode draft at draft TP 32 (DFlashDraftModel)] AssertionError: DFlashAttention "
        "requires total_num_heads divisible by tp_size. total_num_heads=56, tp_size=32.",
    ),
    # 6 query heads: not divisible over the prefill's TP4; 3 per rank at the decode's TP2.
    "draft_the_prefill_cannot_build": (
        lambda d, t: ["--example", "kimi-k3", "--decode-tp-size", "2", "--",
                      "--speculative-draft-model-path",
                      _draft_with(t, num_attention_heads=6, num_key_value_heads=2)],
        "[prefill draft at draft TP 4 (DFlashDraftModel)] AssertionError: DFlashAttention "
        "requires total_num_heads divisible by tp_size. total_num_heads=6, tp_size=4.",
    ),
    "not_mooncake": (
        lambda d, t: ["--example", "kimi-k3", "--", "--disaggregation-transfer-backend", "nixl"],
        "Pipeline parallel DFLASH requires --disaggregation-transfer-backend mooncake",
    ),
    "target_without_pp_capture": (
        lambda d, t: ["--decode-tp-size", "1", "--", *_qwen2(d)],
        "Qwen2ForCausalLM captures them on the last stage only",
    ),
    "last_stage_captures_nothing": (
        lambda d, t: ["--example", "kimi-k3"],
        "the last PP stage holds target layers [92, 93) and captures none",
    ),
    "quantized_draft": (
        lambda d, t: ["--example", "kimi-k3", "--", "--speculative-draft-model-path",
                      _quantized_draft(t)],
        "draft's fc is quantized",
    ),
    # At PP1: its draft entries could pair with the decode's only by layer id.
    "target_without_kv_layer_ids_across_tp": (
        lambda d, t: ["--decode-tp-size", "2", "--", "--model-path", d["gpt_oss_target"],
                      "--speculative-draft-model-path", d["draft"],
                      "--speculative-algorithm", "DFLASH", "--disaggregation-mode", "prefill",
                      "--disaggregation-transfer-backend", "mooncake", "--page-size", "16"],
        "to decode attention TP 2: the draft KV can only be sent at equal attention TP",
    ),
    "staging_buffer_across_tp": (
        lambda d, t: ["--example", "kimi-k3"],
        "to decode attention TP 32: unset SGLANG_DISAGG_STAGING_BUFFER",
    ),
}
ENV = {
    "last_stage_captures_nothing": ("SGLANG_PP_LAYER_PARTITION", "12,12,12,12,12,12,20,1"),
    "staging_buffer_across_tp": ("SGLANG_DISAGG_STAGING_BUFFER", "1"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refused(case, capsys, monkeypatch, tmp_path, model_dirs, patched_sglang):
    argv, fragment = REFUSED[case]
    if case in ENV:
        monkeypatch.setenv(*ENV[case])
    code, r = check_json(capsys, *argv(model_dirs, tmp_path))
    assert code == EXIT_REFUSED and not r["accepted"]
    messages = [f"[{x['source']}] {x['message']}" for x in r["refusals"]]
    assert any(fragment in m for m in messages), messages


def test_usage_errors(capsys):
    with pytest.raises(SystemExit) as e:
        main(["check"])
    assert e.value.code == EXIT_USAGE
    with pytest.raises(SystemExit) as e:
        main(["check", "--", "--model-path", os.devnull])
    assert e.value.code == EXIT_USAGE  # no --decode-tp-size
