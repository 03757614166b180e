"""``sglang-dflash-pp check``: the Kimi-K3 example's topology report, and refused configurations.

The example is resolved by the installed console script in a subprocess (the entry point users
run); the production numbers asserted here are the deployment's facts (P TP4 x PP8 -> D TP32,
draft 8 KV heads x 128 bf16, page 64, a 4096-token prompt), while the tool derives them from our
modules. Further cases run ``cli.main`` in this process, sharing one sglang import: refusals,
the startup assertions past resolution (draft heads vs each side's draft TP, pool class, env
switches), and the second example family (``qwen3-8b``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONSOLE_SCRIPT = os.path.join(os.path.dirname(sys.executable), "sglang-dflash-pp")
EXIT_REFUSED = 3


def _env():
    env = dict(os.environ)
    for name in (
        "SGLANG_DFLASH_PP_CARRY_DTYPE",
        "SGLANG_PP_LAYER_PARTITION",
        "SGLANG_USE_CPU_ENGINE",
    ):
        env.pop(name, None)
    return env


def _run(argv, timeout=300):
    return subprocess.run(
        argv, capture_output=True, text=True, env=_env(), timeout=timeout, cwd=REPO
    )


@pytest.fixture(scope="module")
def example_report():
    proc = _run([CONSOLE_SCRIPT, "check", "--example", "kimi-k3", "--json"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout)  # stdout holds the JSON only; logs go to stderr


def _main_json(capsys, argv):
    from sglang_dflash_pp.cli import main

    code = main(argv)
    return code, json.loads(capsys.readouterr().out)


def test_example_resolves_and_is_accepted(example_report):
    r = example_report
    assert r["accepted"] is True and r["refusals"] == []
    p = r["prefill"]["values"]
    assert r["prefill"]["resolved"] and r["decode"]["resolved"]
    assert (p["tp_size"], p["pp_size"], p["ep_size"]) == (4, 8, 4)
    assert (p["page_size"], p["kv_cache_dtype"], p["disaggregation_mode"]) == (
        64,
        "bf16",
        "prefill",
    )
    assert p["speculative_num_draft_tokens"] == 16  # from the draft's block_size
    assert r["decode"]["values"]["tp_size"] == 32 and r["decode"]["values"]["pp_size"] == 1
    assert r["target"]["num_layers"] == 93 and r["draft"]["target_layer_ids"] == [
        19,
        37,
        54,
        66,
        78,
        90,
    ]


def test_example_partition_and_feature_ownership(example_report):
    r = example_report
    assert r["partition"]["layers_per_stage"] == [11, 11, 11, 12, 12, 12, 12, 12]
    owned = {
        s["stage"]: (s["features"], s["captured_layers"]) for s in r["stages"] if s["features"]
    }
    captured = dict(zip([1, 3, 4, 5, 6, 7], [19, 37, 54, 66, 78, 90]))
    assert owned == {stage: ([j], [layer]) for j, (stage, layer) in enumerate(captured.items())}
    assert [s["hosts_draft"] for s in r["stages"]] == [False] * 7 + [True]
    # Stage 0 owns nothing: it neither sends nor receives; every later hop carries the partial.
    assert [s["sends_partial"] for s in r["stages"]] == [False] + [True] * 6 + [False]
    assert [s["receives_partial"] for s in r["stages"]] == [False, False] + [True] * 6


def test_example_carry_bytes(example_report):
    c = example_report["carry"]
    assert c["dtype"] == "float32" and c["hidden"] == 7168
    assert [h["partial_bytes_per_token"] for h in c["hops"]] == [0] + [28_672] * 6
    assert [h["concat_bytes_per_token"] for h in c["hops"]] == [
        0,
        14_336,
        14_336,
        28_672,
        43_008,
        57_344,
        71_680,
    ]
    assert (
        c["partial_bytes_per_token_per_hop"] == 28_672 and c["concat_bytes_per_token_max"] == 71_680
    )


def test_example_draft_kv_geometry_and_writer_map(example_report):
    k = example_report["draft_kv"]
    assert (k["page_size"], k["entries"], k["dtype"]) == (64, 12, "bfloat16")
    assert k["shape"] == dict(total_heads=8, k_head_dim=128, v_head_dim=128, dtype_bytes=2)
    P, D = k["prefill"], k["decode"]
    assert (P["tp_size"], P["heads_per_rank"], P["replication"]) == (4, 2, 1)
    assert P["ranks"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert (P["k_item_len"], P["v_item_len"]) == (32_768, 32_768)
    assert (D["tp_size"], D["heads_per_rank"], D["replication"]) == (32, 1, 4)
    assert D["ranks"] == [[r // 4] for r in range(32)]
    assert (D["k_item_len"], D["v_item_len"]) == (16_384, 16_384)
    for p in k["prefill_ranks"]:
        q = p["prefill_rank"]
        assert [w["decode_rank"] for w in p["writes"]] == list(range(8 * q, 8 * q + 8))
        assert [w["heads"] for w in p["writes"]] == [[2 * q]] * 4 + [[2 * q + 1]] * 4
        assert {w["regime"] for w in p["writes"]} == {"pack on prefill, then page runs"}
        assert p["silent"] == []


def test_example_bytes_and_descriptors_per_request(example_report):
    k = example_report["draft_kv"]
    assert (k["prompt_tokens"], k["pages"]) == (4096, 64)
    for d in k["decode_ranks"]:
        assert d["writers"] == [d["decode_rank"] // 8]
        assert d["descriptors"] == 12  # 12 entries x 1 page run, packed
        assert d["bytes"] == d["physical_minimum_bytes"] == 12_582_912
        assert d["per_token_descriptors"] == 49_152
    assert {p["bytes"] for p in k["prefill_ranks"]} == {8 * 12_582_912}


def test_example_pack_staging_is_sized_from_the_chunk(example_report):
    """What each last-stage GPU allocates and registers at startup for packing: per transfer
    queue (4, sglang's default), the 8192-token chunk's pages plus one (129 x 64 rows) of every
    draft entry's row on a prefill rank (12 entries x 2 heads x 128 x 2 B)."""
    st = example_report["draft_kv"]["pack_staging"]
    slot = 129 * 64 * (12 * 2 * 128 * 2)
    assert st == dict(bytes_per_gpu=4 * slot, slots=4, slot_bytes=slot, chunk_tokens=8192,
                      chunk_slot_bytes=slot)  # fmt: skip
    assert slot == 50_724_864


def test_example_text_report(example_report):
    from sglang_dflash_pp.tools.check_text import render

    text = render(example_report)
    (hop,) = [line.split() for line in text.splitlines() if line.strip().startswith("6->7")]
    assert hop == ["6->7", "28,672", "71,680"]
    for fragment in (
        "[11, 11, 11, 12, 12, 12, 12, 12]",
        "P1 (heads 2-3) -> D8-11 head 2, D12-15 head 3  [pack on prefill, then page runs]",
        "per D rank 12 descriptors, 12,582,912 bytes",
        "P pack staging (allocated and registered at startup, per last-stage GPU): 193.5 MiB = 4 "
        "slot(s) x 48.4 MiB",
        "Refusals: none.",
    ):
        assert fragment in text, fragment


def test_example_last_stage_draft_weight_bytes(example_report):
    """The last P stage's draft per GPU (TP4), stock vs the KV-write-only draft it builds: by the
    draft's shapes (h 7168; 16 of 64 query heads, 2 of 8 KV heads x 128, 4608 of 18432 MLP
    columns per rank; 6 layers; fc over 6 features, the last stage's block over 1; bf16)."""
    h = 7168
    norms = 6 * (2 * h + 2 * 128) + 2 * h
    kv = 6 * 2 * 2 * 128 * h
    w = example_report["last_stage_draft_weights"]
    assert (w["draft_tp"], w["fc_features"]) == (4, [5])
    assert w["stock_bytes"] == 2 * (6 * h * h + norms + kv + 6 * (2 * 16 * 128 * h + 3 * 4608 * h))
    assert w["kv_write_only_bytes"] == 2 * (h * h + norms + kv)
    assert (w["stock_bytes"], w["kv_write_only_bytes"]) == (2_202_213_376, 147_004_416)
    assert w["saved_bytes"] == w["stock_bytes"] - w["kv_write_only_bytes"]
    from sglang_dflash_pp.tools.check_text import render

    assert (
        "Draft weights per GPU on the last P stage (draft TP4): stock 2.20 GB (2,202,213,376 B), "
        "KV-write-only 0.15 GB (147,004,416 B" in render(example_report)
    )


def test_refused_pp_on_a_decode_server_via_module(tmp_path):
    """``python -m sglang_dflash_pp check -- <launch_server argv>``: the plugin's gate refuses
    DFLASH with --pp-size > 1 on a PD decode server, and check says so with exit code 3."""
    from sglang_dflash_pp.tools import examples

    ex = examples.load("kimi-k3")
    launch = [
        "python", "-m", "sglang.launch_server",
        "--model-path", ex.target_dir, "--speculative-draft-model-path", ex.draft_dir,
        "--speculative-algorithm", "DFLASH", "--tp-size", "4", "--pp-size", "2",
        "--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "mooncake",
    ]  # fmt: skip
    proc = _run(
        [
            sys.executable,
            "-m",
            "sglang_dflash_pp",
            "check",
            "--decode-tp-size",
            "32",
            "--json",
            "--",
            *launch,
        ]
    )
    assert proc.returncode == EXIT_REFUSED, proc.stderr[-3000:]
    r = json.loads(proc.stdout)
    assert r["accepted"] is False and r["prefill"]["resolved"] is False
    (refusal,) = r["refusals"]
    assert refusal["source"].startswith("prefill startup")
    assert "DFLASH with --pp-size 2 is not supported on a PD decode server" in refusal["message"]
    assert "--pp-size 1" in refusal["message"]


def test_refused_decode_tp_that_cannot_shard_the_draft_heads(capsys):
    code, r = _main_json(
        capsys, ["check", "--example", "kimi-k3", "--decode-tp-size", "3", "--json"]
    )
    assert code == EXIT_REFUSED and r["accepted"] is False
    messages = [x["message"] for x in r["refusals"] if x["source"].startswith("draft KV transfer")]
    assert len(messages) == 1
    assert (
        "decode attention TP 3 and the draft's 8 KV heads: neither divides the other" in messages[0]
    )
    assert "draft_kv" not in r  # no plan is reported for a refused layout


def test_refused_partition_where_the_last_stage_owns_no_feature(capsys, monkeypatch):
    # The last stage holds only layer 92; layer 90's output is captured where layer 91 runs.
    monkeypatch.setenv("SGLANG_PP_LAYER_PARTITION", "12,12,12,12,12,12,20,1")
    code, r = _main_json(capsys, ["check", "--example", "kimi-k3", "--json"])
    assert code == EXIT_REFUSED
    hits = [
        x for x in r["refusals"] if "captures none of the draft's target_layer_ids" in x["message"]
    ]
    assert len(hits) == 1, r["refusals"]  # the gate's refusal and ours: reported once
    assert "SGLANG_PP_LAYER_PARTITION" in hits[0]["message"]


def test_bare_config_files_with_shortcuts(capsys):
    """Config files instead of checkpoint directories; the shortcut flags build the P argv."""
    from sglang_dflash_pp.tools import examples

    ex = examples.load("kimi-k3")
    code, r = _main_json(capsys, [
        "check", "--model-path", os.path.join(ex.target_dir, "config.json"),
        "--draft-model-path", os.path.join(ex.draft_dir, "config.json"),
        "--tp-size", "4", "--pp-size", "8", "--decode-tp-size", "32", "--page-size", "64",
        "--prompt-tokens", "1000", "--json",
    ])  # fmt: skip
    assert code == 0 and r["accepted"], r["refusals"]
    assert r["partition"]["layers_per_stage"] == [11, 11, 11, 12, 12, 12, 12, 12]
    k = r["draft_kv"]
    assert k["pages"] == 16  # ceil(1000 / 64): whole pages move
    assert {d["bytes"] for d in k["decode_ranks"]} == {12 * 16 * 64 * 128 * 2}
    assert {d["descriptors"] for d in k["decode_ranks"]} == {12}


def test_carry_dtype_follows_the_servers_environment(capsys, monkeypatch):
    monkeypatch.setenv("SGLANG_DFLASH_PP_CARRY_DTYPE", "bfloat16")
    code, r = _main_json(capsys, ["check", "--example", "kimi-k3", "--json"])
    assert code == 0
    assert r["carry"]["dtype"] == "bfloat16"
    assert r["carry"]["partial_bytes_per_token_per_hop"] == 14_336


def test_example_prefill_arguments_are_the_recipes():
    """topology.json's prefill arguments are the ones examples/kimi_k3/prefill.sh passes."""
    from sglang_dflash_pp.tools import examples

    ex = examples.load("kimi-k3")
    env = {"PATH": os.environ["PATH"], "RECIPE_PRINT_ARGS": "1", "KIMI_K3_PATH": "/m",
           "KIMI_K3_DFLASH_PATH": "/d", "NODE_RANK": "0", "P_HEAD": "10.0.0.1"}  # fmt: skip
    out = subprocess.run(["bash", os.path.join(REPO, "examples", "kimi_k3", "prefill.sh")],
                         env=env, capture_output=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    recipe = out.stdout.decode().rstrip("\0").split("\0")
    args = ex.prefill_args
    i = 0
    while i < len(args):
        flag = args[i]
        assert flag in recipe, flag
        if i + 1 < len(args) and not args[i + 1].startswith("--"):
            assert recipe[recipe.index(flag) + 1] == args[i + 1], flag
            i += 1
        i += 1
    assert ex.decode_tp_size == 32


def test_dense_target_classes_are_planned_with_their_capture_points(capsys, model_dirs):
    """A Llama target (hooked by models/pp_capture): accepted, every stage owning the features
    captured at the input of layer L+1; a class we do not hook is refused by name."""
    code, r = _main_json(capsys, [
        "check", "--model-path", model_dirs["target"], "--draft-model-path",
        model_dirs["draft_dense"], "--tp-size", "1", "--pp-size", "2", "--decode-tp-size", "1",
        "--json",
    ])  # fmt: skip
    assert code == 0 and r["accepted"], r["refusals"]
    assert r["capture_convention"]["target_class"] == "LlamaForCausalLM"
    # ids 1, 3, 5 of 8 layers: captured at layers 2, 4, 6 -> stage [0,4) owns 1; [4,8) owns 3, 5
    assert [s["captured_layers"] for s in r["stages"]] == [[1], [3, 5]]
    classes = r["accepted_target_classes"]
    assert {"LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "GptOssForCausalLM",
            "KimiK3LinearForCausalLM", "KimiK3ForConditionalGeneration"} == set(classes)
    code, r = _main_json(capsys, [
        "check", "--model-path", model_dirs["qwen2_target"], "--draft-model-path",
        model_dirs["draft_dense"], "--tp-size", "1", "--pp-size", "2", "--decode-tp-size", "1",
        "--json",
    ])  # fmt: skip
    assert code == EXIT_REFUSED
    messages = " ".join(x["message"] for x in r["refusals"])
    assert "Qwen2ForCausalLM" in messages and "LlamaForCausalLM" in messages


def test_example_draft_stand_in_has_the_checkpoint_shapes(example_report):
    """The user's K3 draft facts (6 layers, 8 KV heads x 128, bf16, window 4096, target layers),
    and where those are unknown z-lab/Kimi-K2.5-DFlash's (64 query heads, intermediate 18432,
    YaRN RoPE); check reports them and evaluates the draft's construction on both sides."""
    from sglang_dflash_pp.tools import examples

    cfg = examples.load("kimi-k3").config("draft")
    assert (
        cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
        cfg["head_dim"], cfg["intermediate_size"], cfg["hidden_size"], cfg["torch_dtype"],
        cfg["sliding_window"], cfg["rope_scaling"]["rope_type"],
    ) == (6, 64, 8, 128, 18432, 7168, "bfloat16", 4096, "yarn")  # fmt: skip
    d = example_report["draft"]
    assert (d["num_layers"], d["query_heads"], d["kv_heads"], d["head_dim"]) == (6, 64, 8, 128)
    rows = {(r["side"], r["check"]): r for r in example_report["startup_assertions"]}
    for side, tp in (("P", 4), ("D", 32)):
        row = rows[(side, "draft heads vs draft TP")]
        assert row["ok"] is True and "64 query / 8 KV heads" in row["value"], row
        assert f"over TP {tp}" in row["value"]
        assert f"the draft runs at TP {tp}" in rows[(side, "draft TP layout")]["value"]
    assert "sliding window 4,096" in rows[("P+D", "draft layer types and window")]["value"]
    assert rows[("P", "draft KV pool class")]["value"].startswith("MHATokenToKVPool (NHD)")
    assert all(r["ok"] is not False for r in example_report["startup_assertions"])


def _kimi_with_draft_heads(tmp_path, heads):
    from sglang_dflash_pp.tools import examples

    ex = examples.load("kimi-k3")
    cfg = ex.config("draft")
    cfg["num_attention_heads"] = heads
    d = tmp_path / f"draft{heads}"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return ["check", "--decode-tp-size", "32", "--json", "--", *ex.prefill_argv(),
            "--speculative-draft-model-path", str(d)], str(d / "config.json")  # fmt: skip


def test_56_head_draft_is_refused_for_the_tp32_decode(capsys, tmp_path):
    """The stand-in's old 56 query heads: resolution of both servers succeeds, but the TP32
    decode's DFlashAttention would assert (test_startup_assertions checks that against stock)."""
    argv, config = _kimi_with_draft_heads(tmp_path, 56)
    code, r = _main_json(capsys, argv)
    assert code == EXIT_REFUSED and r["accepted"] is False
    assert r["prefill"]["resolved"] and r["decode"]["resolved"]
    (refusal,) = r["refusals"]
    assert refusal["source"].startswith("D startup: draft heads vs draft TP")
    msg = refusal["message"]
    for fragment in (
        "the decode server builds the DFlash draft at TP 32 (--tp-size 32",
        "56 query heads are not divisible by TP 32",
        "models/dflash.py:215-229",
        f"num_attention_heads (now 56) is a multiple of 32 (e.g. 64) in {config}",
        "--attn-dp-size 4 --enable-dp-lm-head",
    ):
        assert fragment in msg, (fragment, msg)
    rows = {(x["side"], x["check"]): x for x in r["startup_assertions"]}
    assert rows[("P", "draft heads vs draft TP")]["ok"] is True  # 56 = 4 x 14 on P
    assert rows[("D", "draft heads vs draft TP")]["ok"] is False


def test_the_suggested_attention_dp_fix_is_accepted(tmp_path):
    """The refusal's own suggestion, applied to the decode: with attention DP 4 the draft runs in
    its attention-TP group of 8 (sglang's placement), where 56 query heads divide."""
    from sglang_dflash_pp.tools.check import CheckInputs, run_check

    argv, _ = _kimi_with_draft_heads(tmp_path, 56)
    launch = argv[argv.index("--") + 1 :]
    r = run_check(CheckInputs(
        prefill_argv=launch, decode_tp=32, prompt_tokens=4096, label="56 heads, D attention DP",
        decode_extra_argv=["--attn-dp-size", "4", "--enable-dp-lm-head"],
    ))  # fmt: skip
    assert r["accepted"], r["refusals"]
    rows = {(x["side"], x["check"]): x for x in r["startup_assertions"]}
    assert "the draft runs at TP 8" in rows[("D", "draft TP layout")]["value"]
    assert r["draft_kv"]["decode"]["tp_size"] == 8 and r["draft_kv"]["decode"]["heads_per_rank"] == 1


def test_64_head_draft_is_accepted_for_the_tp32_decode(capsys, tmp_path):
    argv, _ = _kimi_with_draft_heads(tmp_path, 64)
    code, r = _main_json(capsys, argv)
    assert code == 0 and r["accepted"], r["refusals"]


def test_qwen3_example_is_planned(capsys):
    """Second family: Qwen3-8B with z-lab/Qwen3-8B-DFlash-b16's shapes, P TP2 x PP2 -> D TP4."""
    code, r = _main_json(capsys, ["check", "--example", "qwen3-8b", "--json"])
    assert code == 0 and r["accepted"], r["refusals"]
    assert r["capture_convention"]["target_class"] == "Qwen3ForCausalLM"
    assert r["partition"]["layers_per_stage"] == [18, 18]
    # ids 1, 9, 17, 25, 33, captured at the input of layers 2, 10 | 18, 26, 34
    assert [s["captured_layers"] for s in r["stages"]] == [[1, 9], [17, 25, 33]]
    assert r["carry"]["partial_bytes_per_token_per_hop"] == 4096 * 4
    k = r["draft_kv"]
    assert (k["prefill"]["heads_per_rank"], k["decode"]["heads_per_rank"]) == (4, 2)
    # 5 layers x (K, V) x 256 pages x 16 tokens x 2 heads x 128 x 2 B per decode rank
    assert {d["bytes"] for d in k["decode_ranks"]} == {10 * 256 * 16 * 2 * 128 * 2}
    rows = {(x["side"], x["check"]): x for x in r["startup_assertions"]}
    target = rows[("D", "target heads vs attention TP")]
    assert "32 query / 8 KV heads over attention TP 4" in target["value"], target
    staging = rows[("P+D", "staging buffer")]
    assert "head-sliced" in staging["value"] and staging["ok"] is True


def test_qwen3_decode_tp_beyond_the_heads_is_refused_on_draft_and_target(capsys):
    code, r = _main_json(capsys, ["check", "--example", "qwen3-8b", "--decode-tp-size", "64",
                                  "--json"])  # fmt: skip
    assert code == EXIT_REFUSED
    sources = {x["source"].split(" (")[0] for x in r["refusals"]}
    assert "D startup: draft heads vs draft TP" in sources, sources
    assert "D startup: target heads vs attention TP" in sources, sources
    target = next(x["message"] for x in r["refusals"] if "target heads" in x["source"])
    assert "32 query heads are not divisible by TP 64" in target and "models/qwen3.py" in target


def test_env_switches_that_break_the_pp_path_are_refused(capsys, monkeypatch):
    monkeypatch.setenv("SGLANG_PP_SKIP_PURE_CHUNKED_OUTPUT_COMM", "1")
    code, r = _main_json(capsys, ["check", "--example", "kimi-k3", "--json"])
    assert code == EXIT_REFUSED
    (hit,) = [x for x in r["refusals"] if "SGLANG_PP_SKIP_PURE_CHUNKED_OUTPUT_COMM" in x["message"]]
    assert "Unset SGLANG_PP_SKIP_PURE_CHUNKED_OUTPUT_COMM" in hit["message"]


def test_staging_buffer_and_hnd_pool_refused_only_where_they_break_the_transfer(
    capsys, monkeypatch
):
    """A plain-MHA target (Qwen3) at another attention TP goes through the staging copy, which
    carries no draft heads; Kimi-K3 (hybrid MLA) sends whole pages. An HND draft pool cannot be
    read head by head at another draft TP."""
    monkeypatch.setenv("SGLANG_DISAGG_STAGING_BUFFER", "1")
    code, r = _main_json(capsys, ["check", "--example", "qwen3-8b", "--json"])
    assert code == EXIT_REFUSED
    (hit,) = [x for x in r["refusals"] if "staging buffer" in x["source"]]
    assert "unset SGLANG_DISAGG_STAGING_BUFFER on both servers" in hit["message"]
    code, r = _main_json(capsys, ["check", "--example", "kimi-k3", "--json"])
    assert code == 0, r["refusals"]
    monkeypatch.delenv("SGLANG_DISAGG_STAGING_BUFFER")
    monkeypatch.setenv("SGLANG_USE_HND_KVCACHE", "1")
    code, r = _main_json(capsys, ["check", "--example", "qwen3-8b", "--json"])
    assert code == EXIT_REFUSED
    (hit,) = [x for x in r["refusals"] if "draft KV pool class" in x["source"]]
    assert "SGLANG_USE_HND_KVCACHE" in hit["message"] and "(2)" in hit["message"]


def test_check_says_whether_transfers_are_verified(example_report, capsys):
    """Kimi-K3's recipe runs with the KV checksum: check says every transfer of the PP8 -> TP32
    deployment is verified by the composed digest (stock would skip all of them) and that the
    decode needs the flag too; the Qwen3 example without it says transfers are not verified and
    how to turn it on."""
    from sglang_dflash_pp.tools.check_text import render

    c = example_report["kv_checksum"]
    assert c == {"enabled": True, "prefill_ranks": 32, "decode_tp": 32, "stock_would_skip": True}
    assert "--disaggregation-enable-kv-checksum" in example_report["decode"]["argv"]
    text = render(example_report)
    assert "KV checksum: on; every transfer is verified on the decode by the composed digest" in text
    assert "each of the 32 prefill ranks sends each decode rank" in text
    code, r = _main_json(capsys, ["check", "--example", "qwen3-8b", "--json"])
    assert code == 0 and r["kv_checksum"]["enabled"] is False
    assert "KV checksum: off. Transfers are not verified" in render(r)
