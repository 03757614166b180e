"""The stock 0.5.23 bug reports under ``docs/upstream/bugs/``: each reproduction still shows its bug
on stock sglang, and the plugin's path (or the test-only CPU support's, for the CPU spots) gives
the answer the report calls right.

Each ``repro.py`` runs as a maintainer would run it, in a subprocess, and prints one ``RESULT``
JSON line. The stock runs get an environment that would load every plugin we have
(``SGLANG_PLUGINS`` naming both, the CPU support on ``PYTHONPATH``): the script itself must keep
them out, and reports which of its stock symbols carry a hook (none). The pinned ``observed``
values are 0.5.23's: when an upstream release fixes a bug, its test fails here and the report (and
the plugin's workaround) can go.

A bug our plugins do not fix (``KEPT_STOCK``) runs a second time with the plugin loaded: it must
show exactly the stock outcome (hooks of ours on the same symbols, for other purposes, may be
listed in ``hooked_targets``), so the report stays the only thing this repository says about it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace
from concurrent.futures import ThreadPoolExecutor

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUGS = os.path.join(REPO, "docs", "upstream", "bugs")
CPU_SUPPORT = os.path.join(REPO, "test", "cpu_support")

# bug directory -> the plugin that carries our fix (None: the fix is a refusal, at startup or at a
# request's admission, checked in-process below, since the stock code path it avoids is unchanged).
FIXED_BY = {
    "mooncake-draft-kv-heads-per-rank": "dflash_pp",
    "dflash-cpu-only-spots": "dflash_pp_cpu_support",
    "fp32-input-embeds-cast": "dflash_pp_cpu_support",
    "pp-skip-output-comm-speculative": None,
    # A DFLASH PP prefill refuses a 0-token prompt at admission (checked in-process below); the
    # stock paths the report shows (admission elsewhere, the forward, the decode's release) stay.
    "empty-prompt": None,
}
# bug directory -> the plugin loaded for the second run: bugs our plugins leave exactly stock.
KEPT_STOCK = {
    # The fix belongs in the KV sender's abort (upstream); the plugin does not change abort.
    "prefill-abort-not-sent-to-decode": "dflash_pp",
}


def bug_dirs():
    return sorted(
        d for d in os.listdir(BUGS) if os.path.isfile(os.path.join(BUGS, d, "repro.py"))
    )


def _run(name: str, mode: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (CPU_SUPPORT, env.get("PYTHONPATH")) if p)
    args = [sys.executable, os.path.join(BUGS, name, "repro.py")]
    if mode == "stock":
        env["SGLANG_PLUGINS"] = "dflash_pp,dflash_pp_cpu_support"  # the script must refuse both
    else:
        env["SGLANG_PLUGINS"] = FIXED_BY[name] if mode == "fixed" else KEPT_STOCK[name]
        args.append("--with-plugins")
    proc = subprocess.run(args, env=env, cwd="/", capture_output=True, text=True, timeout=300)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and len(lines) == 1, (
        f"{name} ({mode}) rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return json.loads(lines[0][len("RESULT "):])


@pytest.fixture(scope="module")
def results():
    """Every reproduction: stock, fixed and kept-stock runs, two at a time (each imports sglang,
    ~10 s)."""
    jobs = [(n, "stock") for n in bug_dirs()]
    jobs += [(n, "fixed") for n in bug_dirs() if FIXED_BY.get(n)]
    jobs += [(n, "kept") for n in bug_dirs() if n in KEPT_STOCK]
    with ThreadPoolExecutor(max_workers=2) as pool:
        outs = list(pool.map(lambda job: _run(*job), jobs))
    return dict(zip(jobs, outs))


def test_every_bug_report_has_a_reproduction_and_a_fix_owner():
    assert not set(FIXED_BY) & set(KEPT_STOCK)
    assert bug_dirs() == sorted({**FIXED_BY, **KEPT_STOCK}), (
        "a bug directory without an entry here, or the reverse"
    )
    for name in bug_dirs():
        assert os.path.isfile(os.path.join(BUGS, name, "README.md")), name


@pytest.mark.parametrize("name", sorted({**FIXED_BY, **KEPT_STOCK}))
def test_reproduction_runs_on_stock_sglang_without_any_plugin(results, name):
    out = results[(name, "stock")]
    assert out["mode"] == "stock" and out["bug"] == name
    assert out["sglang"] == "0.5.23"
    assert out["hooked_targets"] == [], "a plugin hook reached the stock run"
    assert out["shows_bug"] is True and out["observed"] != out["expected"]


@pytest.mark.parametrize("name", [n for n in sorted(FIXED_BY) if FIXED_BY[n]])
def test_fixed_path_gives_the_expected_answer(results, name):
    stock, fixed = results[(name, "stock")], results[(name, "fixed")]
    assert fixed["mode"] == "with-plugins"
    assert fixed["hooked_targets"], "the fixed run did not go through a hook"
    assert fixed["expected"] == stock["expected"]
    assert fixed["shows_bug"] is False and fixed["observed"] == fixed["expected"]


@pytest.mark.parametrize("name", sorted(KEPT_STOCK))
def test_bugs_we_do_not_fix_stay_stock_with_our_plugin(results, name):
    stock, kept = results[(name, "stock")], results[(name, "kept")]
    assert kept["mode"] == "with-plugins"
    assert kept["shows_bug"] is True and kept["observed"] == stock["observed"]
    assert kept["expected"] == stock["expected"]


# -- the 0.5.23 values each report quotes; an upstream fix changes them ------------------------


def test_mooncake_stock_values(results):
    """P TP4 rank 1 -> D TP32 rank 12, P pages [5,6,7,20] -> D [2,3,4,9], draft K0 at 2,000,000:
    stock addresses D page 2 with P's 32768-B item (2,065,536, 3 x 32768 B); the decode rank's own
    head at 16384 B/page lives at 2,000,000 + 2 x 16384 (the design note, draft-kv-transfer.md
    section 1.7)."""
    out = results[("mooncake-draft-kv-heads-per-rank", "stock")]
    assert out["observed"] == {
        "registration_rejection": None,
        "k0_descriptors": [[2_065_536, 98_304], [2_000_000 + 9 * 32768, 32768]],
        "k0_decode_pages_written": [4, 5, 6, 7, 8, 9, 18, 19],
        "request_pages_with_the_right_head": 0,
        "draft_bytes_sent": 12 * (98_304 + 32768),
    }
    assert out["expected"] == {
        "registration_rejection": None,
        "k0_descriptors": [[2_032_768, 3 * 16384], [2_000_000 + 9 * 16384, 16384]],
        "k0_decode_pages_written": [2, 3, 4, 9],
        "request_pages_with_the_right_head": 12 * 4,
        "draft_bytes_sent": 12 * 4 * 16384,
    }


def test_dflash_cpu_spots_stock_values(results):
    out = results[("dflash-cpu-only-spots", "stock")]
    obs = out["observed"]
    assert obs["1_platform_refuses_dflash_on_cpu"] is True
    assert obs["2_draft_attention_backend"] == "flashinfer"
    assert obs["3_assign_extend_cache_locs"] is None
    assert obs["4_assign_req_to_token_pool_rows"].startswith("RuntimeError")
    assert obs["5_record_stream_on_cpu_tensor"].startswith("RuntimeError")
    # Rows 2 and 0 of a 4 x 10 arange table, slots [3, 5) and [1, 3).
    assert out["expected"]["3_assign_extend_cache_locs"] == [23, 24, 1, 2]
    assert out["expected"]["4_assign_req_to_token_pool_rows"] == [[100, 101], [102, 103]]


def test_fp32_input_embeds_stock_values(results):
    obs = results[("fp32-input-embeds-cast", "stock")]["observed"]
    assert obs["input_embeds_dtype"] == "torch.bfloat16"
    assert 0 < obs["max_abs_change"] < 1e-2  # bf16 rounding of values in [-1/3, 1/3]
    assert "must have the same dtype" in obs["fp32_first_layer"]


def test_skip_output_comm_stock_values(results):
    out = results[("pp-skip-output-comm-speculative", "stock")]
    assert out["observed"] == {
        "control_result_carrying_batch_spec_info": "passes the draft-input assertion",
        "middle_chunk_output_comm_skipped": True,
        "skip_result_next_draft_input": "NoneType",
        "pd_prefill_result": "AssertionError at srt/disaggregation/prefill.py:939: "
        "assert batch.spec_info is result.next_draft_input",
    }
    assert out["expected"]["skip_result_next_draft_input"] == "DFlashDraftInputV2"


def test_skip_output_comm_is_refused_at_startup_with_dflash_pp(
    sglang_with_plugin, model_dirs, monkeypatch
):
    """Our fix for that bug: a DFLASH PP prefill with the switch on never starts."""
    from resolution import resolve

    kwargs = dict(
        model_path=model_dirs["kimi_k3"],
        speculative_algorithm="DFLASH",
        speculative_draft_model_path=model_dirs["draft_k3"],
        pp_size=2,
        disaggregation_mode="prefill",
        disaggregation_transfer_backend="mooncake",
        device="cuda",  # a string during resolution; no CUDA call is made
        random_seed=0,
        trust_remote_code=True,
        mamba_radix_cache_strategy="no_buffer",
    )
    monkeypatch.setenv("SGLANG_PP_SKIP_PURE_CHUNKED_OUTPUT_COMM", "1")
    outcome = resolve(kwargs)
    assert "SGLANG_PP_SKIP_PURE_CHUNKED_OUTPUT_COMM" in outcome.get("error", ""), outcome
    monkeypatch.delenv("SGLANG_PP_SKIP_PURE_CHUNKED_OUTPUT_COMM")
    assert "resolved" in resolve(kwargs)


def test_empty_prompt_stock_values(results):
    """``{"text": ""}`` tokenizes to 0 ids with a tokenizer that adds no BOS: stock refuses an
    empty ``input_ids`` field but no check sees the tokenized prompt; the RoPE of the first layer
    cannot view 0 elements; a decode row with 0 KV tokens fails release's first assertion."""
    obs = results[("empty-prompt", "stock")]["observed"]
    assert obs["1_http_text_empty"] == "accepted"
    assert obs["1_http_input_ids_empty_control"] == "ValueError: input_ids cannot be empty."
    assert obs["2_tokenizer_manager_0_tokens"] == "accepted"
    assert "longer than the model's context length" in obs["2_tokenizer_manager_over_long_control"]
    assert obs["3_scheduler_queues_0_token_request"] is True
    assert obs["3_scheduler_queues_1_token_request_control"] is True
    assert obs["4_rope_forward_0_tokens"].startswith(
        "RuntimeError at srt/layers/rotary_embedding/base.py:347: cannot reshape tensor of 0 elements"
    )
    assert obs["4_rope_forward_1_token_control"] == "ok: q [1, 64], k [1, 32]"
    assert obs["5_decode_release_0_token_request"] == (
        "AssertionError at srt/mem_cache/common.py:403 (holds_kv=True, is_kv_released=True)"
    )


