"""Our ownership rule (``capture_ownership.compute_feature_ownership``) against the real Kimi-K3.

For each PP stage of several splits of a tiny 8-layer K3, this module builds sglang 0.5.23's own
``KimiK3LinearForCausalLM`` in this one process (world size 1, gloo; the PP stage is selected by
overriding ``get_parallel()``'s pp_rank / pp_size / pp_group during construction and forward, as
``pp_worker_harness.pp_stage`` does), arms it with its own ``set_dflash_layers_to_capture``, and
runs the real ``KimiK3LinearModel.forward`` stage after stage, each non-first stage fed the real
``PPProxyTensors`` the previous stage returned. It then finds out *which layer's output* each
captured feature is, from its values alone, and checks that every stage captured exactly the
layers our rule assigns to it, in ascending order, on the standard residual path and on the
attention-residual bank path (``attn_res_block_size`` set).

What is real: the model class, its PP construction (``make_pp_layers`` -> ``get_pp_indices``,
``SGLANG_PP_LAYER_PARTITION`` honoured), the decoder layers with their stage boundaries (input
norms, fused residual adds, the bank reads/writes, the ``capture_gathered`` tap), the dense MLP
and the MoE (native CPU path) with seeded random weights, the embedding, the final norm / bank
output read, ``_dspark_capture_stream``, ``residual_batch.to_pp`` / ``from_pp`` / ``fold`` and a
real ``ForwardBatch`` (only its required fields: nothing reads attention metadata).

Stand-ins, each because the real thing cannot run on a CPU (cpu-harness.md item 4):

* ``StandInAttention`` replaces each layer's ``self_attn`` (KDA is Triton-only; MLA fails on
  ``torch_native``). It returns a deterministic function of its input and records that input:
  the normalised stream the layer's real attention boundary handed it.
* On the bank path, ``attn_residual._mix_fused`` (a Triton kernel) is replaced by sglang's own
  eager reference for it, ``attn_residual.aggregate_stream_torch`` (same signature).
* ``biased_grouped_topk`` is ``torch.compile``d; the forwards run with dynamo disabled, so the
  same function runs eagerly (a cold inductor compile costs ~20 s on this 2-core box).
* Harness shims from cpu-harness.md: RoPE ``_is_cpu`` (``single_process_dist``) and a no-op
  ``torch.cuda.Stream`` (the model builds 3 alt streams unconditionally; unused on CPU).

How a capture is identified. K3 captures layer L's output as the stream layer L+1 reads: on the
standard path the residual at L+1's attention input, on the bank path the pre-norm mixture formed
with L+1's aggregation weights; for the final layer, what the final norm / output read takes. So
layer L+1's real ``input_layernorm`` applied to the capture must give exactly the input its
(stand-in) attention recorded, and ``model.norm`` applied to a capture of layer N-1 must give the
stage's final hidden states. Each captured H-wide block must match exactly one such candidate
among the stage's layers; that names the captured layer independently of the model's own labels
(``_dspark_capture_stream`` is only spied on, to show which path took the capture). The captured
values must also equal the unsplit (PP1) model's captures of the same layers.

The non-first stages get the previous stage's proxy without ``dspark_hidden_states`` (our plugin
replaces that key with its partial projection), so each stage's captures are its own.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import pytest
import torch

import tiny_models
from pp_stage_models import StandInAttention, seed_weights, stage_context
from sglang_dflash_pp.srt.models.capture_ownership import compute_feature_ownership

N = 8
HIDDEN = 128  # tiny_models.kimi_k3_text_config
TOKENS = 5
DTYPE = torch.bfloat16

# (pp_size, SGLANG_PP_LAYER_PARTITION or None for sglang's even split)
SPLITS = [
    (2, None),  # [0,4) [4,8)
    (3, None),  # [0,2) [2,5) [5,8)
    (4, None),  # [0,2) [2,4) [4,6) [6,8)
    (3, "3,2,3"),  # [0,3) [3,5) [5,8)
    (4, "2,1,3,2"),  # a one-layer middle stage [2,3)
    (4, "1,3,2,2"),  # a one-layer first stage [0,1)
]
# None: standard residual path; an int: attention-residual bank with that block size.
PATHS = {"standard": None, "bank_block2": 2, "bank_block3": 3}
ID_SETS = [
    tuple(range(N)),  # every layer: every stage boundary and the final layer
    (1, 3, 5, 7),  # the draft's usual spacing; 1/3/5 end non-last stages in several splits
    (0, 2, 4, 6),  # first layer, no final layer
    (2, 4, 7),  # 2 ends stage 0 of "3,2,3" and stage 1 of "2,1,3,2"; 4 ends [3,5)
    (N - 1,),  # only the final layer: one feature, on the last stage
]


def k3_config(block_size: Optional[int]):
    """``tiny_models.kimi_k3_text_config(8)``, with ``attn_res_block_size`` set for the bank."""
    from sglang.srt.configs.kimi_linear import KimiLinearConfig

    config = tiny_models.kimi_k3_text_config(N)
    return KimiLinearConfig(**{**config, "attn_res_block_size": block_size})


class Stage:
    def __init__(self, pp_rank, pp_size, partition, block_size):
        from sglang.srt.distributed.utils import get_pp_indices
        from sglang.srt.models.kimi_k3 import KimiK3LinearForCausalLM

        self.pp_rank, self.pp_size, self.partition = pp_rank, pp_size, partition
        previous = torch.get_default_dtype()
        torch.set_default_dtype(DTYPE)  # as the model loader's set_default_torch_dtype
        try:
            with stage_context(pp_rank, pp_size, partition):
                self.expected_range = get_pp_indices(N, pp_rank, pp_size)
                self.model = KimiK3LinearForCausalLM(k3_config(block_size))
        finally:
            torch.set_default_dtype(previous)
        seed_weights(self.model)
        self.backbone = self.model.model
        for i in range(self.model.start_layer, self.model.end_layer):
            self.backbone.layers[i].self_attn = StandInAttention(i)
        # Pass-through spy on the bank-path capture (the real method runs).
        self.bank_capture_calls: List[int] = []
        real = self.backbone._dspark_capture_stream

        def spy(layer_idx, hidden_states, forward_batch):
            self.bank_capture_calls.append(layer_idx)
            return real(layer_idx, hidden_states, forward_batch)

        self.backbone._dspark_capture_stream = spy

    @property
    def is_last(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def forward(self, ids, proxy):
        """The real backbone forward of this stage with the real DFLASH capture set. Returns
        (captured blocks in order, outgoing proxy or None, final hidden states or None)."""
        import torch._dynamo.config as dynamo_config
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

        forward_batch = ForwardBatch(
            forward_mode=ForwardMode.EXTEND,
            batch_size=1,
            input_ids=torch.arange(TOKENS) * 37 % 512,
            req_pool_indices=torch.zeros(1, dtype=torch.long),
            seq_lens=torch.tensor([TOKENS]),
            out_cache_loc=torch.arange(TOKENS),
            seq_lens_sum=TOKENS,
        )
        self.bank_capture_calls.clear()
        context = stage_context(self.pp_rank, self.pp_size, self.partition)
        with context, dynamo_config.patch(disable=True):
            self.model.set_dflash_layers_to_capture(list(ids))
            out = self.backbone.forward(
                forward_batch.input_ids,
                torch.arange(TOKENS),
                forward_batch,
                pp_proxy_tensors=proxy,
            )
        if self.pp_size == 1:
            hidden, packed = out
            return list(packed.split(HIDDEN, dim=-1)), None, hidden
        if not self.is_last:
            captured = out.tensors.pop("dspark_hidden_states", None)
            blocks = [] if captured is None else list(captured.split(HIDDEN, dim=-1))
            return blocks, out, None
        hidden, aux = out
        blocks = [b for t in aux for b in t.split(HIDDEN, dim=-1)]
        return blocks, None, hidden

    def identify(self, block: torch.Tensor, final_hidden: Optional[torch.Tensor]) -> int:
        """The one layer L whose output ``block`` is: layer L+1 reads it (its real input norm of
        the block == the input its attention got), or, for L = N-1, the final norm / output read
        produced the stage's output from it."""
        candidates = {}
        for i in range(max(self.model.start_layer, 1), self.model.end_layer):
            layer = self.backbone.layers[i]
            candidates[i - 1] = (layer.input_layernorm, layer.self_attn.last_input)
        if self.is_last:
            candidates[N - 1] = (self.backbone.norm, final_hidden)
        errors = {}
        for layer_id, (norm, seen) in candidates.items():
            with torch.no_grad():
                normed = norm(block.clone()).float()
            diff = (normed - seen.float()).abs().max() / seen.float().abs().max()
            errors[layer_id] = diff.item()
        matches = [layer_id for layer_id, err in errors.items() if err < 0.03]
        assert len(matches) == 1, (
            f"stage {self.pp_rank}/{self.pp_size} [{self.model.start_layer}, "
            f"{self.model.end_layer}): a captured block matches {matches} among its layers; "
            f"relative errors {errors}"
        )
        others = [err for layer_id, err in errors.items() if layer_id != matches[0]]
        assert all(err > 0.2 for err in others), errors  # the match is unambiguous
        return matches[0]


