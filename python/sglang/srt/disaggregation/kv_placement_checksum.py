"""A KV checksum that compares across TP widths, PP stages and head slices.

`KvChecksumComputer` digests a rank's KV buffers in registration order, so a decode can
compare only with a prefill of its own layout; any other is admitted unverified. Here
each side sums its own pools, read through the pool objects and the request's page
table rather than through transfer descriptors, into one sum per (component, layer,
K/V part, global head), each word hashed with its position in the request and its
place in the head (`keyed_head_sums`), so a head's sum does not depend on where a side
keeps it. A prefill rank reports the sums of every head it holds with its transfer
status; the decode compares each head it holds with the sum its prefill rank reported.
So a wrong source buffer, a head on the wrong decode rank, a layer paired with the
wrong decode layer or a page at the wrong slot each shows as a named mismatch.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

import numpy as np
import torch

from sglang.kernels.ops.memory.gpu_tensor_hash import FMIX32_C1
from sglang.kernels.ops.memory.keyed_head_hash import (
    MASK32,
    WARM_TOKEN_COUNTS,
    HeadRows,
    fmix32_words,
    keyed_head_sums,
    keyed_head_sums_reference,
    keyed_head_table,
)
from sglang.srt.mem_cache.memory_pool import (
    HybridLinearKVPool,
    KVCache,
    MHATokenToKVPool,
    MLATokenToKVPool,
)

if TYPE_CHECKING:
    from sglang.srt.configs.model_config import ModelConfig

logger = logging.getLogger(__name__)

TARGET_KV, DRAFT_KV, STATE = 0, 1, 2
COMPONENT_NAMES = ("target KV", "draft KV", "recurrent state")
# MHA pools keep K and V apart; an MLA pool keeps one latent per token.
K, V, LATENT = 0, 1, 2
PART_NAMES = ("K", "V", "latent")
# One row per sum: component, layer id, part, global head, sum.
SUM_COLUMNS = 5


def first_kv_head(attn_tp_rank: int, attn_tp_size: int, total_kv_heads: int) -> int:
    """The global index of a rank's first KV head: ranks hold consecutive heads, and
    when there are fewer heads than ranks, consecutive ranks hold the same one."""
    heads_per_rank = max(1, total_kv_heads // attn_tp_size)
    replicas = max(1, attn_tp_size // total_kv_heads)
    return attn_tp_rank // replicas * heads_per_rank


def _layer_buffers(pool: KVCache) -> List[Tuple[int, int, torch.Tensor]]:
    """(model layer id, part, [slots, heads, elements]) of each per-layer buffer."""
    if type(pool) is HybridLinearKVPool:
        mapping = pool.full_attention_layer_id_mapping
        layer_ids = sorted(mapping, key=mapping.get)
        inner = _layer_buffers(pool.full_kv_pool)
        start = pool.full_kv_pool.start_layer
        return [(layer_ids[layer - start], part, buf) for layer, part, buf in inner]
    if type(pool) is MLATokenToKVPool:
        return [(pool.start_layer + i, LATENT, b) for i, b in enumerate(pool.kv_buffer)]
    if type(pool) is MHATokenToKVPool and pool.kv_cache_layout == "nhd":
        return [
            (pool.start_layer + i, part, buffers[i])
            for part, buffers in ((K, pool.k_buffer), (V, pool.v_buffer))
            for i in range(pool.layer_num)
        ]
    raise ValueError(
        f"--disaggregation-enable-kv-checksum cannot digest a {type(pool).__name__} "
        "across layouts."
    )


def _buffer_key(component: int, layer_id: int, part: int) -> int:
    """32 bits naming a buffer's component, layer and part (the same on both sides)."""
    return fmix32_words(
        ((component << 24) ^ (layer_id << 4) ^ part) * FMIX32_C1 & MASK32
    )


