"""A DFLASH draft pruned to its context KV write (the last PP stage of a prefill) writes
the same draft K/V as the full draft, and holds less."""

import socket
import unittest

import torch
from transformers import PretrainedConfig

from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=20, suite="base-a-test-cpu")

HIDDEN = 64


def _draft():
    from sglang.srt.models.dflash import DFlashDraftModel

    config = PretrainedConfig(
        architectures=["DFlashDraftModel"],
        model_type="qwen3",
        vocab_size=512,
        hidden_size=HIDDEN,
        intermediate_size=4 * HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        torch_dtype="float32",
        block_size=4,
        num_target_layers=8,
        dflash_config=dict(block_size=4, mask_token_id=260, target_layer_ids=[1, 3]),
    )
    model = DFlashDraftModel(config).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.ndim == 1 else 0.0))
    return model


def _context_kv(model, features):
    """The draft K/V of a context, as DFlashWorkerV2 writes them layer by layer."""
    positions = torch.arange(features.shape[0])
    ctx = model.project_target_hidden(features)
    out = []
    for layer in model.layers:
        attn = layer.self_attn
        k, v = attn.kv_proj_only(model.prepare_context_hidden_for_kv(layer, ctx))
        out.append((attn.apply_k_rope(positions, attn.apply_k_norm(k)), v))
    return out


def _param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


class TestPrune(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        from sglang.test.layer_ut_utils import init_single_process_dist

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        init_single_process_dist(master_port=port)
        # RoPE's native path, as on a CPU build (SGLANG_USE_CPU_ENGINE).
        import sglang.srt.layers.rotary_embedding.base as rotary_base

        rotary_base._is_cpu = True

    def test_pruned_draft_writes_the_same_kv_and_holds_less(self):
        model = _draft()
        features = torch.randn(7, 2 * HIDDEN)
        with torch.no_grad():
            full = _context_kv(model, features)
            full_bytes = _param_bytes(model)
            dropped = sum(
                _param_bytes(layer.mlp) + _param_bytes(layer.self_attn.o_proj)
                for layer in model.layers
            )
            model.prune_to_ctx_kv_injection()
            pruned = _context_kv(model, features)
        self.assertTrue(all(layer.mlp is None for layer in model.layers))
        self.assertEqual(_param_bytes(model), full_bytes - dropped)
        self.assertGreater(dropped, full_bytes // 2)
        for (k0, v0), (k1, v1) in zip(full, pruned):
            self.assertTrue(torch.equal(k0, k1) and torch.equal(v0, v1))


if __name__ == "__main__":
    unittest.main()
