"""Session-wide fixtures: SGLang with our plugin loaded, and tiny model directories."""

from __future__ import annotations

import os

import pytest

import tiny_models


@pytest.fixture(scope="session")
def sglang_with_plugin():
    """Load plugins exactly as every SGLang server process does."""
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang_dflash_pp.hooks import registered_hooks

    assert registered_hooks(), "sglang-dflash-pp did not register through the entry point"
    return True


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    """Tiny config-only model directories (no weights): dense target, Kimi-K3, DFlash drafts."""
    root = tmp_path_factory.mktemp("models")
    d = lambda name: str(root / name)  # noqa: E731
    dirs = {
        "target": tiny_models.write_model_dir(d("target"), tiny_models.llama_target_config()),
        "kimi_k3": tiny_models.write_model_dir(d("kimi_k3"), tiny_models.kimi_k3_text_config()),
        "draft": tiny_models.write_model_dir(d("draft"), tiny_models.dflash_draft_config()),
        "draft_k3": tiny_models.write_model_dir(
            d("draft_k3"),
            tiny_models.dflash_draft_config(
                (0, 1, 2, 3), hidden=128, num_target_layers=4, head_dim=32
            ),
        ),
        "draft_unsorted": tiny_models.write_model_dir(
            d("draft_unsorted"), tiny_models.dflash_draft_config((5, 1, 3, 7))
        ),
        "draft_duplicated": tiny_models.write_model_dir(
            d("draft_duplicated"), tiny_models.dflash_draft_config((1, 3, 3, 7))
        ),
        "draft_quantised": tiny_models.write_model_dir(
            d("draft_quantised"),
            tiny_models.dflash_draft_config(
                quantization_config={"quant_method": "fp8", "activation_scheme": "dynamic"}
            ),
        ),
        "draft_laguna": tiny_models.write_model_dir(
            d("draft_laguna"),
            tiny_models.dflash_draft_config(architecture="DFlashLagunaForCausalLM"),
        ),
    }
    return dirs


@pytest.fixture(scope="session")
def single_process_dist(sglang_with_plugin):
    """World-size-1 gloo distributed state and a published runtime context, as sglang's own
    layer tests set it up (``sglang.test.layer_ut_utils.init_single_process_dist``); the srt
    layers read their TP groups from it even at TP1.

    Test-side shim: ``RotaryEmbedding`` binds a CUDA fallback kernel unless the module-level
    ``_is_cpu`` flag (frozen at import from SGLANG_USE_CPU_ENGINE, which would switch the whole
    platform to a CPU-kernel build that is not installable here) is set; on this CPU-only
    machine we set it so RoPE runs its native torch path."""
    import socket

    import sglang.srt.layers.rotary_embedding.base as rotary_base
    from sglang.test.layer_ut_utils import init_single_process_dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_single_process_dist(master_port=port)
    rotary_base._is_cpu = True
    return True

