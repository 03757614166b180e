"""Tiny fp32 model directories with seeded weights for the end-to-end servers.

* :func:`write_llama_target`: a random ``LlamaForCausalLM`` (saved by transformers) with the
  byte-level tokenizer; 4 layers so a PP2 prefill has two stages of two layers.
* :func:`write_dflash_draft`: a random ``DFlashDraftModel`` checkpoint, written tensor by tensor
  under the names sglang's ``DFlashDraftModel.load_weights`` maps (HF q/k/v/o, gate/up/down,
  norms, ``fc``, ``hidden_norm``). Every parameter the model has is written, so nothing is left
  uninitialised (``test_every_draft_parameter_is_in_the_checkpoint`` checks the names against the
  real class).
* :func:`write_cycling_target` / zero-norm draft: the constructed pair whose acceptance is known
  in closed form (``verify_steps``).

Everything is generated under a pytest tmp dir; no hub access.
"""

from __future__ import annotations

import json
import os
from typing import Dict, List, Sequence, Tuple

import torch

VOCAB = 512
HIDDEN = 64
TARGET_LAYERS = 4
TARGET_HEADS = 4
HEAD_DIM = 16
BLOCK_SIZE = 4
MASK_TOKEN_ID = 260
# Llama captures the output of layer L at the input of layer L + 1, so the last layer (3) cannot
# be a feature. With PP2 ([0, 2), [2, 4)) stage 0 owns feature 0 and stage 1 features 1 and 2.
TARGET_LAYER_IDS = (0, 1, 2)


def _byte_tokenizer(path: str) -> None:
    import tiny_models

    tiny_models.write_byte_tokenizer(path)


def write_llama_target(path: str, *, kv_heads: int = 2, seed: int = 0, std: float = 0.02) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
        num_hidden_layers=TARGET_LAYERS, num_attention_heads=TARGET_HEADS,
        num_key_value_heads=kv_heads, head_dim=HEAD_DIM, max_position_embeddings=4096,
        bos_token_id=256, eos_token_id=257, pad_token_id=259, tie_word_embeddings=False,
        initializer_range=std, torch_dtype="float32",
    )  # fmt: skip
    torch.manual_seed(seed)
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(path)
    _byte_tokenizer(path)
    return path


def draft_config(*, kv_heads: int = 2, num_layers: int = 2,
                 target_layer_ids: Sequence[int] = TARGET_LAYER_IDS, hidden: int = HIDDEN,
                 num_target_layers: int = TARGET_LAYERS, dtype: str = "float32") -> dict:
    return dict(
        architectures=["DFlashDraftModel"], model_type="qwen3", vocab_size=VOCAB,
        hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=num_layers,
        num_attention_heads=TARGET_HEADS, num_key_value_heads=kv_heads, head_dim=HEAD_DIM,
        max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=10000.0,
        torch_dtype=dtype, block_size=BLOCK_SIZE, num_target_layers=num_target_layers,
        dflash_config=dict(target_layer_ids=list(target_layer_ids), block_size=BLOCK_SIZE,
                           mask_token_id=MASK_TOKEN_ID),
    )  # fmt: skip


def draft_tensors(config: dict, seed: int, *, zero_final_norm: bool = False) -> Dict[str, torch.Tensor]:
    """Seeded tensors for every parameter of ``DFlashDraftModel(config)``, HF-named."""
    g = torch.Generator().manual_seed(seed)
    H, inter = config["hidden_size"], config["intermediate_size"]
    nh, kvh, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    k = len(config["dflash_config"]["target_layer_ids"])

    def w(*shape, std=0.2):
        return torch.randn(*shape, generator=g) * std

    def norm(n):
        return 1 + w(n, std=0.1)

    out = {"fc.weight": w(H, k * H, std=0.1), "hidden_norm.weight": norm(H),
           "norm.weight": torch.zeros(H) if zero_final_norm else norm(H)}  # fmt: skip
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        out.update({
            p + "self_attn.q_proj.weight": w(nh * hd, H), p + "self_attn.k_proj.weight": w(kvh * hd, H),
            p + "self_attn.v_proj.weight": w(kvh * hd, H), p + "self_attn.o_proj.weight": w(H, nh * hd),
            p + "self_attn.q_norm.weight": norm(hd), p + "self_attn.k_norm.weight": norm(hd),
            p + "mlp.gate_proj.weight": w(inter, H), p + "mlp.up_proj.weight": w(inter, H),
            p + "mlp.down_proj.weight": w(H, inter),
            p + "input_layernorm.weight": norm(H), p + "post_attention_layernorm.weight": norm(H),
        })  # fmt: skip
    return out


