"""DFLASH on a pipeline-parallel PD prefill: each stage projects the draft features it
captures.

The DFlash context of a token is ``hidden_norm(fc(concat(h_0, ..., h_{K-1})))`` over K
captured target layers. Under pipeline parallelism a stage holds only some of those
layers, and ``fc`` is linear: ``fc(concat(h)) = sum_j h_j @ W_j.T`` with ``W_j`` the
j-th ``[H, H]`` column block of ``fc.weight``. So each stage adds the projection of its
own features to the partial it received and hands on one ``[tokens, H]`` tensor instead
of every raw capture; only the last stage, which holds the draft, applies the norm
(``DFlashDraftModel.project_target_hidden(context_partial=...)``) and writes the draft
KV.

The partial is kept in fp32: a PP1 server rounds the fc output once, and a bf16 carry
would round it once per stage. A stage's projection writes fp32 directly on CUDA.

Feature ``L`` is captured where the target reads layer ``L + 1``'s input (the last
layer's at the final norm, where a target reads it at all), so the stage holding layer
``L + 1`` captures it. The ids are ascending, so each stage captures a run of
consecutive features and the last stage's are the trailing ones.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
from torch import nn

from sglang.srt.distributed.utils import get_pp_indices

logger = logging.getLogger(__name__)

# What the target puts on the PP wire: its captured features (as Kimi-K3 for DSPARK).
CAPTURED_FEATURES_KEY = "dspark_hidden_states"
# What a DFLASH stage hands on instead: the running sum of the features' projections.
CONTEXT_PARTIAL_KEY = "dflash_context_partial"


def fc_projection(
    features: torch.Tensor,
    fc_columns: torch.Tensor,
    partial: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``partial + features @ fc_columns.T``, accumulated and returned in fp32."""
    if features.is_cuda and features.dtype in (torch.bfloat16, torch.float16):
        if partial is None:
            return torch.mm(features, fc_columns.t(), out_dtype=torch.float32)
        return torch.addmm(partial, features, fc_columns.t(), out_dtype=torch.float32)
    projected = features.float() @ fc_columns.float().t()
    return projected if partial is None else projected + partial


def feature_stages(
    target_layer_ids: Sequence[int], num_layers: int, pp_size: int
) -> List[int]:
    """The PP stage that captures each draft feature."""
    stages = [get_pp_indices(num_layers, rank, pp_size) for rank in range(pp_size)]
    owners = []
    for layer_id in target_layer_ids:
        read_at = min(layer_id + 1, num_layers - 1)  # the last layer at the final norm
        owners.append(next(s for s, (a, b) in enumerate(stages) if a <= read_at < b))
    return owners


