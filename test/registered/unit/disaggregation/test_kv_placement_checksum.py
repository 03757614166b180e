"""The placement-keyed KV checksum compares across layouts and names what is misplaced.

Every prefill layout against every decode layout (attention TP 1..64 on each side,
1..16 KV heads, the target's layers split over 2 PP stages, the draft on the last):
each rank sums its own pools, and every decode rank's sums equal what the prefill ranks
report for the heads it holds. Then each misplacement a transfer can make (a wrong
layer, a wrong head, a wrong page, a page shifted by one token, K and V swapped, one
flipped byte) is made on a decode rank and must be reported with its component, layer,
part and head. The Triton kernel equals the reference under the Triton interpreter.
"""

import itertools
import os
import subprocess
import sys
import types
import unittest

import torch
from test_mooncake_draft_kv_heads import _rank_heads

from sglang.srt.disaggregation.kv_placement_checksum import (
    DRAFT_KV,
    TARGET_KV,
    KvPlacementChecksum,
    encode_sums,
    find_mismatches,
)
from sglang.srt.mem_cache.memory_pool import (
    HybridLinearKVPool,
    MambaPool,
    MHATokenToKVPool,
    MLATokenToKVPool,
)
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=30, suite="base-a-test-cpu")

TP_SIZES = (1, 2, 4, 8, 16, 32, 64)
HEAD_COUNTS = (1, 2, 4, 8, 16)
TARGET_LAYERS = 3  # over two PP stages: layers 0-1 and 2
DRAFT_LAYERS = 2
PP_STAGES = ((0, 2), (2, 3))
HEAD_DIM = 4  # bf16 elements: two words per head row
TOKENS = 6
FIRST_POS = 3  # the decode already held positions 0-2
SLOTS = 16


def mha_pool(k_buffers, v_buffers, start_layer=0) -> MHATokenToKVPool:
    """A real pool's fields over given buffers (its constructor warms up on CUDA)."""
    pool = object.__new__(MHATokenToKVPool)
    pool.k_buffer, pool.v_buffer = list(k_buffers), list(v_buffers)
    pool.start_layer, pool.layer_num = start_layer, len(k_buffers)
    pool.kv_cache_layout = "nhd"
    return pool


def logical_kv(num_layers: int, heads: int, seed: int) -> torch.Tensor:
    """[layer, K/V, position, head, element]: what every rank should hold."""
    g = torch.Generator().manual_seed(seed)
    shape = (num_layers, 2, FIRST_POS + TOKENS, heads, HEAD_DIM)
    return torch.randn(shape, generator=g).to(torch.bfloat16)


class Rank:
    """One rank's pools: its layers and heads of the logical KV at its own slots."""

    def __init__(self, kv, layers, heads, slots, start_layer=0):
        self.slots = slots
        self.k = [
            torch.zeros(SLOTS, len(heads), HEAD_DIM, dtype=kv.dtype) for _ in layers
        ]
        self.v = [torch.zeros_like(b) for b in self.k]
        positions = torch.arange(FIRST_POS, FIRST_POS + TOKENS)
        for i, layer in enumerate(layers):
            self.k[i][slots] = kv[layer, 0][positions][:, heads]
            self.v[i][slots] = kv[layer, 1][positions][:, heads]
        self.start_layer = start_layer

    def pool(self):
        return mha_pool(self.k, self.v, self.start_layer)


def head_range(rank, tp, total):
    """The heads a rank's pools hold, as QKVParallelLinear shards them (not derived
    from the checksum's own ``first_kv_head``)."""
    return list(_rank_heads(total, tp, rank))


def slots_for(rank_seed: int) -> torch.Tensor:
    return torch.randperm(SLOTS, generator=torch.Generator().manual_seed(rank_seed))[
        :TOKENS
    ]


