"""Which pipeline stage captures which DFlash context feature.

The DFlash context is ``RMSNorm(fc(concat(h_0..h_{K-1})))`` over the outputs of the target layers
``target_layer_ids``. Under PP each stage sees only its own layers, so each stage can contribute
only the features it captures itself, and must project exactly those with its column blocks of
``fc``. Every target class DFLASH PP accepts reads the output of layer ``L`` where layer
``L + 1`` takes its attention input (0.5.23's "capture before layer id+1"). The classes differ only
in what happens to the final layer's output (:class:`CaptureConvention`):

* Kimi-K3 and gpt-oss read it at the final norm, on the last stage. Kimi-K3's
  attention-residual bank path also forms a capture with the *next* layer's aggregation weights,
  so a stage whose last layer is ``L`` defers it to the stage that holds ``L + 1``. Both give:
  **feature L is owned by the stage whose layer range contains ``min(L + 1, N - 1)``**.
* Llama, Qwen3 and Qwen3-MoE never capture the final layer's output: **feature L is owned by the
  stage holding layer ``L + 1``**, and a draft naming layer ``N - 1`` is refused (stock DFLASH
  would fail on it at the first request, PP or not).

:data:`PP_CAPTURE_TARGETS` is the allow-list: the target architectures whose every PP stage
captures its own features (Kimi-K3 natively, the others through ``models/stage_capture``), each
with its convention. Pure: no sglang import; the PP worker feeds it sglang's own partition
(``get_pp_indices``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from sglang_dflash_pp.srt.speculative.draft_config_checks import target_layer_ids_refusal


class OwnershipError(ValueError):
    """The PP layout cannot serve the draft's context features; raised before serving."""


@dataclass(frozen=True)
class CaptureConvention:
    """Where a target class captures the output of its final layer."""

    name: str
    final_layer_at_norm: bool  # True: read at the final norm (last stage); False: never captured


FINAL_LAYER_AT_NORM = CaptureConvention("input of layer L+1; the final layer at the final norm", True)
BEFORE_NEXT_LAYER = CaptureConvention("input of layer L+1; the final layer is never captured", False)

# Architecture (``config.json`` ``architectures``) -> convention. Every name here is a class whose
# non-last PP stages capture their own features: Kimi-K3 in stock 0.5.23, the rest through
# ``models/stage_capture`` (one test per class). Anything else is refused by name.
PP_CAPTURE_TARGETS: Dict[str, CaptureConvention] = {
    "KimiK3ForConditionalGeneration": FINAL_LAYER_AT_NORM,
    "KimiK3LinearForCausalLM": FINAL_LAYER_AT_NORM,
    "GptOssForCausalLM": FINAL_LAYER_AT_NORM,
    "LlamaForCausalLM": BEFORE_NEXT_LAYER,
    "Qwen3ForCausalLM": BEFORE_NEXT_LAYER,
    "Qwen3MoeForCausalLM": BEFORE_NEXT_LAYER,
}


def capture_convention(architectures: Sequence[str]) -> Optional[CaptureConvention]:
    """The convention of the first listed architecture we accept, or None (refused)."""
    for arch in architectures or ():
        if arch in PP_CAPTURE_TARGETS:
            return PP_CAPTURE_TARGETS[arch]
    return None


@dataclass(frozen=True)
class StageFeatures:
    stage: int
    start_layer: int
    end_layer: int
    features: Tuple[int, ...]  # indices into target_layer_ids == fc column blocks, ascending
    layer_ids: Tuple[int, ...]  # the captured layers, same order


@dataclass(frozen=True)
class FeatureOwnership:
    num_layers: int
    target_layer_ids: Tuple[int, ...]
    stages: Tuple[StageFeatures, ...]

    @property
    def pp_size(self) -> int:
        return len(self.stages)

    @property
    def num_features(self) -> int:
        return len(self.target_layer_ids)

    def owner_of(self, feature: int) -> int:
        for s in self.stages:
            if feature in s.features:
                return s.stage
        raise KeyError(feature)

    def sends_partial(self, stage: int) -> bool:
        """A non-last stage sends the carry once it or an earlier stage owns a feature. The rule
        is static, so every TP rank of a stage emits the same proxy keys for every batch."""
        if stage >= self.pp_size - 1:
            return False
        return any(s.features for s in self.stages[: stage + 1])

    def receives_partial(self, stage: int) -> bool:
        return stage > 0 and self.sends_partial(stage - 1)

    def stage_rows(self) -> List[dict]:
        """One plain dict per stage, for reports (``sglang-dflash-pp check``, preflight)."""
        return [
            dict(
                stage=s.stage,
                layers=[s.start_layer, s.end_layer],
                features=list(s.features),
                captured_layers=list(s.layer_ids),
                receives_partial=self.receives_partial(s.stage),
                sends_partial=self.sends_partial(s.stage),
                hosts_draft=s.stage == self.pp_size - 1,
            )
            for s in self.stages
        ]