@dataclass
class DFlashPPStage:
    """What one PP stage of a DFLASH PD prefill does with the draft context, fixed at
    startup: the features it captures, whether a partial arrives from earlier stages,
    and (before the last stage) the ``fc`` column blocks it projects its features
    with."""

    pp_rank: int
    pp_size: int
    features: range  # indices into the draft's target_layer_ids
    receives_partial: bool
    fc_columns: Optional[torch.Tensor] = None

    @property
    def is_last(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @classmethod
    def build(
        cls,
        target_layer_ids: Sequence[int],
        num_layers: int,
        pp_rank: int,
        pp_size: int,
    ) -> "DFlashPPStage":
        ids = list(target_layer_ids)
        if ids != sorted(set(ids)) or not 0 <= ids[0] <= ids[-1] < num_layers:
            raise ValueError(
                f"DFLASH with --pp-size {pp_size} needs the draft's "
                "target_layer_ids ascending, unique and below the target's "
                f"{num_layers} layers; got {ids}."
            )
        owners = feature_stages(ids, num_layers, pp_size)
        if owners[-1] != pp_size - 1:
            last = get_pp_indices(num_layers, pp_size - 1, pp_size)
            raise ValueError(
                f"DFLASH with --pp-size {pp_size}: the last PP stage holds target "
                f"layers [{last[0]}, {last[1]}) and captures none of the draft's "
                f"features (layers {ids} are read at the next layer's input), but it "
                "holds the draft and must finish the context. Set "
                f"SGLANG_PP_LAYER_PARTITION so that it holds layer {ids[-1] + 1}."
            )
        mine = [j for j, s in enumerate(owners) if s == pp_rank]
        features = range(mine[0], mine[-1] + 1) if mine else range(0)
        return cls(
            pp_rank=pp_rank,
            pp_size=pp_size,
            features=features,
            receives_partial=any(s < pp_rank for s in owners),
        )

    @classmethod
    def for_target(cls, runner, device: torch.device) -> "DFlashPPStage":
        """This process's stage of the target ``runner``, with its ``fc`` column blocks
        read before the last stage. Everything is checked here, at startup, on every
        stage alike: a stage that raised mid-batch would leave the others waiting on
        it."""
        from sglang.srt.runtime_context import get_model, get_parallel, get_spec

        draft_config = runner.spec_aux_config.draft_model_config
        check_pp_target(runner.model)
        check_pp_draft(draft_config.hf_config)
        target_layer_ids = runner.spec_aux_config.dflash_target_layer_ids
        parallel = get_parallel()
        stage = cls.build(
            target_layer_ids,
            runner.model_config.num_hidden_layers,
            parallel.pp_rank,
            parallel.pp_size,
        )
        if stage.features and not stage.is_last:
            spec = get_spec()
            hidden = int(draft_config.hf_config.hidden_size)
            fc_weight = _read_fc_weight(
                spec.speculative_draft_model_path,
                spec.speculative_draft_model_revision,
                spec.speculative_draft_load_format or get_model().load_format,
                (hidden, len(target_layer_ids) * hidden),
                draft_config.dtype,
                device,
            )
            columns = slice(stage.features.start * hidden, stage.features.stop * hidden)
            # A copy: the stage keeps its own columns, not the whole fc.
            stage.fc_columns = (
                fc_weight[:, columns].to(runner.model_config.dtype).contiguous()
            )
        logger.info(
            "DFLASH PP stage %d/%d: captures draft features %s, %s.",
            stage.pp_rank,
            stage.pp_size,
            list(stage.features),
            "holds the draft" if stage.is_last else "hands on the context partial",
        )
        return stage

    def hand_on(
        self,
        outbound: dict,
        inbound: Optional[dict],
    ) -> None:
        """Replace this stage's raw captures in its outbound PP tensors with the
        partial."""
        captured = outbound.pop(CAPTURED_FEATURES_KEY, None)
        partial = inbound[CONTEXT_PARTIAL_KEY] if self.receives_partial else None
        if self.features:
            partial = fc_projection(captured, self.fc_columns, partial)
        if partial is not None:
            outbound[CONTEXT_PARTIAL_KEY] = partial.contiguous()

    def inbound_partial(self, inbound: Optional[dict]) -> Optional[torch.Tensor]:
        return inbound[CONTEXT_PARTIAL_KEY] if self.receives_partial else None


def check_pp_target(model: nn.Module) -> None:
    # Declared by the class itself: a subclass may run another forward.
    if not vars(type(model)).get("supports_pp_dflash_capture", False):
        raise ValueError(
            "DFLASH with --pp-size > 1 needs a target whose every PP stage captures "
            f"the draft's features; {type(model).__name__} captures them on the last "
            "stage only. Serve it with --pp-size 1."
        )


def check_pp_draft(draft_hf_config) -> None:
    """The draft's context projection must be a plain ``fc`` over the concatenated
    features, so that it splits into per-stage column blocks."""
    from sglang.srt.models.dflash import DFlashDraftModel
    from sglang.srt.models.registry import ModelRegistry
    from sglang.srt.speculative.dflash_utils import is_nemotron_35_draft_config

    architectures = list(getattr(draft_hf_config, "architectures", None) or [])
    model_cls, arch = ModelRegistry.resolve_model_cls(architectures)
    if not issubclass(model_cls, DFlashDraftModel):
        why = f"{arch} is not a DFlashDraftModel"
    elif model_cls.project_target_hidden is not DFlashDraftModel.project_target_hidden:
        why = f"{arch} projects its context its own way (project_target_hidden)"
    elif (
        model_cls.supports_quantization
        or is_nemotron_35_draft_config(draft_hf_config)
        or getattr(draft_hf_config, "quantization_config", None) is not None
    ):
        why = f"the {arch} draft's fc is quantized"
    else:
        return
    raise ValueError(
        "DFLASH with --pp-size > 1 splits the draft's fc into per-stage column "
        f"blocks, which needs an unquantized plain fc, but {why}. Serve it with "
        "--pp-size 1."
    )


def _read_fc_weight(
    path: str,
    revision: Optional[str],
    load_format: str,
    shape,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """The draft checkpoint's ``fc.weight``, read through the model loader; under dummy
    weights the values the last stage's dummy draft holds."""
    from sglang.srt.configs.load_config import LoadConfig, LoadFormat
    from sglang.srt.model_loader.loader import DefaultModelLoader
    from sglang.srt.model_loader.weight_utils import initialize_dummy_weights

    if load_format == LoadFormat.DUMMY:
        fc = nn.Linear(shape[1], shape[0], bias=False, dtype=dtype, device=device)
        initialize_dummy_weights(fc)
        return fc.weight.data
    from sglang.srt.runtime_context import get_model

    loader = DefaultModelLoader(
        LoadConfig(load_format=load_format, download_dir=get_model().download_dir)
    )
    source = DefaultModelLoader.Source(path, revision, fall_back_to_pt=True)
    # The names DFlashDraftModel.load_weights accepts for its fc.
    names = ("fc.weight", "model.fc.weight", "encoder.fc.weight")
    for name, weight in loader._get_weights_iterator(source):
        if name in names:
            if tuple(weight.shape) != tuple(shape):
                raise ValueError(
                    f"DFLASH draft {path}: {name} has shape {tuple(weight.shape)}, "
                    f"expected {tuple(shape)}."
                )
            return weight.to(device=device, dtype=dtype)
    raise ValueError(f"DFLASH draft {path} has no fc.weight.")
