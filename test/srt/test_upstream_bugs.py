"""The stock 0.5.23 bug reports under ``docs/upstream/bugs/``: each reproduction still shows its bug
on stock sglang, and the plugin's path (or the test-only CPU support's, for the CPU spots) gives
the answer the report calls right.

Each ``repro.py`` runs as a maintainer would run it, in a subprocess, and prints one ``RESULT``
JSON line. The stock runs get an environment that would load every plugin we have
(``SGLANG_PLUGINS`` naming both, the CPU support on ``PYTHONPATH``): the script itself must keep
them out, and reports which of its stock symbols carry a hook (none). The pinned ``observed``
values are 0.5.23's: when an upstream release fixes a bug, its test fails here and the report (and
the plugin's workaround) can go.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUGS = os.path.join(REPO, "docs", "upstream", "bugs")
CPU_SUPPORT = os.path.join(REPO, "test", "cpu_support")

# bug directory -> the plugin that carries our fix (None: the fix is a startup refusal, checked
# in-process below, since the stock code path it avoids is unchanged).
FIXED_BY = {
    "mooncake-draft-kv-heads-per-rank": "dflash_pp",
    "dflash-cpu-only-spots": "dflash_pp_cpu_support",
    "fp32-input-embeds-cast": "dflash_pp_cpu_support",
    "pp-skip-output-comm-speculative": None,
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
        env["SGLANG_PLUGINS"] = FIXED_BY[name]
        args.append("--with-plugins")
    proc = subprocess.run(args, env=env, cwd="/", capture_output=True, text=True, timeout=300)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and len(lines) == 1, (
        f"{name} ({mode}) rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return json.loads(lines[0][len("RESULT "):])


@pytest.fixture(scope="module")
def results():
    """Every reproduction, stock and fixed, two at a time (each imports sglang, ~10 s)."""
    jobs = [(n, "stock") for n in bug_dirs()] + [(n, "fixed") for n in bug_dirs() if FIXED_BY[n]]
    with ThreadPoolExecutor(max_workers=2) as pool:
        outs = list(pool.map(lambda job: _run(*job), jobs))
    return dict(zip(jobs, outs))


def test_every_bug_report_has_a_reproduction_and_a_fix_owner():
    assert bug_dirs() == sorted(FIXED_BY), "a bug directory without an entry here, or the reverse"
    for name in bug_dirs():
        assert os.path.isfile(os.path.join(BUGS, name, "README.md")), name


@pytest.mark.parametrize("name", sorted(FIXED_BY))
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
