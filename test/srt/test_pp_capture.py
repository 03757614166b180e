"""Each hooked target class captures, on every PP stage, exactly the features our ownership rule
gives that stage, with the unsplit model's values (``models/pp_capture`` + ``capture_ownership``).

For every class in ``pp_capture.HOOKED_CLASSES`` (Llama, Qwen3, Qwen3-MoE, gpt-oss) this builds
sglang 0.5.23's own model for each stage of several PP splits in this one process (world size 1,
gloo; the stage is selected by overriding ``get_parallel()``'s pp_rank / pp_size / pp_group, as
``test_kimi_k3_capture_ownership`` does), arms it with its own ``set_dflash_layers_to_capture``
(through our hook) inside a published DFLASH PD-prefill runtime context, and chains the real
stage forwards, each non-first stage fed the ``PPProxyTensors`` the previous stage returned minus
the raw captures (our worker replaces them with the partial). Each captured block is then
identified by value alone: layer L+1's real ``input_layernorm`` applied to the capture of layer L
must give the input layer L+1's attention received; for gpt-oss's final layer, the final norm
must give the stage's output.

Real: the model classes and their PP construction, the decoder layers with their stage boundaries
(the capture path the hook hands its accumulator to), dense MLP and MoE (native CPU path) with
seeded weights, embedding, final norm, ``residual_batch.to_pp`` / ``from_pp``, a ``ForwardBatch``.
Stand-in, because attention needs a KV pool and backend metadata that this in-process harness
does not build: each layer's ``self_attn`` (a deterministic function of its input that records
the input; the real servers in ``test/e2e`` run the real attention).

Also: the hooks are inert for PP1, for the last stage, and outside a DFLASH PD prefill (the
stock setter's effect, exactly).
"""

from __future__ import annotations

from typing import List, Optional

import pytest
import torch

from pp_stage_models import StandInAttention, seed_weights, stage_context
from sglang_dflash_pp.srt.models.capture_ownership import (
    PP_CAPTURE_TARGETS,
    capture_convention,
    compute_feature_ownership,
)

N = 8
HIDDEN = 64
TOKENS = 5
DTYPE = torch.float32

SPLITS = [(2, None), (3, None), (4, "2,1,3,2"), (4, "1,3,2,2")]


