"""Which pipeline stage captures which DFlash context feature.

The DFlash context is ``RMSNorm(fc(concat(h_0..h_{K-1})))`` over the outputs of the target layers
``target_layer_ids``. Under PP each stage sees only its own layers, so each stage can contribute
only the features it captures itself, and must project exactly those with its column blocks of
``fc``. This module states that rule for targets that capture like Kimi-K3 in 0.5.23:

* On the standard residual path the output of layer ``L`` is read where layer ``L + 1`` takes its
  attention input (``capture_gathered``), and the final layer's at the final norm.
* On the attention-residual bank path the capture is formed with the *next* layer's aggregation
  weights, so a stage whose last layer is ``L`` defers it to the stage that holds ``L + 1``.

Both give: **feature L is owned by the stage whose layer range contains ``min(L + 1, N - 1)``**.
Pure: no sglang import; the glue feeds it sglang's own partition (``get_pp_indices``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from sglang_dflash_pp.srt.speculative.draft_config_checks import target_layer_ids_refusal


class OwnershipError(ValueError):
    """The PP layout cannot serve the draft's context features; raised before serving."""


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


def owning_layer(layer_id: int, num_layers: int) -> int:
    """The layer whose stage captures the output of ``layer_id``."""
    return min(int(layer_id) + 1, int(num_layers) - 1)


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

    stages = []
    for s, (start, end) in enumerate(stage_layers):
        owned = tuple(
            j for j, layer in enumerate(ids) if start <= owning_layer(layer, num_layers) < end
        )
        stages.append(StageFeatures(s, start, end, owned, tuple(ids[j] for j in owned)))
    ownership = FeatureOwnership(num_layers, ids, tuple(stages))

    last = stages[-1]
    if not last.features:
        highest = ids[-1]
        raise OwnershipError(
            f"The last PP stage (layers [{last.start_layer}, {last.end_layer})) captures none of "
            f"the draft's target_layer_ids {list(ids)}: layer {highest} is captured where layer "
            f"{highest + 1} runs, on stage {ownership.owner_of(len(ids) - 1)}. The last stage "
            "must own at least one feature (it normalises the context and writes the draft KV). "
            f"Set SGLANG_PP_LAYER_PARTITION so that the last stage starts at layer "
            f"{highest + 1} or earlier."
        )
    return ownership