def test_empty_prompt_is_refused_at_admission_by_a_dflash_pp_prefill(sglang_with_plugin):
    """Our fix for the prefill half of that bug: the DFLASH request check the scheduler runs on
    every rank names the empty prompt on a DFLASH PP prefill, and only there."""
    from sglang.srt.managers import scheduler
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.runtime_context import get_context, get_parallel
    from sglang.srt.sampling.sampling_params import SamplingParams

    from sglang_dflash_pp.srt.managers.empty_prompt_refusal import EMPTY_PROMPT_ERROR

    def verdict(ids, pp_size, **config):
        req = Req(rid="r", origin_input_text="", origin_input_ids=ids,
                  sampling_params=SamplingParams())  # fmt: skip
        override = get_context().override_server_args(**config)
        override.install()
        try:
            group = SimpleNamespace(world_size=pp_size, rank_in_group=0, is_first_rank=True,
                                    is_last_rank=pp_size == 1)  # fmt: skip
            with get_parallel().override(pp_size=pp_size, pp_rank=0, pp_group=group):
                return scheduler.validate_dflash_request(req, False)
        finally:
            override.restore()

    pp_prefill = dict(speculative_algorithm="DFLASH", disaggregation_mode="prefill")
    assert verdict([], 2, **pp_prefill) == EMPTY_PROMPT_ERROR
    assert verdict([7], 2, **pp_prefill) is None
    assert verdict([], 1, **pp_prefill) is None  # DFLASH PP1 prefill: stock
    assert verdict([], 1, speculative_algorithm="DFLASH") is None  # non-PD DFLASH: stock


def test_prefill_abort_stock_values(results):
    """Both queued requests' senders are Failed on the prefill; the decode, whose two rooms wait
    in WaitingForInput, receives nothing, while ``conclude_failure`` reaches it."""
    out = results[("prefill-abort-not-sent-to-decode", "stock")]
    assert out["observed"] == {
        "prefill_sender_after_abort": {
            "bootstrap_queue": "Failed (Aborted by AbortReq.)",
            "inflight_queue": "Failed (Aborted by AbortReq.)",
        },
        "status_messages_to_decode_after_abort": [],
        "decode_room_status_after_abort": {
            "bootstrap_queue": "WaitingForInput", "inflight_queue": "WaitingForInput",
        },
        "control_conclude_failure_messages": [[1003, "Failed"]],
        "control_decode_room_status": "Failed",
    }
    assert out["expected"]["status_messages_to_decode_after_abort"] == [
        [1001, "Failed"], [1002, "Failed"],
    ]
    assert out["decode_waiting_timeout_s"] == 300
