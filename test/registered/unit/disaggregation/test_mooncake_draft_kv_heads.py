"""DFLASH draft KV sent head by head to a decode of another attention TP.

Every byte is checked: the descriptors `send_draft_kvcache_heads` builds are applied to
simulated pools (a recording engine copies between numpy buffers at their addresses),
and each decode rank must end up holding exactly its own draft heads of every token row,
from the right prefill rows, and nothing else.
"""

import concurrent.futures
import itertools
import unittest
from types import SimpleNamespace

import numpy as np

from sglang.srt.disaggregation.base.conn import KVArgs
from sglang.srt.disaggregation.mooncake.conn import (
    KVArgsRegisterInfo,
    MooncakeKVManager,
)
from sglang.srt.disaggregation.utils import build_kv_layer_ids
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.runtime_context import get_context
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=10, suite="base-a-test-cpu")

PAGE = 4
HEAD_BYTES = 6  # head_dim x element size
LAYERS = 2  # draft layers: K0, K1, V0, V1
NUM_PAGES = 12
SRC_PAGES = np.array([5, 6, 9], dtype=np.int32)
DST_PAGES = np.array([2, 3, 7], dtype=np.int32)


class _Memory:
    """Buffers at fake addresses; an engine whose writes copy between them."""

    def __init__(self):
        self.buffers = {}
        self.next_base = 1 << 20
        self.descriptors = 0

    def alloc(self, array: np.ndarray) -> int:
        base = self.next_base
        self.buffers[base] = array.reshape(-1)
        self.next_base += array.nbytes + (1 << 16)
        return base

    def _locate(self, addr: int, length: int):
        for base, buf in self.buffers.items():
            if base <= addr and addr + length <= base + buf.size:
                return buf, addr - base
        raise AssertionError(f"address {addr} (+{length}) is in no registered buffer")

    def batch_transfer_sync(self, session, srcs, dsts, lengths) -> int:
        for src, dst, n in zip(srcs, dsts, lengths):
            sbuf, s = self._locate(src, n)
            dbuf, d = self._locate(dst, n)
            dbuf[d : d + n] = sbuf[s : s + n]
            self.descriptors += 1
        return 0


