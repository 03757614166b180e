"""The DFLASH x PP argument gate, on the real ``ServerArgs`` resolution of sglang 0.5.23.

``device="cuda"`` is only a string during resolution (no CUDA call is made); it gets past the
DFLASH device gate on this CPU machine, as in ``shared/design/cpu-harness.md`` item 1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from resolution import resolve

HERE = os.path.dirname(os.path.abspath(__file__))

# Fields that DFLASH resolution decides; they must come out the same for PP1 and PP>1.
DFLASH_FIELDS = (
    "speculative_algorithm",
    "speculative_num_draft_tokens",
    "speculative_num_steps",
    "speculative_eagle_topk",
    "speculative_draft_attention_backend",
    "max_running_requests",
)


def _args(dirs, *, pp_size=2, mode="prefill", draft="draft_k3", target="kimi_k3", **extra):
    """Kimi-K3 (tiny, 8 layers) with a DFlash draft capturing layers 1, 3, 5, 7."""
    kwargs = dict(
        model_path=dirs[target],
        speculative_algorithm="DFLASH",
        speculative_draft_model_path=dirs[draft],
        pp_size=pp_size,
        disaggregation_mode=mode,
        disaggregation_transfer_backend="mooncake",
        device="cuda",
        random_seed=0,  # otherwise drawn per resolution
        trust_remote_code=True,
        # CPU box: the default mamba cache strategy needs a platform with state snapshots.
        mamba_radix_cache_strategy="no_buffer",
    )
    kwargs.update(extra)
    return kwargs


def _dense_args(dirs, draft="draft", **kw):
    """A dense Llama target with a DFlash draft."""
    kwargs = _args(dirs, target="target", draft=draft, **kw)
    del kwargs["mamba_radix_cache_strategy"]
    return kwargs


def _error(outcome):
    assert "error" in outcome, f"expected a refusal, got a resolved config: {outcome}"
    return outcome["error"]


@pytest.mark.parametrize("pp_size", [2, 8])
def test_accepted_combination_resolves_like_pp1(sglang_with_plugin, model_dirs, pp_size):
    pp = resolve(_args(model_dirs, pp_size=pp_size))
    pp1 = resolve(_args(model_dirs, pp_size=1))
    assert "resolved" in pp, pp
    resolved, resolved_pp1 = pp["resolved"], pp1["resolved"]
    assert resolved["pp_size"] == pp_size
    # The draft's block_size (8 in the tiny config) sets the verify width, as for PP1.
    assert resolved["speculative_num_draft_tokens"] == 8
    assert resolved["speculative_num_steps"] == 1
    assert resolved["speculative_eagle_topk"] == 1
    assert resolved["max_running_requests"] == 48
    for field in DFLASH_FIELDS:
        assert resolved[field] == resolved_pp1[field], field
    assert resolved["disable_overlap_schedule"] is True  # PP forces it; PP1 prefill keeps it


def test_pp_size_mask_is_removed_after_resolution(sglang_with_plugin, model_dirs):
    from sglang.srt.arg_groups.overrides import resolution_result
    from sglang.srt.server_args import ServerArgs

    sa = ServerArgs(**_args(model_dirs, pp_size=4))
    sa.resolve_once()
    assert resolution_result(sa, "pp_size") == 4
    sources = [source for source, _ in sa._resolved_overrides]
    assert not any("pp_size_mask" in s for s in sources), sources


@pytest.mark.parametrize(
    "overrides, fragments",
    [
        (dict(mode="decode"), ["not supported on a PD decode server", "--pp-size 1"]),
        (
            dict(mode="null"),
            ["without PD disaggregation", "--disaggregation-mode prefill"],
        ),
        (
            dict(disaggregation_transfer_backend="nixl"),
            ["--disaggregation-transfer-backend mooncake"],
        ),
        (
            dict(cuda_graph_backend_prefill="breakable"),
            ["PP prefill CUDA graph", "--cuda-graph-backend-prefill disabled"],
        ),
        (
            dict(draft="draft_quantised"),
            ["quantised fc", "unquantised", "--pp-size 1"],
        ),
        (
            dict(draft="draft_laguna"),
            ["overrides project_target_hidden", "plain DFlashDraftModel"],
        ),
        (
            dict(draft="draft_unsorted"),
            ["out of order", "ascending", "[1, 3, 5, 7]"],
        ),
        (dict(draft="draft_duplicated"), ["duplicates [3]", "target_layer_ids"]),
        (
            dict(target="qwen2_target", draft="draft_dense"),
            ["Qwen2ForCausalLM", "captures on the last PP stage only", "LlamaForCausalLM",
             "Qwen3ForCausalLM", "--pp-size 1"],
        ),
        (
            dict(target="target", draft="draft"),
            ["final layer [7]", "never captures", "input of layer L+1"],
        ),
        (
            dict(draft="draft_k3_early"),
            ["last PP stage (layers [4, 8)) captures none", "SGLANG_PP_LAYER_PARTITION"],
        ),
    ],
    ids=[
        "decode",
        "no-pd",
        "nixl",
        "prefill-cuda-graph",
        "quantised-fc",
        "laguna-projection",
        "unsorted-ids",
        "duplicated-ids",
        "unhooked-target-class",
        "dense-target-final-layer",
        "last-stage-owns-nothing",
    ],
)
def test_refused_combinations(sglang_with_plugin, model_dirs, overrides, fragments):
    error = _error(resolve(_args(model_dirs, **overrides)))
    for fragment in fragments:
        assert fragment in error, error


def test_dense_target_resolves_like_pp1(sglang_with_plugin, model_dirs):
    """A Llama target (captured on every stage through models/pp_capture) is accepted, and
    every DFLASH decision is the PP1 one."""
    pp = resolve(_dense_args(model_dirs, pp_size=2, draft="draft_dense"))
    pp1 = resolve(_dense_args(model_dirs, pp_size=1, draft="draft_dense"))
    assert "resolved" in pp, pp
    for field in DFLASH_FIELDS:
        assert pp["resolved"][field] == pp1["resolved"][field], field


def test_layer_partition_env_moves_ownership(sglang_with_plugin, model_dirs, monkeypatch):
    # [0, 1), [1, 8): the last stage now captures layers 0, 1, 2 -> accepted.
    monkeypatch.setenv("SGLANG_PP_LAYER_PARTITION", "1,7")
    assert "resolved" in resolve(_args(model_dirs, draft="draft_k3_early"))
    monkeypatch.setenv("SGLANG_PP_LAYER_PARTITION", "4,3")
    error = _error(resolve(_args(model_dirs)))
    assert "does not match num_hidden_layers" in error, error


def test_pp_spec_env_is_refused(sglang_with_plugin, model_dirs, monkeypatch):
    monkeypatch.setenv("SGLANG_ENABLE_PP_SPEC", "1")
    error = _error(resolve(_args(model_dirs)))
    assert "unset it" in error and "SGLANG_ENABLE_PP_SPEC" in error, error


def test_skip_pure_chunked_output_comm_env_is_refused(sglang_with_plugin, model_dirs, monkeypatch):
    """Stock skips the PP output relay of a lone middle chunk under this switch; the last
    stage's draft state then never arrives. Refused at startup, naming the variable; "0" and
    PP1 are untouched."""
    monkeypatch.setenv("SGLANG_PP_SKIP_PURE_CHUNKED_OUTPUT_COMM", "1")
    error = _error(resolve(_args(model_dirs)))
    assert "Unset SGLANG_PP_SKIP_PURE_CHUNKED_OUTPUT_COMM" in error, error
    assert "--pp-size 2" in error, error
    dense = _error(resolve(_dense_args(model_dirs)))
    assert "SGLANG_PP_SKIP_PURE_CHUNKED_OUTPUT_COMM" in dense, dense
    assert "resolved" in resolve(_args(model_dirs, pp_size=1))
    monkeypatch.setenv("SGLANG_PP_SKIP_PURE_CHUNKED_OUTPUT_COMM", "0")
    assert "resolved" in resolve(_args(model_dirs))


def test_an_online_quantised_draft_is_refused(sglang_with_plugin, model_dirs):
    """The draft inherits --quantization unless --speculative-draft-model-quantization is given;
    the PP stages handle the draft's weights unquantised, so either is refused, naming the way
    out, and ``unquant`` for the draft is accepted with a quantised target."""
    inherited = _error(resolve(_args(model_dirs, quantization="fp8")))
    assert "'fp8'" in inherited and "--speculative-draft-model-quantization unquant" in inherited
    explicit = _error(resolve(_args(model_dirs, speculative_draft_model_quantization="fp8")))
    assert "'fp8'" in explicit, explicit
    opted_out = resolve(
        _args(model_dirs, quantization="fp8", speculative_draft_model_quantization="unquant")
    )
    assert "resolved" in opted_out, opted_out
    assert opted_out["resolved"]["speculative_draft_model_quantization"] is None
    assert "resolved" in resolve(_args(model_dirs, pp_size=1, quantization="fp8"))


def test_launch_time_check_accepts_dflash_and_keeps_common_pp_asserts(sglang_with_plugin):
    """``check_pipeline_parallel_compat`` on a config-shaped object, as check_server_args calls it."""
    from types import SimpleNamespace

    from sglang.srt.arg_groups.validation_hook import check_pipeline_parallel_compat
    from sglang.srt.model_executor.cuda_graph_config import Backend

    def cfg(**kw):
        base = dict(
            speculative_algorithm="DFLASH",
            disaggregation_mode="prefill",
            disaggregation_transfer_backend="mooncake",
            disable_overlap_schedule=True,
            min_free_slots_delay=None,
            enable_multi_layer_eagle=False,
            pp_size=2,
            quantization=None,
            speculative_draft_model_quantization=None,
            cuda_graph_config=SimpleNamespace(
                prefill=SimpleNamespace(backend=Backend.DISABLED)
            ),
        )
        base.update(kw)
        return SimpleNamespace(**base)

    check_pipeline_parallel_compat(cfg())
    with pytest.raises(AssertionError, match="overlap schedule"):
        check_pipeline_parallel_compat(cfg(disable_overlap_schedule=False))
    with pytest.raises(AssertionError, match="min-free-slots-delay"):
        check_pipeline_parallel_compat(cfg(min_free_slots_delay=4))
    with pytest.raises(ValueError, match="PD decode server"):
        check_pipeline_parallel_compat(cfg(disaggregation_mode="decode"))
    # Not ours: stock EAGLE-only assertion still fires for other algorithms.
    with pytest.raises(AssertionError, match="only supports EAGLE"):
        check_pipeline_parallel_compat(cfg(speculative_algorithm="NGRAM"))


def test_unapplied_hook_aborts_startup_naming_it(sglang_with_plugin, model_dirs, monkeypatch):
    import sglang.srt.arg_groups.validation_hook as validation_hook

    patched = validation_hook.check_pipeline_parallel_compat
    monkeypatch.setattr(
        validation_hook, "check_pipeline_parallel_compat", patched.__wrapped__
    )
    error = _error(resolve(_args(model_dirs)))
    assert "RuntimeError" in error
    assert "sglang.srt.arg_groups.validation_hook.check_pipeline_parallel_compat" in error
    assert "Failed to apply hooks" in error
    # The same configuration at PP1 does not depend on us and still resolves.
    assert "resolved" in resolve(_args(model_dirs, pp_size=1))


def _stock_cases(dirs):
    draft_eagle = dirs["target"]  # any config works for the argument phase of EAGLE
    return {
        "dflash_pp1_prefill": _dense_args(dirs, pp_size=1),
        "dflash_pp1_null": _dense_args(dirs, pp_size=1, mode="null"),
        "dflash_pp1_decode": _dense_args(dirs, pp_size=1, mode="decode"),
        "dflash_k3_pp1_prefill": _args(dirs, pp_size=1),
        "dspark_pp2_prefill": dict(
            _dense_args(dirs),
            speculative_algorithm="DSPARK",
        ),
        "eagle_pp2_prefill": dict(
            _dense_args(dirs),
            speculative_algorithm="EAGLE",
            speculative_draft_model_path=draft_eagle,
            speculative_num_steps=3,
            speculative_eagle_topk=1,
            speculative_num_draft_tokens=4,
        ),
        "no_spec_pp2_prefill": dict(
            model_path=dirs["target"],
            pp_size=2,
            disaggregation_mode="prefill",
            disaggregation_transfer_backend="mooncake",
            device="cuda",
            random_seed=0,
        ),
    }


def test_other_configurations_resolve_exactly_as_stock(sglang_with_plugin, model_dirs, tmp_path):
    """Resolve the same cases with our plugin (here) and with no plugin (a subprocess that
    whitelists no plugin through SGLANG_PLUGINS); the outcomes must be identical."""
    cases = _stock_cases(model_dirs)
    cases_file = tmp_path / "cases.json"
    cases_file.write_text(json.dumps(cases))
    env = dict(os.environ, SGLANG_PLUGINS="no-plugin-at-all")
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "resolution.py"), str(cases_file)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    stock = json.loads(proc.stdout.strip().splitlines()[-1])
    ours = {name: resolve(kwargs) for name, kwargs in cases.items()}
    assert set(stock) == set(ours)
    # Guard against a vacuous comparison: every case really resolves, not just fails alike.
    for name, outcome in stock.items():
        assert "resolved" in outcome, (name, outcome)
    for name in cases:
        assert ours[name] == stock[name], name
