"""Shared by the capture tests that build one sglang target model per PP stage in this process
(``test_kimi_k3_capture_ownership``, ``test_pp_capture``): the stage selection, seeded weights
and the attention stand-in.

Stand-in, because attention needs a KV pool and backend metadata that these in-process tests do
not build (the real attention runs in the servers of ``test/e2e``): it records the input the
layer's real attention boundary hands it and returns a deterministic, layer-specific value.
"""

from __future__ import annotations

import os
import zlib
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Optional

import torch


class StandInAttention(torch.nn.Module):
    def __init__(self, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.last_input: Optional[torch.Tensor] = None

    def forward(self, hidden_states=None, **kwargs):  # every model here calls it by keyword
        self.last_input = hidden_states.clone()
        return torch.tanh(hidden_states) * 0.5 + 0.1 * (self.layer_idx + 1)


def seed_weights(model: torch.nn.Module) -> None:
    """Deterministic weights keyed by parameter name, so a layer has the same weights in every
    stage model and in the PP1 model (sglang allocates parameters uninitialised)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            r = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * r if p.ndim == 1 else 0.1 * r)


@contextmanager
def stage_context(pp_rank: int, pp_size: int, partition: Optional[str]):
    """This process reads as PP stage ``pp_rank`` of ``pp_size`` (as
    ``pp_worker_harness.pp_stage``), with ``SGLANG_PP_LAYER_PARTITION`` as given."""
    from sglang.srt.runtime_context import get_parallel

    group = SimpleNamespace(
        is_first_rank=pp_rank == 0,
        is_last_rank=pp_rank == pp_size - 1,
        rank_in_group=pp_rank,
        world_size=pp_size,
    )
    saved = os.environ.pop("SGLANG_PP_LAYER_PARTITION", None)
    if partition is not None:
        os.environ["SGLANG_PP_LAYER_PARTITION"] = partition
    try:
        with get_parallel().override(pp_rank=pp_rank, pp_size=pp_size, pp_group=group):
            yield
    finally:
        os.environ.pop("SGLANG_PP_LAYER_PARTITION", None)
        if saved is not None:
            os.environ["SGLANG_PP_LAYER_PARTITION"] = saved
