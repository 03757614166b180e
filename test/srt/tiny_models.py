"""Tiny local model directories for CPU tests: config.json (and, when asked, random weights and a
byte-level tokenizer). No hub access; everything is generated under a pytest tmp dir.
"""

from __future__ import annotations

import json
import os
from typing import Optional, Sequence

# The dense target every test suite shares: 8 layers so PP2..PP8 splits exist.
TARGET_LAYERS = 8
HIDDEN = 64
DRAFT_KV_HEADS = 2
DRAFT_HEAD_DIM = 16
BLOCK_SIZE = 8
MASK_TOKEN_ID = 260


def _write_config(path: str, config: dict) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return path


def llama_target_config(num_layers: int = TARGET_LAYERS, hidden: int = HIDDEN) -> dict:
    return dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        vocab_size=512,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        torch_dtype="bfloat16",
        tie_word_embeddings=False,
        bos_token_id=256,
        eos_token_id=257,
    )


def dflash_draft_config(
    target_layer_ids: Optional[Sequence[int]] = (1, 3, 5, 7),
    *,
    hidden: int = HIDDEN,
    num_layers: int = 2,
    num_kv_heads: int = DRAFT_KV_HEADS,
    head_dim: int = DRAFT_HEAD_DIM,
    num_target_layers: int = TARGET_LAYERS,
    architecture: str = "DFlashDraftModel",
    **extra,
) -> dict:
    dflash = dict(block_size=BLOCK_SIZE, mask_token_id=MASK_TOKEN_ID)
    if target_layer_ids is not None:
        dflash["target_layer_ids"] = list(target_layer_ids)
    config = dict(
        architectures=[architecture],
        model_type="qwen3",
        vocab_size=512,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        torch_dtype="bfloat16",
        block_size=BLOCK_SIZE,
        num_target_layers=num_target_layers,
        dflash_config=dflash,
    )
    config.update(extra)
    return config


def kimi_k3_text_config(num_layers: int = 4) -> dict:
    """Text-only Kimi-K3 (``KimiK3LinearForCausalLM``): MLA full attention + KDA + MoE."""
    kda = [i for i in range(1, num_layers + 1) if i % 2 == 1]
    full = [i for i in range(1, num_layers + 1) if i % 2 == 0]
    return dict(
        architectures=["KimiK3LinearForCausalLM"],
        model_type="kimi_linear",
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        torch_dtype="bfloat16",
        num_experts=4,
        num_experts_per_token=2,
        moe_intermediate_size=64,
        num_shared_experts=1,
        first_k_dense_replace=1,
        moe_router_activation_func="sigmoid",
        q_lora_rank=None,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        mla_use_nope=True,
        linear_attn_config=dict(
            kda_layers=kda,
            full_attn_layers=full,
            num_heads=4,
            head_dim=32,
            short_conv_kernel_size=4,
        ),
        bos_token_id=256,
        eos_token_id=257,
    )


def write_model_dir(path: str, config: dict) -> str:
    return _write_config(path, config)