def write_dflash_draft(path: str, *, kv_heads: int = 2, seed: int = 1,
                       zero_final_norm: bool = False, **config_kw) -> str:
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    config = draft_config(kv_heads=kv_heads, **config_kw)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    tensors = draft_tensors(config, seed, zero_final_norm=zero_final_norm)
    dtype = getattr(torch, config["torch_dtype"])
    save_file({k: v.to(dtype).contiguous() for k, v in tensors.items()},
              os.path.join(path, "model.safetensors"))
    return path


def write_disagreeing_draft(path: str) -> str:
    """A draft for the cycling target that proposes token 3 at every block position, a token
    the target never outputs: its acceptance is 0 wherever the constructed draft's is 1/2.

    The draft's proposals are the target's LM head (logits of tokens 0, 1, 2 = hidden dims 2,
    0, 1; every other token 0) over its final hidden state. Here a block position's residual is
    its token's embedding (one-hot dim 2 for the mask token) plus the first layer's attention
    output: the context is zeroed (fc = 0), queries are 0 (uniform attention), every block
    token's value is the same positive vector, and o_proj writes it negatively into dims 0 and
    1; the other layers and every MLP add nothing. The final norm's weight is -1 on dim 2. So tokens 0, 1, 2 get negative logits and
    argmax is the first token at 0: token 3."""
    from safetensors.torch import save_file

    config = draft_config()
    tensors = draft_tensors(config, seed=3)
    hd = config["head_dim"]
    tensors["fc.weight"].zero_()
    tensors["norm.weight"] = torch.ones(HIDDEN)
    tensors["norm.weight"][2] = -1.0
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        tensors[p + "self_attn.q_proj.weight"].zero_()
        tensors[p + "mlp.down_proj.weight"].zero_()
        tensors[p + "input_layernorm.weight"] = torch.ones(HIDDEN)
        v = torch.zeros_like(tensors[p + "self_attn.v_proj.weight"])
        o = torch.zeros_like(tensors[p + "self_attn.o_proj.weight"])
        if i == 0:  # the later layers add nothing
            v[0, :CYCLE] = 1.0  # KV head 0, element 0: the same for every one-hot embedding
            for h in range(config["num_attention_heads"]):  # query heads of KV head 0
                if h * config["num_key_value_heads"] // config["num_attention_heads"] == 0:
                    o[0, h * hd] = o[1, h * hd] = -1.0
        tensors[p + "self_attn.v_proj.weight"] = v
        tensors[p + "self_attn.o_proj.weight"] = o
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    save_file({k: v.contiguous() for k, v in tensors.items()},
              os.path.join(path, "model.safetensors"))
    return path


def write_context_draft(path: str, scale: float = 0.05) -> str:
    """A draft for the cycling target whose proposal depends on its context KV: token 1 while
    the request's context outweighs the block, token 3 (never output) when it does not.

    As ``write_disagreeing_draft`` (uniform attention in the first layer, its value written
    negatively into residual dims 0 and 1, final norm weight -1 on dim 2), but the context is
    kept: ``fc`` maps every captured feature to hidden dim 5, whose value is ``-scale`` per
    context token against +1 per block token. With c context tokens and m visible block
    tokens, the attention output has the sign of ``m - scale * c``: negative (token 1, whose
    logit is then the largest) once ``c > m / scale`` (80 tokens: prompts of 90 and more),
    positive (token 3) when the context is missing. So a decode whose transferred draft KV is
    zeroed proposes 3 until it has generated 80 tokens itself."""
    from safetensors.torch import save_file

    write_disagreeing_draft(path)
    from safetensors.torch import load_file

    tensors = load_file(os.path.join(path, "model.safetensors"))
    fc = torch.zeros_like(tensors["fc.weight"])
    fc[5, :CYCLE] = 1.0  # feature 0's one-hot dims -> hidden dim 5, for every token
    tensors["fc.weight"] = fc
    tensors["hidden_norm.weight"] = torch.ones(HIDDEN)
    v = tensors["layers.0.self_attn.v_proj.weight"]
    v[0, 5] = -scale
    save_file({k: t.contiguous() for k, t in tensors.items()},
              os.path.join(path, "model.safetensors"))
    return path


