"""Read only the ``fc`` column blocks a non-last PP stage needs from the draft checkpoint.

A non-last prefill stage holds no draft model (its memory goes to target layers), yet it must
project the features it captures with their ``[H, H]`` blocks of ``fc.weight``. Loading the whole
draft for that would cost the full draft per rank; reading the columns through a safetensors slice
costs one block per owned feature.

The accepted tensor names are the ones ``DFlashDraftModel.load_weights`` (0.5.23) resolves to
``fc.weight``: the bare name, the ``model.`` prefix, and the vendor alias ``encoder.fc.weight``.
Pure: safetensors + torch, no sglang import.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Dict, Optional, Sequence, Tuple

import torch
from safetensors import safe_open

from sglang_dflash_pp.srt.models.context_partial import fc_column_block, feature_columns

FC_WEIGHT_NAMES = ("fc.weight", "model.fc.weight", "encoder.fc.weight")
_INDEX_FILE = "model.safetensors.index.json"
_ROW_BAND = 256


class DraftCheckpointError(ValueError):
    """The draft checkpoint cannot provide the fc column blocks; raised before serving."""


def _fc_location(draft_dir: str) -> Tuple[str, str]:
    """(file, tensor name) of the draft's fc weight."""
    index_path = os.path.join(draft_dir, _INDEX_FILE)
    if os.path.exists(index_path):
        with open(index_path) as f:
            weight_map: Dict[str, str] = json.load(f).get("weight_map", {})
        for name in FC_WEIGHT_NAMES:
            if name in weight_map:
                return os.path.join(draft_dir, weight_map[name]), name
    else:
        for path in sorted(glob.glob(os.path.join(draft_dir, "*.safetensors"))):
            with safe_open(path, framework="pt") as f:
                keys = set(f.keys())
            for name in FC_WEIGHT_NAMES:
                if name in keys:
                    return path, name
    raise DraftCheckpointError(
        f"The draft checkpoint at {draft_dir} has no fc weight under any of "
        f"{list(FC_WEIGHT_NAMES)} (searched {_INDEX_FILE} or the *.safetensors files). A "
        "non-last PP stage reads its fc column blocks from there; point "
        "--speculative-draft-model-path at the DFlash draft's safetensors directory."
    )


def load_fc_column_blocks(
    draft_dir: str,
    features: Sequence[int],
    hidden_size: int,
    num_features: int,
    dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """``[H, k*H]``: the ``features`` column blocks of the checkpoint's ``fc.weight``, in order."""
    columns = feature_columns(features, hidden_size)
    path, name = _fc_location(draft_dir)
    expected = (hidden_size, num_features * hidden_size)
    with safe_open(path, framework="pt") as f:
        tensor_slice = f.get_slice(name)
        shape = tuple(tensor_slice.get_shape())
        if shape != expected:
            raise DraftCheckpointError(
                f"The draft's {name} in {path} has shape {shape}, expected {expected} "
                f"(hidden_size={hidden_size} x {num_features} context features from "
                "target_layer_ids). The draft config and checkpoint disagree, or the draft "
                "belongs to another target."
            )
        # A column slice of a row-major tensor is strided: read it a band of rows at a time so
        # the transient memory is one band, not the whole fc.
        first = tensor_slice[0:1, columns.start : columns.stop]
        block = torch.empty(
            (hidden_size, columns.stop - columns.start), dtype=dtype or first.dtype
        )
        for row in range(0, hidden_size, _ROW_BAND):
            end = min(row + _ROW_BAND, hidden_size)
            block[row:end] = tensor_slice[row:end, columns.start : columns.stop]
    return block


# Set on a DFlash draft built KV-write-only (``kv_write_draft``): its fc holds only the column
# blocks of the features it names.
KV_WRITE_ONLY_ATTR = "_dflash_pp_kv_write_only"


def stage_fc_block(draft_model, features: Sequence[int], hidden: int) -> torch.Tensor:
    """``[H, k*H]`` of ``fc`` for the last stage's ``features``: a column block of the full
    ``fc``, or the whole ``fc`` of a KV-write-only draft built for these features."""
    pruned = draft_model.__dict__.get(KV_WRITE_ONLY_ATTR)
    if pruned is None:
        return fc_column_block(draft_model.fc.weight, features, hidden)
    if tuple(pruned.features) != tuple(features):
        raise RuntimeError(
            f"The KV-write-only draft holds fc blocks {list(pruned.features)}, but the stage "
            f"projects features {list(features)}."
        )
    return draft_model.fc.weight