class TestKvPlacementChecksum(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.kv = {h: logical_kv(TARGET_LAYERS, h, h) for h in HEAD_COUNTS}
        cls.draft = {h: logical_kv(DRAFT_LAYERS, h, 100 + h) for h in HEAD_COUNTS}

    def prefill_reports(self, tp: int, heads: int, stages=PP_STAGES):
        """Sums of every prefill rank (PP2 x tp), keyed by a unique rank id."""
        reports = {}
        for (stage, (start, end)), rank in itertools.product(
            enumerate(stages), range(tp)
        ):
            mine = head_range(rank, tp, heads)
            slots = slots_for(1000 * stage + rank)
            pools = [
                (
                    TARGET_KV,
                    Rank(self.kv[heads], range(start, end), mine, slots, start).pool(),
                    heads,
                )
            ]
            if stage == len(stages) - 1:
                draft = Rank(self.draft[heads], range(DRAFT_LAYERS), mine, slots)
                pools.append((DRAFT_KV, draft.pool(), heads))
            checksum = KvPlacementChecksum(pools, rank, tp)
            reports[stage * tp + rank] = encode_sums(checksum.compute(slots, FIRST_POS))
        return reports

    def decode_rank(self, rank: int, tp: int, heads: int):
        slots = slots_for(7777 + rank)
        mine = head_range(rank, tp, heads)
        target = Rank(self.kv[heads], range(TARGET_LAYERS), mine, slots)
        draft = Rank(self.draft[heads], range(DRAFT_LAYERS), mine, slots)
        checksum = KvPlacementChecksum(
            [(TARGET_KV, target.pool(), heads), (DRAFT_KV, draft.pool(), heads)],
            rank,
            tp,
        )
        return checksum, slots, target, draft

    def test_every_layout_compares_equal(self):
        """7 x 7 attention TP sizes x 5 head counts: 245 layouts."""
        for heads in HEAD_COUNTS:
            decode_sums = {}
            for d_tp in TP_SIZES:
                for d_rank in range(d_tp):
                    checksum, slots, *_ = self.decode_rank(d_rank, d_tp, heads)
                    decode_sums[d_tp, d_rank] = checksum.compute(slots, FIRST_POS)
            for p_tp in TP_SIZES:
                reports = self.prefill_reports(p_tp, heads)
                for d_tp in TP_SIZES:
                    for d_rank in range(d_tp):
                        mismatch = find_mismatches(decode_sums[d_tp, d_rank], reports)
                        self.assertIsNone(mismatch, (p_tp, d_tp, heads, d_rank))

    def test_every_pp_split_compares_equal(self):
        """The target's 3 layers over 1, 2 or 3 stages, the draft on the last."""
        splits = [((0, 3),), PP_STAGES, ((0, 1), (1, 2), (2, 3))]
        for stages, p_tp, d_tp, heads in itertools.product(
            splits, (1, 4), (1, 8), (2, 8)
        ):
            reports = self.prefill_reports(p_tp, heads, stages)
            for d_rank in range(d_tp):
                checksum, slots, *_ = self.decode_rank(d_rank, d_tp, heads)
                mismatch = find_mismatches(checksum.compute(slots, FIRST_POS), reports)
                self.assertIsNone(mismatch, (stages, p_tp, d_tp, heads, d_rank))

    def assert_named(self, mutate, expected: str, p_tp=2, d_tp=4, heads=8, d_rank=1):
        reports = self.prefill_reports(p_tp, heads)
        checksum, slots, target, draft = self.decode_rank(d_rank, d_tp, heads)
        self.assertIsNone(find_mismatches(checksum.compute(slots, FIRST_POS), reports))
        mutate(target, draft, slots)
        mismatch = find_mismatches(checksum.compute(slots, FIRST_POS), reports)
        self.assertEqual(mismatch, expected)

    def test_wrong_layer(self):
        def mutate(target, draft, slots):
            target.v[2][slots] = target.v[1][slots]

        # Decode rank 1 of TP4 holds heads 2-3, written by prefill rank 1 of stage 1.
        self.assert_named(
            mutate, "target KV layer 2 V head(s) [2, 3] written by prefill rank(s) [2]"
        )

    def test_wrong_head(self):
        def mutate(target, draft, slots):
            draft.k[0][slots] = draft.k[0][slots].flip(1)

        self.assert_named(
            mutate, "draft KV layer 0 K head(s) [2, 3] written by prefill rank(s) [2]"
        )

    def test_wrong_page(self):
        def mutate(target, draft, slots):
            target.k[0][slots[:2]] = target.k[0][slots[2:4]]

        self.assert_named(
            mutate, "target KV layer 0 K head(s) [2, 3] written by prefill rank(s) [0]"
        )

    def test_page_shifted_by_one_token(self):
        def mutate(target, draft, slots):
            draft.v[1][slots[1:]] = draft.v[1][slots[:-1]].clone()

        self.assert_named(
            mutate, "draft KV layer 1 V head(s) [2, 3] written by prefill rank(s) [2]"
        )

    def test_k_and_v_swapped(self):
        def mutate(target, draft, slots):
            k = target.k[1][slots].clone()
            target.k[1][slots] = target.v[1][slots]
            target.v[1][slots] = k

        self.assert_named(
            mutate,
            "target KV layer 1 K head(s) [2, 3] written by prefill rank(s) [0]; "
            "target KV layer 1 V head(s) [2, 3] written by prefill rank(s) [0]",
        )

    def test_one_flipped_byte(self):
        def mutate(target, draft, slots):
            draft.v[0].view(torch.uint8)[slots[3], 1, 5] ^= 0x10

        self.assert_named(
            mutate, "draft KV layer 0 V head(s) [3] written by prefill rank(s) [2]"
        )

    def test_replicated_heads_and_missing_reports(self):
        # Two heads over prefill TP4 (two replicas each) into a decode TP1.
        def mutate(target, draft, slots):
            target.k[2][slots] = 0

        self.assert_named(
            mutate,
            "target KV layer 2 K head(s) [0, 1] "
            "written by prefill rank(s) [4, 5, 6, 7]",
            p_tp=4,
            d_tp=1,
            heads=2,
            d_rank=0,
        )
        checksum, slots, *_ = self.decode_rank(0, 1, 2)
        reports = self.prefill_reports(4, 2)
        del reports[4], reports[5], reports[6], reports[7]  # the last stage's
        mismatch = find_mismatches(checksum.compute(slots, FIRST_POS), reports)
        self.assertIn("target KV layer 2 K head(s) [0, 1] reported by no", mismatch)
        self.assertIn("draft KV layer 1 V head(s) [0, 1] reported by no", mismatch)

    def test_mla_latent_in_a_hybrid_pool(self):
        """Kimi-K3's target KV: full-attention layers 1 and 3 of a hybrid model, one
        latent per token that every TP rank holds."""
        g = torch.Generator().manual_seed(5)
        latent = torch.randn(2, FIRST_POS + TOKENS, 1, 8, generator=g)

        def pool(slots, corrupt=False):
            mla = object.__new__(MLATokenToKVPool)
            mla.start_layer = 0
            mla.kv_buffer = [torch.zeros(SLOTS, 1, 8) for _ in range(2)]
            for i in range(2):
                mla.kv_buffer[i][slots] = latent[i, FIRST_POS:]
            if corrupt:
                mla.kv_buffer[1][slots[0], 0, 0] += 1
            mamba = object.__new__(MambaPool)
            mamba.mamba_cache, mamba._slot_siblings = types.SimpleNamespace(), []
            hybrid = object.__new__(HybridLinearKVPool)
            hybrid.full_kv_pool, hybrid.mamba_pool = mla, mamba
            hybrid.full_attention_layer_id_mapping = {1: 0, 3: 1}
            return hybrid

        reports = {}
        for rank in range(4):
            slots = slots_for(rank)
            checksum = KvPlacementChecksum([(TARGET_KV, pool(slots), 1)], rank, 4)
            reports[rank] = encode_sums(checksum.compute(slots, FIRST_POS))
        for rank, tp, corrupt in ((5, 8, False), (0, 1, True)):
            slots = slots_for(50 + rank)
            checksum = KvPlacementChecksum(
                [(TARGET_KV, pool(slots, corrupt), 1)], rank, tp
            )
            mismatch = find_mismatches(checksum.compute(slots, FIRST_POS), reports)
            if corrupt:
                self.assertEqual(
                    mismatch,
                    "target KV layer 3 latent head(s) [0] "
                    "written by prefill rank(s) [0, 1, 2, 3]",
                )
            else:
                self.assertIsNone(mismatch)

    def test_recurrent_state_of_a_hybrid_model(self):
        """Kimi-K3's shape: a conv state ``[K - 1, channels]`` sharded on its second
        axis and a temporal state ``[heads, k, v]`` sharded on its first, one slot per
        request; a prefill of TP2 x PP2 (a full-attention layer and a state layer per
        stage) against a decode of TP1, then one flipped byte and a wrong slot."""
        g = torch.Generator().manual_seed(9)
        conv = torch.randn(4, 3, 8, generator=g).to(torch.bfloat16)  # [layer, K-1, ch]
        temporal = torch.randn(4, 4, 2, 2, generator=g)  # [layer, heads, k, v]
        latent = torch.randn(4, FIRST_POS + TOKENS, 1, 8, generator=g)

        def pool(mla_layers, state_layers, rank, tp, slots, state_slot):
            mla = object.__new__(MLATokenToKVPool)
            mla.start_layer = 0
            mla.kv_buffer = [torch.zeros(SLOTS, 1, 8) for _ in mla_layers]
            for i, layer in enumerate(mla_layers):
                mla.kv_buffer[i][slots] = latent[layer, FIRST_POS:]
            channels, heads = 8 // tp, 4 // tp
            mamba = object.__new__(MambaPool)
            mamba.mamba_layer_ids = list(state_layers)
            mamba.conv_slice_axis = 1
            mamba._slot_siblings = []
            mamba.mamba_cache = types.SimpleNamespace(
                conv=[torch.zeros(len(state_layers), 4, 3, channels, dtype=conv.dtype)],
                temporal=torch.zeros(len(state_layers), 4, heads, 2, 2),
            )
            for i, layer in enumerate(state_layers):
                cols = slice(rank * channels, (rank + 1) * channels)
                mamba.mamba_cache.conv[0][i, state_slot] = conv[layer][:, cols]
                rows = slice(rank * heads, (rank + 1) * heads)
                mamba.mamba_cache.temporal[i, state_slot] = temporal[layer][rows]
            hybrid = object.__new__(HybridLinearKVPool)
            hybrid.full_kv_pool, hybrid.mamba_pool = mla, mamba
            hybrid.full_attention_layer_id_mapping = {
                layer: i for i, layer in enumerate(mla_layers)
            }
            return KvPlacementChecksum([(TARGET_KV, hybrid, 1)], rank, tp), hybrid

        reports = {}
        for stage, rank in itertools.product(range(2), range(2)):
            slots = slots_for(300 + 2 * stage + rank)
            checksum, _ = pool([2 * stage + 1], [2 * stage], rank, 2, slots, 1 + rank)
            slot = torch.tensor([1 + rank])
            rows = checksum.compute(slots, FIRST_POS, slot)
            reports[2 * stage + rank] = encode_sums(rows)
        slots = slots_for(400)
        checksum, hybrid = pool([1, 3], [0, 2], 0, 1, slots, 3)
        self.assertIsNone(
            find_mismatches(
                checksum.compute(slots, FIRST_POS, torch.tensor([3])), reports
            )
        )
        temporal_layer_2 = hybrid.mamba_pool.mamba_cache.temporal[1, 3]
        temporal_layer_2.view(-1).view(torch.uint8)[9] ^= 0x01  # head 0
        mismatch = find_mismatches(
            checksum.compute(slots, FIRST_POS, torch.tensor([3])), reports
        )
        self.assertEqual(
            mismatch,
            "recurrent state layer 2 tensor 1 channel(s) [0] "
            "written by prefill rank(s) [2]",
        )
        mismatch = find_mismatches(
            checksum.compute(slots, FIRST_POS, torch.tensor([2])), reports
        )  # another request's slot
        self.assertIn(
            "recurrent state layer 0 tensor 0 channel(s) [0, 1, 2, 3, 4", mismatch
        )

    def test_triton_kernel_equals_reference(self):
        """The CUDA path, run by the Triton interpreter on CPU."""
        script = """
import torch
from sglang.kernels.ops.memory.keyed_head_hash import (
    HeadRows, keyed_head_sums, keyed_head_sums_reference, keyed_head_table)
g = torch.Generator().manual_seed(0)
a = torch.randn(40, 2, 8, generator=g).to(torch.bfloat16)
b = torch.randn(40, 1, 12, generator=g)
c = torch.randn(40, 4, 6, generator=g).to(torch.bfloat16)[:, 1:3]
bufs = [HeadRows(a, 123, 2), HeadRows(b, 0xDEADBEEF, 0), HeadRows(c, 7, 5)]
locs = torch.tensor([3, 9, 10, 11, 30, 31, 2], dtype=torch.int32)
ref = keyed_head_sums_reference(bufs, locs, 17)
out = torch.full((3, 2), 5, dtype=torch.int64)  # reused: the call zeroes it
table = keyed_head_table(bufs)
for _ in range(2):
    keyed_head_sums(bufs, locs, 17, table, out, tokens_per_block=4, words_per_step=2)
    assert torch.equal(ref, out), (ref, out)
assert (ref[:, 0] > 0).all() and ref[1, 1] == 0
print("equal", ref.tolist())
"""
        env = dict(os.environ, TRITON_INTERPRET="1")
        result = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True
        )
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        self.assertIn("equal", result.stdout)


if __name__ == "__main__":
    unittest.main()