def _state_rows(state: torch.Tensor, slice_axis: Optional[int]) -> torch.Tensor:
    """A request's state as ``[1, channels, words]``: the channels TP shards it by
    first (one, for state every rank holds whole), 16- and 8-bit elements widened."""
    state = state.unsqueeze(0) if slice_axis is None else state.movedim(slice_axis, 0)
    # A copy, never a view into the pool: the kernel is compiled for aligned rows.
    state = state.clone(memory_format=torch.contiguous_format)
    if state.element_size() < 4:
        narrow = torch.int16 if state.element_size() == 2 else torch.uint8
        state = state.view(narrow).to(torch.int32)
    return state.reshape(1, state.shape[0], -1)


def _sum_keys(
    terms: List[Tuple[int, int, int]], buffers: List[HeadRows]
) -> Tuple[np.ndarray, np.ndarray]:
    """The (component, layer, part, global head) of each sum, and its index in the
    flattened ``[buffers, max heads]`` sums."""
    width = max(b.data.shape[1] for b in buffers)
    keys, where = [], []
    for i, (term, buf) in enumerate(zip(terms, buffers)):
        for h in range(buf.data.shape[1]):
            keys.append((*term, buf.first_head + h))
            where.append(i * width + h)
    return np.array(keys, dtype=np.int64), np.array(where, dtype=np.int64)


def _sums_buffer(buffers: List[HeadRows]) -> torch.Tensor:
    width = max(b.data.shape[1] for b in buffers)
    return torch.zeros(
        len(buffers), width, dtype=torch.int64, device=buffers[0].data.device
    )


class KvPlacementChecksum:
    """The sums of this rank's target and draft KV for a request's tokens, and of its
    recurrent state (one slot per request) where the target has one."""

    def __init__(
        self,
        pools: List[Tuple[int, KVCache, int]],
        attn_tp_rank: int,
        attn_tp_size: int,
    ):
        """``pools``: (component, pool, total KV heads of the component's model)."""
        terms: List[Tuple[int, int, int]] = []
        self.buffers: List[HeadRows] = []
        for component, pool, total_heads in pools:
            for layer_id, part, data in _layer_buffers(pool):
                if part == LATENT:
                    first_head = 0  # the same on every rank
                else:
                    first_head = first_kv_head(attn_tp_rank, attn_tp_size, total_heads)
                terms.append((component, layer_id, part))
                self.buffers.append(
                    HeadRows(data, _buffer_key(component, layer_id, part), first_head)
                )
        self.keys, self.where = _sum_keys(terms, self.buffers)
        # (layer id, ordinal in the layer, [slots, ...] state, TP slice axis)
        self.states = []
        self.attn_tp_rank = attn_tp_rank
        target_pool = pools[0][1]
        if type(target_pool) is HybridLinearKVPool:
            ordinals: Dict[int, int] = {}
            entries = target_pool.mamba_pool.iter_transfer_state_entries()
            for _, state, slice_axis, layer_id in entries:
                ordinals[layer_id] = ordinals.get(layer_id, -1) + 1
                self.states.append((layer_id, ordinals[layer_id], state, slice_axis))
        device = self.buffers[0].data.device
        self.first_slot = torch.zeros(1, dtype=torch.int32, device=device)
        if self.states:
            states = self._state_buffers(0)
            state_terms = [
                (STATE, layer_id, part) for layer_id, part, _, _ in self.states
            ]
            self.state_keys, self.state_where = _sum_keys(state_terms, states)
        self.table = self.sums = self.state_sums = None
        if device.type == "cuda":
            # Made once: the kernel's parameters and its outputs. The launches below
            # compile the kernel's variants before the server serves.
            self.table = keyed_head_table(self.buffers)
            self.sums = _sums_buffer(self.buffers)
            if self.states:
                self.state_sums = _sums_buffer(states)
            for tokens in WARM_TOKEN_COUNTS:
                slots = torch.zeros(tokens, dtype=torch.int32, device=device)
                self.compute(slots, 0, 0 if self.states else None)

    def _state_buffers(self, slot: int) -> List[HeadRows]:
        buffers = []
        for layer_id, part, state, slice_axis in self.states:
            rows = _state_rows(state[slot], slice_axis)
            first = 0 if slice_axis is None else self.attn_tp_rank * rows.shape[1]
            buffers.append(HeadRows(rows, _buffer_key(STATE, layer_id, part), first))
        return buffers

    def compute(
        self,
        locs: torch.Tensor,
        first_pos: int,
        state_slot: Optional[int] = None,
    ) -> np.ndarray:
        """Sums of the tokens at pool slots ``locs`` (the int32 rows of
        ``req_to_token``), the first at ``first_pos``, and of the state at
        ``state_slot``: ``[n, SUM_COLUMNS]`` int64 rows of (component, layer, part,
        head or state channel, sum)."""
        sums = self._sums(self.buffers, locs, first_pos, self.table, self.sums)
        rows = [np.column_stack([self.keys, sums[self.where]])]
        if self.states:
            states = self._state_buffers(int(state_slot))
            table = None if self.table is None else keyed_head_table(states)
            sums = self._sums(states, self.first_slot, 0, table, self.state_sums)
            rows.append(np.column_stack([self.state_keys, sums[self.state_where]]))
        return np.concatenate(rows)

    @staticmethod
    def _sums(buffers, locs, first_pos, table, out) -> np.ndarray:
        if table is None:
            sums = keyed_head_sums_reference(buffers, locs, first_pos)
        else:
            sums = keyed_head_sums(buffers, locs, first_pos, table, out)
        return sums.cpu().numpy().ravel()


