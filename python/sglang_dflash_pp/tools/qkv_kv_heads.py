"""Which KV heads each TP rank holds, read from sglang's own ``QKVParallelLinear``.

The verifiers (``preflight``'s decode process and the transfer tests) must know which draft KV
heads a decode rank holds without asking the geometry module they check. Restating sglang's
sharding rule next to each verifier would be a second owner of it that could agree with our
geometry by the same mistake; instead this loads a ``k_proj`` weight whose rows carry their head
index into a real ``QKVParallelLinear`` built for each rank (a logical TP group, no process
group needed) and reads back which heads the rank's shard received. If sglang ever shards KV
heads differently, the verifiers follow it and our geometry has to as well.

Imports ``sglang.srt.layers.linear`` (a few seconds), lazily.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Tuple

_HIDDEN = 8  # any width: only the head rows matter
_HEAD_DIM = 2


def _plain_tp_layout(tp_size: int, rank: int) -> dict:
    """A whole, consistent plain-TP layout (no attention DP/CP, no MoE split): the draft's
    attention shards over the TP group; stating every width, and no process group, keeps
    sglang's topology check satisfied whatever a process has published or built before."""
    return dict(
        tp_group=None, attn_tp_group=None, attn_cp_group=None, moe_ep_group=None,
        tp_size=tp_size, tp_rank=rank,
        attn_tp_size=tp_size, attn_tp_rank=rank, attn_dp_size=1, attn_dp_rank=0,
        attn_cp_size=1, attn_cp_rank=0, moe_tp_size=tp_size, moe_ep_size=1, moe_dp_size=1,
    )  # fmt: skip


@lru_cache(maxsize=None)
def kv_heads_by_rank(total_kv_heads: int, tp_size: int) -> Tuple[range, ...]:
    """``ranges[r]``: the KV heads TP rank ``r`` of ``tp_size`` holds, as sglang loads them."""
    import torch
    from sglang.srt.layers.linear import QKVParallelLinear
    from sglang.srt.runtime_context import get_parallel

    labels = torch.arange(total_kv_heads, dtype=torch.float32).repeat_interleave(_HEAD_DIM)
    k_weight = labels[:, None].expand(-1, _HIDDEN).contiguous()
    owned = []
    for rank in range(tp_size):
        with get_parallel().override(**_plain_tp_layout(tp_size, rank)):
            layer = QKVParallelLinear(
                _HIDDEN,
                _HEAD_DIM,
                total_num_heads=max(total_kv_heads, tp_size),
                total_num_kv_heads=total_kv_heads,
                bias=False,
                params_dtype=torch.float32,
            )
        layer.weight.data.fill_(-1)
        layer.weight_loader(layer.weight, k_weight, "k")
        q_rows = layer.num_heads * _HEAD_DIM
        k_rows = layer.weight.data[q_rows : q_rows + layer.num_kv_heads * _HEAD_DIM, 0]
        heads = [int(h) for h in k_rows.view(-1, _HEAD_DIM)[:, 0].tolist()]
        if heads != list(range(heads[0], heads[0] + len(heads))) or min(heads) < 0:
            raise AssertionError(f"TP rank {rank}/{tp_size} holds non-contiguous heads {heads}")
        owned.append(range(heads[0], heads[-1] + 1))
    return tuple(owned)