@pytest.fixture(scope="module")
def k3_cpu(single_process_dist):
    """Module-wide CPU shims (see the module docstring), undone when the module ends."""
    import sglang.srt.layers.attn_residual as attn_residual

    class NoOpStream:
        """``torch.cuda.Stream`` stand-in: K3 builds three alt streams unconditionally."""

        def __init__(self, *args, **kwargs):
            pass

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "Stream", NoOpStream)
        mp.setattr(attn_residual, "_mix_fused", attn_residual.aggregate_stream_torch)
        mp.delenv("SGLANG_PP_LAYER_PARTITION", raising=False)
        yield


@pytest.fixture(scope="module")
def stages(k3_cpu):
    """Stage models per (path, split), built once."""
    cache: Dict[Tuple[str, int, Optional[str]], List[Stage]] = {}

    def get(path: str, pp_size: int, partition: Optional[str]) -> List[Stage]:
        key = (path, pp_size, partition)
        if key not in cache:
            cache[key] = [Stage(r, pp_size, partition, PATHS[path]) for r in range(pp_size)]
        return cache[key]

    return get


@pytest.fixture(scope="module")
def pp1_captures(stages):
    """The unsplit model's captures of ``ids``, per (path, ids)."""
    cache = {}

    def get(path: str, ids) -> List[torch.Tensor]:
        if (path, ids) not in cache:
            (stage,) = stages(path, 1, None)
            blocks, _, final_hidden = stage.forward(ids, None)
            assert [stage.identify(b, final_hidden) for b in blocks] == list(ids)
            cache[(path, ids)] = blocks
        return cache[(path, ids)]

    return get


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("pp_size,partition", SPLITS)
def test_stage_models_hold_sglangs_partition(stages, path, pp_size, partition):
    """Each stage model holds exactly ``get_pp_indices``' range (partition env honoured), the
    ranges tile [0, N), and the bank exists exactly on the bank path."""
    from sglang.srt.layers.utils import PPMissingLayer
    from sglang.srt.models.kimi_k3 import KimiK3DecoderLayer

    built = stages(path, pp_size, partition)
    ranges = [(s.model.start_layer, s.model.end_layer) for s in built]
    assert ranges == [s.expected_range for s in built]
    if partition is not None:
        sizes = [int(x) for x in partition.split(",")]
        assert [b - a for a, b in ranges] == sizes
    assert ranges[0][0] == 0 and ranges[-1][1] == N
    assert all(ranges[s][1] == ranges[s + 1][0] for s in range(pp_size - 1))
    for s in built:
        backbone_range = (s.backbone.start_layer, s.backbone.end_layer)
        assert backbone_range == (s.model.start_layer, s.model.end_layer)
        for i, layer in enumerate(s.backbone.layers):
            local = s.model.start_layer <= i < s.model.end_layer
            assert isinstance(layer, KimiK3DecoderLayer if local else PPMissingLayer), (i, ranges)
        assert (s.backbone.attn_bank is None) == (PATHS[path] is None)
        assert isinstance(s.backbone.embed_tokens, PPMissingLayer) == (s.pp_rank != 0)
        assert isinstance(s.backbone.norm, PPMissingLayer) == (not s.is_last)


