"""The values sglang's dummy loader gives a full-shape draft parameter, for the parts of it that a
PP stage holds without holding the parameter.

``--load-format dummy`` (or ``--speculative-draft-load-format dummy``) fills every floating
parameter of a model with ``initialize_dummy_weights`` (0.5.23 ``model_loader/weight_utils.py``):
a fresh generator per parameter, on the parameter's device, seeded with the same seed. The values
therefore depend only on the parameter's shape, dtype and device type (a CUDA generator draws a
different stream from a CPU one), never on where in the model it sits. A stage that holds only a
slice of a draft parameter (the non-last stages' ``fc`` column blocks, the last stage's
KV-write-only draft) gets the slice of exactly what the full draft's dummy load produces by
running the stock initialiser on a transient parameter of the full shape, under the full
draft's parameter name (so an initialiser that seeds by name agrees too), and slicing it. The
transient costs the full parameter once, at startup, and only under dummy weights.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Tuple

import torch
from torch import nn

from sglang_dflash_pp.srt.models.context_partial import feature_columns

DUMMY_LOAD_FORMAT = "dummy"


def is_dummy(load_format) -> bool:
    return getattr(load_format, "value", load_format) == DUMMY_LOAD_FORMAT


def dummy_full_parameter(
    name: str,
    shape: Tuple[int, ...],
    dtype: torch.dtype,
    device,
    initialize: Optional[Callable[[nn.Module], None]] = None,
) -> torch.Tensor:
    """What the dummy loader puts into the draft parameter ``name`` of ``shape``/``dtype`` on
    ``device``."""
    if initialize is None:
        from sglang.srt.model_loader.weight_utils import initialize_dummy_weights as initialize
    root = module = nn.Module()
    *path, leaf = name.split(".")
    for part in path:
        module.add_module(part, nn.Module())
        module = getattr(module, part)
    storage = torch.empty(shape, dtype=dtype, device=device)
    module.register_parameter(leaf, nn.Parameter(storage, requires_grad=False))
    initialize(root)
    return getattr(module, leaf).data


def dummy_fc_column_blocks(
    features: Sequence[int],
    hidden_size: int,
    num_features: int,
    dtype: torch.dtype,
    device,
    initialize: Optional[Callable[[nn.Module], None]] = None,
) -> torch.Tensor:
    """``[H, k*H]``: the ``features`` column blocks of the dummy draft's ``fc.weight``."""
    shape = (hidden_size, num_features * hidden_size)
    full = dummy_full_parameter("fc.weight", shape, dtype, device, initialize)
    block = full[:, feature_columns(features, hidden_size)].clone()
    del full
    release_cached_memory(block.device)
    return block


def release_cached_memory(device) -> None:
    """Hand a transient's cached blocks back before the KV pool is sized from free memory."""
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