def owning_layer(
    layer_id: int, num_layers: int, convention: CaptureConvention = FINAL_LAYER_AT_NORM
) -> Optional[int]:
    """The layer whose stage captures the output of ``layer_id``; None if no stage does."""
    following = int(layer_id) + 1
    if following < int(num_layers):
        return following
    return int(num_layers) - 1 if convention.final_layer_at_norm else None


def _layout_refusal(stage_layers: Sequence[Tuple[int, int]], num_layers: int) -> Optional[str]:
    expected_start = 0
    for s, (start, end) in enumerate(stage_layers):
        if start != expected_start or end <= start:
            return (
                f"PP stage {s} holds layers [{start}, {end}), but the ownership rule needs "
                f"contiguous, non-empty stages covering [0, {num_layers}); got "
                f"{list(stage_layers)}. Fix SGLANG_PP_LAYER_PARTITION."
            )
        expected_start = end
    if expected_start != num_layers:
        return (
            f"The PP stages cover [0, {expected_start}) of the target's {num_layers} layers; "
            "fix SGLANG_PP_LAYER_PARTITION."
        )
    return None


def compute_feature_ownership(
    stage_layers: Sequence[Tuple[int, int]],
    target_layer_ids: Sequence[int],
    num_layers: int,
    convention: CaptureConvention = FINAL_LAYER_AT_NORM,
) -> FeatureOwnership:
    """Assign every context feature to its capturing stage, or refuse with the fix."""
    num_layers = int(num_layers)
    ids = tuple(int(i) for i in target_layer_ids)
    stage_layers = [(int(a), int(b)) for a, b in stage_layers]
    if not ids:
        raise OwnershipError("The draft declares no target_layer_ids; nothing to capture.")
    refusal = _layout_refusal(stage_layers, num_layers)
    if refusal:
        raise OwnershipError(refusal)
    out_of_range = [i for i in ids if not 0 <= i < num_layers]
    if out_of_range:
        raise OwnershipError(
            f"target_layer_ids {list(ids)} name layers {out_of_range} outside the target's "
            f"[0, {num_layers}); the draft was trained for another target. Use the draft that "
            "matches this target."
        )
    refusal = target_layer_ids_refusal(ids, where="the draft")
    if refusal:
        raise OwnershipError(refusal)
    never = [i for i in ids if owning_layer(i, num_layers, convention) is None]
    if never:
        raise OwnershipError(
            f"target_layer_ids {list(ids)} name the final layer {never}, whose output this "
            f"target never captures (it captures the output of layer L as the input of layer "
            f"L+1, and there is no layer {num_layers}). Stock DFLASH fails on it too; use a "
            "draft trained for this target's capture points."
        )

    stages = []
    for s, (start, end) in enumerate(stage_layers):
        owned = tuple(
            j
            for j, layer in enumerate(ids)
            if start <= owning_layer(layer, num_layers, convention) < end
        )
        stages.append(StageFeatures(s, start, end, owned, tuple(ids[j] for j in owned)))
    ownership = FeatureOwnership(num_layers, ids, tuple(stages))

    last = stages[-1]
    if not last.features:
        highest = ids[-1]
        raise OwnershipError(
            f"The last PP stage (layers [{last.start_layer}, {last.end_layer})) captures none of "
            f"the draft's target_layer_ids {list(ids)}: layer {highest} is captured where layer "
            f"{owning_layer(highest, num_layers, convention)} runs, on stage "
            f"{ownership.owner_of(len(ids) - 1)}. The last stage "
            "must own at least one feature (it normalises the context and writes the draft KV). "
            f"Set SGLANG_PP_LAYER_PARTITION so that the last stage starts at layer "
            f"{owning_layer(highest, num_layers, convention)} or earlier."
        )
    return ownership