def _configs():
    from transformers import GptOssConfig, LlamaConfig, Qwen3Config, Qwen3MoeConfig

    common = dict(vocab_size=512, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                  num_hidden_layers=N, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, max_position_embeddings=4096, rms_norm_eps=1e-6,
                  tie_word_embeddings=False)  # fmt: skip
    return {
        "LlamaForCausalLM": LlamaConfig(**common),
        "Qwen3ForCausalLM": Qwen3Config(**common),
        "Qwen3MoeForCausalLM": Qwen3MoeConfig(
            **common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
        ),
        "GptOssForCausalLM": GptOssConfig(
            **common, num_local_experts=4, num_experts_per_tok=2, sliding_window=16,
            layer_types=["sliding_attention", "full_attention"] * (N // 2),
        ),
    }


CLASSES = {
    "LlamaForCausalLM": "sglang.srt.models.llama",
    "Qwen3ForCausalLM": "sglang.srt.models.qwen3",
    "Qwen3MoeForCausalLM": "sglang.srt.models.qwen3_moe",
    "GptOssForCausalLM": "sglang.srt.models.gpt_oss",
}


def id_sets(arch: str):
    sets = [(0, 2, 4, 6), (1, 3, 5), (2, 4, 5), (0, 1, 2, 3, 4, 5, 6)]
    if capture_convention([arch]).final_layer_at_norm:
        sets.append((1, 3, 5, 7))  # the final layer, read at the final norm
    return sets


class Stage:
    def __init__(self, arch: str, config, pp_rank: int, pp_size: int, partition):
        import importlib

        self.arch, self.pp_rank, self.pp_size, self.partition = arch, pp_rank, pp_size, partition
        cls = getattr(importlib.import_module(CLASSES[arch]), arch)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(DTYPE)
        try:
            with self.context():
                self.model = cls(config)
        finally:
            torch.set_default_dtype(previous)
        seed_weights(self.model)
        self.backbone = self.model.model
        for i in range(self.backbone.start_layer, self.backbone.end_layer):
            self.backbone.layers[i].self_attn = StandInAttention(i)

    def context(self):
        return stage_context(self.pp_rank, self.pp_size, self.partition)

    @property
    def is_last(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def forward(self, ids, proxy):
        """The stage backbone called as the ForCausalLM calls it (module ``__call__``, so torch
        module hooks run). Returns (captured blocks, outgoing proxy, final hidden or None)."""
        import torch._dynamo.config as dynamo_config
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

        forward_batch = ForwardBatch(
            forward_mode=ForwardMode.EXTEND, batch_size=1,
            input_ids=torch.arange(TOKENS) * 37 % 512,
            req_pool_indices=torch.zeros(1, dtype=torch.long), seq_lens=torch.tensor([TOKENS]),
            out_cache_loc=torch.arange(TOKENS), seq_lens_sum=TOKENS,
        )  # fmt: skip
        with self.context(), dynamo_config.patch(disable=True), torch.no_grad():
            self.model.set_dflash_layers_to_capture(list(ids))
            out = self.backbone(forward_batch.input_ids, torch.arange(TOKENS), forward_batch,
                                pp_proxy_tensors=proxy)
        if not self.is_last:
            captured = out.tensors.pop("dspark_hidden_states", None)
            blocks = [] if captured is None else list(captured.split(HIDDEN, dim=-1))
            return blocks, out, None
        if isinstance(out, tuple):
            hidden, aux = out
            return [b for t in aux for b in t.split(HIDDEN, dim=-1)], None, hidden
        return [], None, out

    def identify(self, block: torch.Tensor, final_hidden: Optional[torch.Tensor]) -> int:
        candidates = {}
        for i in range(max(self.backbone.start_layer, 1), self.backbone.end_layer):
            layer = self.backbone.layers[i]
            candidates[i - 1] = (layer.input_layernorm, layer.self_attn.last_input)
        if self.is_last and final_hidden is not None:
            candidates[N - 1] = (self.backbone.norm, final_hidden)
        errors = {}
        for layer_id, (norm, seen) in candidates.items():
            with torch.no_grad():
                normed = norm(block.clone()).float()
            errors[layer_id] = ((normed - seen.float()).abs().max() / seen.float().abs().max()).item()
        matches = [layer_id for layer_id, err in errors.items() if err < 1e-4]
        assert len(matches) == 1, (self.arch, self.pp_rank, errors)
        assert all(err > 0.05 for lid, err in errors.items() if lid != matches[0]), errors
        return matches[0]


@pytest.fixture(scope="module")
def prefill_context(single_process_dist, sglang_with_plugin):
    """A published DFLASH PD-prefill runtime context (what a prefill server process has)."""
    from sglang.srt.runtime_context import get_context

    override = get_context().override_server_args(
        speculative_algorithm="DFLASH", disaggregation_mode="prefill"
    )
    override.install()
    try:
        yield
    finally:
        override.restore()


@pytest.fixture(scope="module")
def stages(prefill_context):
    """Fresh stage models per capture set: the stock setters are meant to be armed once
    (Qwen3-MoE's marks layers and never unmarks them)."""
    configs = _configs()

    def get(arch: str, pp_size: int, partition) -> List[Stage]:
        return [Stage(arch, configs[arch], r, pp_size, partition) for r in range(pp_size)]

    return get


def test_every_hooked_class_is_an_accepted_architecture_and_back():
    from sglang_dflash_pp.srt.models.pp_capture import HOOKED_CLASSES

    hooked = {dotted.rsplit(".", 1)[1] for dotted in HOOKED_CLASSES}
    assert hooked == set(CLASSES)
    native = {"KimiK3ForConditionalGeneration", "KimiK3LinearForCausalLM"}  # K3 relays natively
    assert set(PP_CAPTURE_TARGETS) == hooked | native


@pytest.mark.parametrize("arch", list(CLASSES))
def test_pp1_captures_are_stock(stages, arch):
    """PP1 (a non-PP server, or D): the hook calls the stock setter and adds nothing; the
    captures are the stock last-rank captures, one per id, identified by value."""
    ((stage,),) = [stages(arch, 1, None)]
    ids = (0, 2, 4, 6)
    blocks, _, final_hidden = stage.forward(ids, None)
    assert "_dflash_pp_stage_capture" not in stage.backbone.__dict__
    assert [stage.identify(b, final_hidden) for b in blocks] == list(ids)


@pytest.mark.parametrize("pp_size,partition", SPLITS, ids=str)
@pytest.mark.parametrize("arch", list(CLASSES))
def test_each_stage_captures_the_features_our_rule_assigns_it(stages, arch, pp_size, partition):
    for ids in id_sets(arch):
        built = stages(arch, pp_size, partition)
        (unsplit,) = stages(arch, 1, None)
        ownership = compute_feature_ownership(
            [(s.backbone.start_layer, s.backbone.end_layer) for s in built], ids, N,
            capture_convention([arch]),
        )
        reference, _, ref_hidden = unsplit.forward(ids, None)
        proxy, seen = None, []
        for owned, stage in zip(ownership.stages, built):
            blocks, proxy, final_hidden = stage.forward(ids, proxy)
            captured = [stage.identify(b, final_hidden) for b in blocks]
            assert captured == [ids[j] for j in owned.features], (arch, pp_size, partition, ids)
            for j, block in zip(owned.features, blocks):
                scale = reference[j].abs().max().item()
                torch.testing.assert_close(block, reference[j], rtol=0, atol=1e-5 * scale)
            seen += captured
        assert seen == list(ids)


def test_the_hook_is_inert_outside_a_dflash_pd_prefill(single_process_dist, sglang_with_plugin):
    """Same PP2 stage 0, but the process serves DSPARK (which also arms the DFLASH setter on
    these models) or runs as a decode: the stock setter's early return stands, no capture."""
    from sglang.srt.runtime_context import get_context

    config = _configs()["LlamaForCausalLM"]
    for overrides in ({"speculative_algorithm": "DSPARK", "disaggregation_mode": "prefill"},
                      {"speculative_algorithm": "DFLASH", "disaggregation_mode": "decode"}):
        override = get_context().override_server_args(**overrides)
        override.install()
        try:
            stage = Stage("LlamaForCausalLM", config, 0, 2, None)
            blocks, proxy, _ = stage.forward((0, 1, 2), None)
            assert blocks == [] and "dspark_hidden_states" not in proxy.tensors
            assert "_dflash_pp_stage_capture" not in stage.backbone.__dict__
        finally:
            override.restore()
