"""Session-wide fixtures: the patched sglang tree, and tiny model directories."""

from __future__ import annotations

import importlib.util
import os

import pytest

import tiny_models


@pytest.fixture(scope="session")
def patched_sglang():
    """The installed sglang carries the patch series (its new module is importable). Nothing is
    loaded into it: the change is in-tree now, where the plugin once hooked it at startup."""
    assert importlib.util.find_spec("sglang.srt.speculative.dflash_pp") is not None, (
        "the installed sglang is not patched; apply the series (sglang-dflash-pp install)"
    )
    return True


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    """Tiny config-only model directories (no weights): dense target, Kimi-K3, DFlash drafts."""
    root = tmp_path_factory.mktemp("models")
    d = lambda name: str(root / name)  # noqa: E731
    k3_draft = lambda ids, **kw: tiny_models.dflash_draft_config(  # noqa: E731
        ids, hidden=128, head_dim=32, num_target_layers=8, **kw
    )
    dirs = {
        "target": tiny_models.write_model_dir(d("target"), tiny_models.llama_target_config()),
        "kimi_k3": tiny_models.write_model_dir(d("kimi_k3"), tiny_models.kimi_k3_text_config(8)),
        "draft": tiny_models.write_model_dir(d("draft"), tiny_models.dflash_draft_config()),
        # Llama captures layer L at the input of layer L+1: 1, 3, 5 (not the final 7).
        "draft_dense": tiny_models.write_model_dir(
            d("draft_dense"), tiny_models.dflash_draft_config((1, 3, 5))
        ),
        "qwen2_target": tiny_models.write_model_dir(
            d("qwen2_target"),
            {**tiny_models.llama_target_config(), "architectures": ["Qwen2ForCausalLM"],
             "model_type": "qwen2"},
        ),
        # A sliding-window target: its pool (SWAKVPool) publishes no KV layer ids.
        "gpt_oss_target": tiny_models.write_model_dir(
            d("gpt_oss_target"),
            {**tiny_models.llama_target_config(), "architectures": ["GptOssForCausalLM"],
             "model_type": "gpt_oss", "num_local_experts": 4, "num_experts_per_tok": 2,
             "sliding_window": 128,
             "layer_types": ["sliding_attention", "full_attention"] * (tiny_models.TARGET_LAYERS // 2)},
        ),
        "draft_k3": tiny_models.write_model_dir(d("draft_k3"), k3_draft((1, 3, 5, 7))),
        "draft_k3_early": tiny_models.write_model_dir(d("draft_k3_early"), k3_draft((0, 1, 2))),
        "draft_unsorted": tiny_models.write_model_dir(
            d("draft_unsorted"), k3_draft((5, 1, 3, 7))
        ),
        "draft_duplicated": tiny_models.write_model_dir(
            d("draft_duplicated"), k3_draft((1, 3, 3, 7))
        ),
        "draft_quantised": tiny_models.write_model_dir(
            d("draft_quantised"),
            k3_draft(
                (1, 3, 5, 7),
                quantization_config={"quant_method": "fp8", "activation_scheme": "dynamic"},
            ),
        ),
        "draft_laguna": tiny_models.write_model_dir(
            d("draft_laguna"), k3_draft((1, 3, 5, 7), architecture="DFlashLagunaForCausalLM")
        ),
    }
    return dirs


@pytest.fixture(scope="session")
def single_process_dist(patched_sglang):
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


class CpuSglangServer:
    """A real ``python -m sglang.launch_server`` on this CPU box (``test/cpu_servers.py``): tiny
    random bf16 Llama, byte-level tokenizer, no speculative decoding. Started on demand and
    restarted if a test killed it on purpose."""

    STARTUP_TIMEOUT_S = 300

    def __init__(self, root):
        import cpu_servers
        import tiny_models as tm

        self.root = str(root)
        self.model_dir = tm.write_tiny_llama_with_weights(os.path.join(self.root, "llama"))
        self.stub_dir = cpu_servers.write_server_stubs(os.path.join(self.root, "stub"))
        self.server = None
        self.starts = 0

    @property
    def base_url(self) -> str:
        return self.server.base_url

    def alive(self) -> bool:
        return self.server is not None and self.server.alive()

    def start(self) -> None:
        import cpu_servers

        self.starts += 1
        args = ["--max-total-tokens", "2048", "--max-running-requests", "4", "--sleep-on-idle"]
        self.server = cpu_servers.launch_server(
            f"server-{self.starts}", self.root, self.model_dir, args, stub_root=self.stub_dir
        ).wait_ready(self.STARTUP_TIMEOUT_S)

    def ensure_running(self) -> "CpuSglangServer":
        if not self.alive():
            self.kill()
            self.start()
        return self

    def kill(self) -> None:
        """SIGKILL the launcher and every descendant, then reap."""
        if self.server is not None:
            self.server.kill()


@pytest.fixture(scope="session")
def cpu_server_factory(tmp_path_factory):
    """One CPU SGLang server per test session (started by the first test that asks for it)."""
    server = CpuSglangServer(tmp_path_factory.mktemp("cpu_server"))
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
def cpu_server(cpu_server_factory):
    """The session's CPU server, restarted first if an earlier test killed it on purpose."""
    return cpu_server_factory.ensure_running()


@pytest.fixture(scope="module")
def dflash_runtime_config(patched_sglang):
    """A published runtime config (DFLASH; everything else default, e.g. no unified memory), as a
    server process has one, for driving disaggregation code outside a server; restored to
    whatever was published before when the module ends."""
    from sglang.srt.runtime_context import get_context

    override = get_context().override_server_args(speculative_algorithm="DFLASH")
    override.install()
    try:
        yield
    finally:
        override.restore()
