"""DFLASH draft heads packed on the prefill for a decode of larger attention TP: every
decode byte of the packed sends is checked against the heads its own draft would hold.

The pack's Triton gather (``copy_mla_rows_into_pack``) cannot run on a CPU: here its
reference, reading the simulated pools at their addresses, stands in for it; everything
around it (the pack layout, the offsets and widths given to it, the page-run
descriptors) is the real code.
"""

import concurrent.futures
import unittest
from unittest import mock

import numpy as np
import torch

# The simulated pools and engine.
from test_mooncake_draft_kv_heads import (
    DST_PAGES,
    HEAD_BYTES,
    LAYERS,
    NUM_PAGES,
    PAGE,
    SRC_PAGES,
    _manager,
    _Memory,
    _prefill_pool,
    _rank_heads,
    _registration,
    expected_decode_pools,
)

import sglang.srt.disaggregation.common.dcp_pack as dcp_pack
from sglang.srt.runtime_context import get_context
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=10, suite="base-a-test-cpu")


class _HostStream:
    device = torch.device("cpu")

    def wait_stream(self, other):
        pass

    def synchronize(self):
        pass


class _PackBuffer:
    """The StagingBuffer interface the pack reads, over a simulated buffer."""

    def __init__(self, memory: _Memory, size: int):
        self.array = np.zeros(size, np.uint8)
        self.buffer = torch.from_numpy(self.array)
        self.base = memory.alloc(self.array)

    def get_ptr(self):
        return self.base

    def get_size(self):
        return self.array.size

    def fits(self, n):
        return n <= self.array.size

    def get_gather_stream(self):
        return _HostStream()

    def producer_stream(self):
        return _HostStream()


def _reference_gather(memory: _Memory):
    def copy_rows(ptrs, row_indices, pack, widths, src_strides):
        out, offset = pack.numpy(), 0
        for ptr, width, stride in zip(ptrs, widths, src_strides):
            for row in row_indices.tolist():
                buf, at = memory._locate(ptr + row * stride, width)
                out[offset : offset + width] = buf[at : at + width]
                offset += width

    return copy_rows


class TestDraftKVPack(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        get_context().override_server_args(
            device="cpu", speculative_algorithm="DFLASH"
        ).install()

    def send(self, total, tp_p, tp_d, pack_bytes):
        memory = _Memory()
        decode, sent = [], []
        manager = _manager(memory, total, tp_p, 0, _prefill_pool(total, tp_p, 0))
        manager._transfer_data = lambda s, blocks: (
            sent.append(len(blocks)),
            memory.batch_transfer_sync(s, *zip(*blocks)),
        )[1]
        pack = _PackBuffer(memory, pack_bytes)
        with (
            mock.patch.object(
                dcp_pack, "copy_mla_rows_into_pack", _reference_gather(memory)
            ),
            concurrent.futures.ThreadPoolExecutor(2) as executor,
        ):
            for r in range(tp_d // tp_p):  # the decode ranks prefill rank 0 writes
                heads = len(_rank_heads(total, tp_d, r))
                pools = np.zeros(
                    (2 * LAYERS, NUM_PAGES * PAGE, heads, HEAD_BYTES), np.uint8
                )
                info = _registration(memory, r, tp_d, pools)
                ret = manager.send_draft_kvcache_heads(
                    "decode", SRC_PAGES, info, DST_PAGES, executor, pack_buffer=pack
                )
                self.assertEqual(ret, 0)
                decode.append(pools)
        return decode, sent, memory

    def test_packed_sends_give_each_decode_rank_its_heads(self):
        for total, tp_p, tp_d in [(8, 4, 32), (8, 2, 8), (4, 1, 2)]:
            with self.subTest(total=total, tp_p=tp_p, tp_d=tp_d):
                decode, sent, memory = self.send(total, tp_p, tp_d, 1 << 16)
                # One descriptor per run of decode pages ([2, 3], [7]) and entry.
                self.assertEqual(sent, [2 * 2 * LAYERS] * (tp_d // tp_p))
                for r, pools in enumerate(decode):
                    np.testing.assert_array_equal(
                        pools, expected_decode_pools(pools, total, tp_d, r)
                    )

    def test_a_chunk_larger_than_the_buffer_goes_per_row(self):
        decode, sent, memory = self.send(8, 4, 32, 8)  # too small for any chunk
        self.assertEqual(sent, [])
        self.assertEqual(memory.descriptors, 8 * 2 * LAYERS * len(SRC_PAGES) * PAGE)


if __name__ == "__main__":
    unittest.main()
