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


# --- Real CPU server helpers (cpu-harness.md item 5): weights and tokenizer. ---

BYTE_TOKENIZER_SPECIALS = ("<s>", "</s>", "<unk>", "<pad>", "<|mask|>")  # ids 256..260
BYTE_TOKENIZER_VOCAB = 512
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def write_byte_tokenizer(path: str) -> str:
    """A byte-level BPE tokenizer with no merges: the 256 byte symbols, then the specials
    (ids 256-260), padded with ``<extra_i>`` to 512 entries. Saved with ``save_pretrained``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for tok in BYTE_TOKENIZER_SPECIALS:
        vocab[tok] = len(vocab)
    while len(vocab) < BYTE_TOKENIZER_VOCAB:
        vocab[f"<extra_{len(vocab)}>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    )
    fast.chat_template = TINY_CHAT_TEMPLATE
    os.makedirs(path, exist_ok=True)
    fast.save_pretrained(path)
    return path


def write_tiny_llama_with_weights(path: str, seed: int = 0) -> str:
    """A random ``LlamaForCausalLM`` (vocab 512, hidden 64, 2 layers, 4 heads / 2 KV heads,
    head_dim 16) saved in bf16 with ``save_pretrained``, plus the byte-level tokenizer.
    Seeded, so its greedy outputs are the same on every run."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=BYTE_TOKENIZER_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=259,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    write_byte_tokenizer(path)
    return path


def kimi_k3_dflash_draft_config(
    target_layer_ids: Sequence[int] = (2, 5, 8, 11, 13, 15),
    *,
    num_target_layers: int = 16,
    block_size: int = 16,
) -> dict:
    """A tiny stand-in for the Kimi-K3 DFlash draft: 6 layers, 8 KV heads, block size 16,
    sliding window 4096, six capture layers spread like the real [19, 37, 54, 66, 78, 90]
    over a ``num_target_layers``-layer target (hidden 128, as ``kimi_k3_text_config``)."""
    config = dflash_draft_config(
        target_layer_ids,
        hidden=128,
        num_layers=6,
        num_kv_heads=8,
        head_dim=16,
        num_target_layers=num_target_layers,
        num_attention_heads=8,
        sliding_window=4096,
    )
    config["block_size"] = block_size
    config["dflash_config"]["block_size"] = block_size
    return config