@pytest.mark.parametrize("ids", ID_SETS, ids=lambda ids: "ids" + "_".join(map(str, ids)))
@pytest.mark.parametrize("pp_size,partition", SPLITS, ids=lambda v: str(v))
@pytest.mark.parametrize("path", list(PATHS))
def test_each_stage_captures_the_layers_our_rule_assigns_it(
    stages, pp1_captures, path, pp_size, partition, ids
):
    """Chain the real stage forwards; every stage captures exactly the layers whose feature our
    rule gives it, ascending, with the unsplit model's values, on both residual paths."""
    built = stages(path, pp_size, partition)
    ownership = compute_feature_ownership(
        [(s.model.start_layer, s.model.end_layer) for s in built], ids, N
    )
    reference = pp1_captures(path, ids)
    proxy = None
    seen_layers = []
    for s, stage in zip(ownership.stages, built):
        blocks, proxy, final_hidden = stage.forward(ids, proxy)
        captured = [stage.identify(b, final_hidden) for b in blocks]
        expected = [ids[j] for j in s.features]
        assert captured == expected, (
            f"{path}, stages {[(x.start_layer, x.end_layer) for x in ownership.stages]}: stage "
            f"{s.stage} [{s.start_layer}, {s.end_layer}) captured layers {captured}; our rule "
            f"assigns it {expected}"
        )
        # The same values the unsplit model captures for those features (up to bf16 rounding:
        # a stage boundary changes where the pending residual add is rounded).
        for j, block in zip(s.features, blocks):
            scale = reference[j].float().abs().max().item()
            torch.testing.assert_close(block, reference[j], rtol=0, atol=0.02 * scale)
        # The bank path takes every capture through _dspark_capture_stream (on the stage our
        # rule names, deferred from the stage whose last layer it is); the standard path never.
        assert stage.bank_capture_calls == (expected if PATHS[path] is not None else [])
        # The model's own accounting of the captures earlier stages own agrees with the rule.
        earlier = sum(len(x.features) for x in ownership.stages[: s.stage])
        assert stage.model.get_pp_proxy_dspark_hidden_size() == HIDDEN * earlier
        seen_layers += captured
    assert seen_layers == list(ids)  # every feature exactly once, in fc column order