def _rank_heads(total: int, tp: int, rank: int) -> range:
    """The global draft heads an attention-TP rank holds (QKVParallelLinear)."""
    per_rank = max(1, total // tp)
    if tp <= total:
        return range(rank * per_rank, (rank + 1) * per_rank)
    return range(rank // (tp // total), rank // (tp // total) + 1)


def _prefill_ranks(tp_p: int, tp_d: int, dst_rank: int) -> range:
    """The prefill ranks a decode rank receives from (CommonKVManager's mapping)."""
    if tp_d >= tp_p:
        p = dst_rank // (tp_d // tp_p)
        return range(p, p + 1)
    k = tp_p // tp_d
    return range(dst_rank * k, (dst_rank + 1) * k)


def _value(entry: int, row: int, head: int) -> np.ndarray:
    return (np.arange(HEAD_BYTES) + 7 * entry + 13 * row + 29 * head) % 251 + 1


def _prefill_pool(total: int, tp: int, rank: int) -> np.ndarray:
    heads = _rank_heads(total, tp, rank)
    pool = np.zeros((2 * LAYERS, NUM_PAGES * PAGE, len(heads), HEAD_BYTES), np.uint8)
    for e, row, (h, head) in itertools.product(
        range(2 * LAYERS), range(NUM_PAGES * PAGE), enumerate(heads)
    ):
        pool[e, row, h] = _value(e, row, head)
    return pool


def _manager(memory, total, tp_p, rank, pool) -> MooncakeKVManager:
    # The fields the draft path reads; a real manager starts a transfer engine.
    kv_args = KVArgs()
    kv_args.engine_rank = rank
    kv_args.page_size = PAGE
    kv_args.num_draft_entries = 2 * LAYERS
    kv_args.draft_total_kv_head_num = total
    kv_args.kv_data_ptrs = [memory.alloc(pool[e]) for e in range(2 * LAYERS)]
    kv_args.kv_item_lens = [PAGE * pool.shape[2] * HEAD_BYTES] * (2 * LAYERS)
    manager = object.__new__(MooncakeKVManager)
    manager.kv_args = kv_args
    manager.attn_tp_size = tp_p
    manager.engine = memory
    manager.enable_staging = False
    manager.is_mla_backend = False
    manager.pp_size = 1
    manager.enable_deferred_decode_kv_release = False
    return manager


def _registration(memory, dst_rank, tp_d, pools) -> KVArgsRegisterInfo:
    return KVArgsRegisterInfo(
        room="",
        endpoint="",
        dst_port=0,
        mooncake_session_id="decode",
        dst_kv_ptrs=[memory.alloc(pools[e]) for e in range(2 * LAYERS)],
        dst_aux_ptrs=[],
        dst_state_data_ptrs=[],
        dst_tp_rank=dst_rank,
        dst_attn_tp_size=tp_d,
        dst_kv_item_len=0,
        dst_state_item_lens=[],
        dst_state_dim_per_tensor=[],
        dst_kv_layer_ids=[],
        dst_state_layer_ids=[],
        dst_kv_item_lens=[PAGE * pools.shape[2] * HEAD_BYTES] * (2 * LAYERS),
    )


def transfer(total: int, tp_p: int, tp_d: int):
    """Send every prefill rank's draft to every decode rank it maps to; return the
    decode pools and the number of descriptors moved."""
    memory = _Memory()
    managers = [
        _manager(memory, total, tp_p, p, _prefill_pool(total, tp_p, p))
        for p in range(tp_p)
    ]
    decode = []
    with concurrent.futures.ThreadPoolExecutor(2) as executor:
        for r in range(tp_d):
            heads = len(_rank_heads(total, tp_d, r))
            pools = np.zeros(
                (2 * LAYERS, NUM_PAGES * PAGE, heads, HEAD_BYTES), np.uint8
            )
            info = _registration(memory, r, tp_d, pools)
            for p in _prefill_ranks(tp_p, tp_d, r):
                manager = managers[p]
                assert manager._draft_kv_layout_mismatch(info) is None
                assert manager._sends_draft_kv_heads(tp_d)
                ret = manager.send_draft_kvcache_heads(
                    "decode", SRC_PAGES, info, DST_PAGES, executor
                )
                assert ret == 0
            decode.append(pools)
    return decode, memory.descriptors


def expected_decode_pools(pools, total: int, tp_d: int, rank: int) -> np.ndarray:
    """What decode rank ``rank`` must hold: its own heads of the prefill's source rows,
    at its destination rows, and nothing elsewhere."""
    expected = np.zeros_like(pools)
    src_rows = (SRC_PAGES[:, None] * PAGE + np.arange(PAGE)).reshape(-1)
    dst_rows = (DST_PAGES[:, None] * PAGE + np.arange(PAGE)).reshape(-1)
    for e, (src, dst), (h, head) in itertools.product(
        range(2 * LAYERS),
        zip(src_rows, dst_rows),
        enumerate(_rank_heads(total, tp_d, rank)),
    ):
        expected[e, dst, h] = _value(e, src, head)
    return expected


class TestDraftKVHeads(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        get_context().override_server_args(
            device="cpu", speculative_algorithm="DFLASH"
        ).install()

    def check(self, total: int, tp_p: int, tp_d: int):
        decode, _ = transfer(total, tp_p, tp_d)
        for r, pools in enumerate(decode):
            np.testing.assert_array_equal(
                pools,
                expected_decode_pools(pools, total, tp_d, r),
                err_msg=f"{total} heads, TP{tp_p} -> TP{tp_d}, rank {r}",
            )

    def test_every_decode_rank_holds_exactly_its_heads(self):
        for total, tp_p, tp_d in [
            (8, 4, 32),  # Kimi-K3: 2 heads per prefill rank, 1 (replicated) per decode
            (8, 2, 8),
            (2, 1, 2),
            (2, 2, 1),
            (8, 8, 2),
            (4, 8, 2),  # prefill heads replicated, decode TP smaller
            (4, 2, 8),  # decode heads replicated
        ]:
            with self.subTest(total=total, tp_p=tp_p, tp_d=tp_d):
                self.check(total, tp_p, tp_d)

    def test_one_descriptor_per_token_row_and_entry(self):
        _, descriptors = transfer(8, 4, 32)
        self.assertEqual(descriptors, 32 * 2 * LAYERS * len(SRC_PAGES) * PAGE)

    def test_wrong_decode_layout_is_refused_at_registration(self):
        memory = _Memory()
        manager = _manager(memory, 8, 4, 0, _prefill_pool(8, 4, 0))
        pools = np.zeros((2 * LAYERS, NUM_PAGES * PAGE, 2, HEAD_BYTES), np.uint8)
        info = _registration(memory, 0, 32, pools)  # 2 heads per page row, not 1
        reason = manager._draft_kv_layout_mismatch(info)
        self.assertIn("--page-size and --kv-cache-dtype", reason)
        manager.enable_staging = True
        self.assertIn(
            "SGLANG_DISAGG_STAGING_BUFFER", manager._draft_kv_layout_mismatch(info)
        )

    def test_layouts_this_path_cannot_serve_are_refused(self):
        memory = _Memory()
        manager = _manager(memory, 8, 4, 0, _prefill_pool(8, 4, 0))
        pools = np.zeros((2 * LAYERS, NUM_PAGES * PAGE, 1, HEAD_BYTES), np.uint8)
        info = _registration(memory, 0, 32, pools)
        self.assertIsNone(manager._draft_kv_layout_mismatch(info))
        manager.is_mla_backend = True  # pure MLA pairs its draft band positionally
        self.assertFalse(manager._sends_draft_kv_heads(32))
        self.assertIn("equal attention TP", manager._draft_kv_layout_mismatch(info))
        manager.is_mla_backend = False
        manager.pp_size, manager.kv_args.kv_layer_ids = 2, list(range(2 * LAYERS))
        self.assertIn("layer ids", manager._draft_kv_layout_mismatch(info))

    def test_a_dcp_decode_keeps_its_own_path(self):
        memory = _Memory()
        manager = _manager(memory, 8, 4, 0, _prefill_pool(8, 4, 0))
        pools = np.zeros((2 * LAYERS, NUM_PAGES * PAGE, 2, HEAD_BYTES), np.uint8)
        info = _registration(memory, 0, 32, pools)  # a layout this path would refuse
        info.requires_dcp_relayout = True
        self.assertIsNone(manager._draft_kv_layout_mismatch(info))

    def test_equal_tp_keeps_the_page_copies(self):
        memory = _Memory()
        manager = _manager(memory, 8, 4, 0, _prefill_pool(8, 4, 0))
        self.assertFalse(manager._sends_draft_kv_heads(4))
        pools = np.zeros((2 * LAYERS, NUM_PAGES * PAGE, 2, HEAD_BYTES), np.uint8)
        self.assertIsNone(
            manager._draft_kv_layout_mismatch(_registration(memory, 0, 4, pools))
        )

    def test_mha_pool_pairs_by_layer_id_under_dflash(self):
        target = object.__new__(MHATokenToKVPool)
        target.model_layer_ids = (2, 3)  # the second of two PP stages
        ids = lambda draft, pair: build_kv_layer_ids(  # noqa: E731
            token_to_kv_pool=target,
            draft_token_to_kv_pool=draft,
            num_draft_entries=0 if draft is None else 2 * LAYERS,
            num_hidden_layers=4,
            pair_mha_by_layer_id=pair,
        )
        draft = SimpleNamespace(layer_num=LAYERS)
        self.assertEqual(ids(draft, True), [2, 3, 2, 3, 4, 5, 4, 5])
        self.assertEqual(ids(None, True), [2, 3, 2, 3])  # a stage without the draft
        self.assertEqual(
            ids(draft, False), []
        )  # other algorithms: positional, as before


if __name__ == "__main__":
    unittest.main()