def encode_sums(rows: np.ndarray) -> bytes:
    return rows.astype("<i8").tobytes()


def decode_sums(payload: bytes) -> np.ndarray:
    return np.frombuffer(payload, dtype="<i8").reshape(-1, SUM_COLUMNS)


def find_mismatches(mine: np.ndarray, reports: Dict[int, bytes]) -> Optional[str]:
    """What differs between this decode rank's sums and those the prefill ranks
    reported (prefill rank -> encoded rows), or None when every head it holds was
    reported and equal."""
    expected: Dict[Tuple[int, int, int, int], List[Tuple[int, int]]] = {}
    for rank, payload in sorted(reports.items()):
        for *key, value in decode_sums(payload).tolist():
            expected.setdefault(tuple(key), []).append((rank, value))
    wrong: Dict[Tuple[int, int, int], Tuple[List[int], set]] = {}
    for *key, value in mine.tolist():
        reported = expected.get(tuple(key))
        if reported is not None and all(v == value for _, v in reported):
            continue
        heads, ranks = wrong.setdefault(tuple(key[:3]), ([], set()))
        heads.append(key[3])
        ranks.update(rank for rank, v in reported or () if v != value)
    if not wrong:
        return None
    parts = []
    for (component, layer_id, part), (heads, ranks) in sorted(wrong.items()):
        if component == STATE:
            what = f"recurrent state layer {layer_id} tensor {part} channel(s)"
        else:
            what = f"{COMPONENT_NAMES[component]} layer {layer_id} {PART_NAMES[part]}"
            what += " head(s)"
        if ranks:
            source = f"written by prefill rank(s) {sorted(ranks)}"
        else:
            source = "reported by no prefill rank"
        parts.append(f"{what} {heads} {source}")
    return "; ".join(parts)


def kv_placement_checksum_for(
    target_pool: KVCache,
    draft_pool: Optional[KVCache],
    model_config: ModelConfig,
    draft_model_config: Optional[ModelConfig],
    attn_tp_rank: int,
    attn_tp_size: int,
) -> Optional[KvPlacementChecksum]:
    """This rank's checksum of the pools it transfers, or None, said at startup, for
    pools it cannot digest."""
    pools = [(TARGET_KV, target_pool, model_config.get_total_num_kv_heads())]
    if draft_pool is not None:
        draft_heads = draft_model_config.get_total_num_kv_heads()
        pools.append((DRAFT_KV, draft_pool, draft_heads))
    try:
        return KvPlacementChecksum(pools, attn_tp_rank, attn_tp_size)
    except ValueError as e:
        logger.warning(
            "%s Requests from a prefill of another layout are admitted unverified.", e
        )
        return None