def write_draft_config_only(path: str, **config_kw) -> str:
    """The draft directory an operator has before the weights: ``config.json`` alone."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(draft_config(**config_kw), f, indent=1)
    return path


# -- Kimi-K3 -------------------------------------------------------------------------------------
# A tiny text-only KimiK3LinearForCausalLM: 4 layers, KDA at layers 0 and 2, MLA at 1 and 3
# (1-based 1,3 / 2,4 in linear_attn_config), MoE from layer 1. kv_lora_rank 256 + rope 32 makes
# the MLA key width 288, one the Triton MLA decode kernel special-cases (cpu-servers.md section
# 3). No weights on disk: the servers load --load-format dummy, seeded per parameter name by the
# test support (cpu_support patch 9). The draft captures layers 0, 2 and 3 (the final layer is
# read at the final norm): under PP2 ([0, 2), [2, 4)) stage 0 owns feature 0, stage 1 the rest.

K3_HIDDEN = 128
K3_LAYERS = 4
K3_TARGET_LAYER_IDS = (0, 2, 3)


def write_kimi_k3_target(path: str) -> str:
    import tiny_models

    config = tiny_models.kimi_k3_text_config(K3_LAYERS)
    config.update(kv_lora_rank=256, qk_rope_head_dim=32, vocab_size=VOCAB)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    _byte_tokenizer(path)
    return path


def write_kimi_k3_draft(path: str) -> str:
    return write_dflash_draft(path, hidden=K3_HIDDEN, num_target_layers=K3_LAYERS,
                              target_layer_ids=K3_TARGET_LAYER_IDS, dtype="bfloat16")


# -- the constructed pair ----------------------------------------------------------------------
# Target: every layer's output projections are zero, so the residual stream is the token's own
# embedding; token t embeds as the basis vector e_{t mod 3} and lm_head row j (j < 3) is
# e_{(j - 1) mod 3}, every other row zero. So the next token after t is (t + 1) mod 3, whatever
# came before: the output cycles 0 -> 1 -> 2 -> 0.
# Draft: final norm weight zero, so its hidden states are zero, every logit is zero and the
# greedy proposal is token 0 (argmax takes the first maximum) at every block position.

CYCLE = 3


def write_cycling_target(path: str) -> str:
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    write_llama_target(path)  # config, tokenizer and correctly named tensors
    with open(os.path.join(path, "config.json")) as f:
        cfg = LlamaConfig(**json.load(f))
    from safetensors.torch import load_file

    tensors = load_file(os.path.join(path, "model.safetensors"))
    embed = torch.zeros(VOCAB, HIDDEN)
    embed[torch.arange(VOCAB), torch.arange(VOCAB) % CYCLE] = 1.0
    head = torch.zeros(VOCAB, HIDDEN)
    for j in range(CYCLE):
        head[j, (j - 1) % CYCLE] = 1.0
    for name in list(tensors):
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[name] = torch.zeros_like(tensors[name])
    tensors["model.embed_tokens.weight"] = embed
    tensors["lm_head.weight"] = head
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"))
    assert cfg.num_hidden_layers == TARGET_LAYERS
    return path


def cycling_output(last_prompt_token: int, n: int) -> List[int]:
    """The constructed target's greedy output after a prompt ending in ``last_prompt_token``."""
    out, t = [], last_prompt_token
    for _ in range(n):
        t = (t + 1) % CYCLE
        out.append(t)
    return out


def verify_steps(output: Sequence[int], block_size: int = BLOCK_SIZE,
                 proposal: int = 0) -> List[Tuple[int, int]]:
    """(draft tokens accepted, tokens committed) per DFLASH verify step on the decode server, by
    simulating the verify rule on the constructed pair: the first output token comes from the
    prefill; each step drafts ``block_size - 1`` tokens ``proposal`` (the constructed draft's
    0) after the last committed token, accepts
    the longest prefix the target agrees with, and commits it plus the target's next token
    (the last step commits only what ``max_new_tokens`` leaves)."""
    steps, i = [], 1  # output[0] is the prefill's token
    while i < len(output):
        accepted = 0
        prev = output[i - 1]
        while accepted < block_size - 1 and (prev + 1) % CYCLE == proposal:
            accepted += 1
            prev = proposal
        commit = min(accepted + 1, len(output) - i)
        steps.append((accepted, commit))
        i += commit
    return steps
