from sglang_dflash_pp.patch_series.cst_anchors import Stmt
from sglang_dflash_pp.patch_series.cst_declaration_edits import AddImport, AddMethod, AddParameter
from sglang_dflash_pp.patch_series.cst_edits import AddKeywordArgument, InsertStatements

CONN = "srt/disaggregation/mooncake/conn.py"

PR = dict(
    title="[PD] Mooncake: pack DFLASH draft head slices for a larger decode TP",
    description="""\
Motivation. When the decode runs a larger attention TP than the prefill, each decode rank
holds a slice of the draft heads of every prefill token row, and the previous PR sends it one
descriptor per token row and draft entry. For Kimi-K3 (prefill TP4, decode TP32, 6 draft
layers) an 8192-token chunk is 786,432 descriptors from each prefill rank, whose host work
alone is many times the chunk's time on the link (see the benchmark below).

Change. On CUDA, each transfer worker gets a registered pack buffer at startup (sized for a
`--chunked-prefill-size` chunk of half the draft heads, the most a larger decode TP takes),
and a send to a decode rank with fewer draft heads per row gathers that rank's heads of every
draft entry into it with the existing DCP pack helpers (`try_pack_dcp_src`, one Triton launch
for all entries), then sends one descriptor per run of contiguous decode pages and entry. The
gather runs on the buffer's gather stream after the worker has waited for the chunk's KV, and
the send starts after it synchronised. A chunk that does not fit, and every other device, keep
the per-token descriptors.

Memory: 2 x 6 x 128 x 2 B x 8192 tokens = 25 MB per transfer worker for Kimi-K3's draft
(100 MB with the default 4 queues), from Mooncake's custom pool when one is configured, only on
a DFLASH prefill whose draft has 2 or more heads per rank. It is allocated at startup, before
any decode registers, so also where every decode runs the same TP and never packs.

Speed, Kimi-K3 geometry (a prefill rank at TP4 sends an 8192-token chunk to its 8 decode
ranks at TP32: 201 MB, 4.0 ms at 50 GB/s):

| | descriptors per chunk | cost per chunk |
|---|---|---|
| per token row (previous PR) | 786,432 | 30 ms of host work to build them (2-core CPU), 7.5x the link time, before the transport sees one |
| packed (this PR) | 96 (pages contiguous) | gather: 91 us GPU, 120 us host per decode rank on an H200, 0.96 ms (24% of the link time); descriptors: 73 us per decode rank (2-core CPU) |

Gathering each distinct head slice once per chunk (here 2 instead of 8: four decode ranks hold
each head) and copying 8-byte words would bring the gather to 4.2% of the link time; both keep
state across a chunk's sends and are left to a follow-up.

Tests: `test/registered/unit/disaggregation/test_mooncake_draft_kv_pack.py` checks every
decode byte of the packed sends (the Triton gather replaced by its reference on CPU), and that a
chunk larger than the buffer falls back to per-token descriptors.
""",
    edits=[
        InsertStatements(
            CONN,
            "MooncakeKVManager.__init__",
            before=Stmt(
                "self._staging_ctx = (PrefillStagingContext() "
                "if self.enable_staging else None)"
            ),
            code="""
            self._draft_kv_pack_buffers = self._init_draft_kv_pack_buffers(
                len(self.transfer_queues)
            )
            """,
        ),
        AddParameter(
            CONN,
            "MooncakeKVManager.send_draft_kvcache_heads",
            name="pack_buffer",
            default="None",
        ),
        AddKeywordArgument(
            CONN,
            "MooncakeKVManager.transfer_worker",
            call="self.send_draft_kvcache_heads",
            keyword="pack_buffer",
            value=(
                "self._draft_kv_pack_buffers[worker_index] "
                "if self._draft_kv_pack_buffers else None"
            ),
        ),
        InsertStatements(
            CONN,
            "MooncakeKVManager.send_draft_kvcache_heads",
            after=Stmt("n = self.kv_args.num_draft_entries"),
            code="""
            if pack_buffer is not None and dst_heads < src_heads:
                ret = self._send_packed_draft_heads(
                    mooncake_session_id,
                    src_rows.reshape(-1),
                    registration_info,
                    dst_kv_indices,
                    pack_buffer,
                    src_head,
                    dst_heads,
                )
                if ret is not None:
                    return ret
            """,
        ),
        AddMethod(
            CONN,
            "MooncakeKVManager",
            after="send_draft_kvcache_heads",
            code='''
            def _init_draft_kv_pack_buffers(self, count: int) -> List[StagingBuffer]:
                """Registered buffers, one per transfer worker, into which a send packs the
                DFLASH draft heads a decode of larger attention TP takes from each row."""
                heads = self.kv_args.draft_total_kv_head_num // self.attn_tp_size
                chunk = get_schedule().chunked_prefill_size
                if heads < 2 or not chunk or chunk < 0 or get_device().device != "cuda":
                    return []
                n = self.kv_args.num_draft_entries
                row_bytes = sum(self.kv_args.kv_item_lens[-n:]) // self.kv_args.page_size
                # A larger decode TP takes at most half of this rank's heads.
                size = (chunk + self.kv_args.page_size) * row_bytes // 2
                from sglang.srt.disaggregation.common.staging_handler import (
                    _get_custom_mem_pool,
                )

                device = f"cuda:{self.kv_args.gpu_id}"
                # Mooncake's NVLink pools need registered memory allocated from them.
                custom_mem_pool, _ = _get_custom_mem_pool(device)
                buffers = []
                for _ in range(count):
                    buf = StagingBuffer(
                        size, device, self.kv_args.gpu_id, custom_mem_pool=custom_mem_pool
                    )
                    self._register_staging_memory(buf.get_ptr(), buf.get_size())
                    buffers.append(buf)
                logger.info(
                    "DFLASH draft KV pack buffers: %d x %.1f MB", count, size / 2**20
                )
                return buffers

            def _send_packed_draft_heads(
                self,
                mooncake_session_id: str,
                src_rows: npt.NDArray[np.int64],
                registration_info: KVArgsRegisterInfo,
                dst_kv_indices: npt.NDArray[np.int32],
                pack_buffer: StagingBuffer,
                src_head: int,
                dst_heads: int,
            ) -> Optional[int]:
                """Gather the decode rank's draft heads of every source row into
                ``pack_buffer``, then send one descriptor per run of decode pages and
                entry. None when the chunk does not fit: the caller sends per row."""
                from sglang.srt.disaggregation.common.dcp_pack import try_pack_dcp_src

                n = self.kv_args.num_draft_entries
                page_size = self.kv_args.page_size
                src_heads = max(1, self.kv_args.draft_total_kv_head_num // self.attn_tp_size)
                src_row_bytes = [item // page_size for item in self.kv_args.kv_item_lens[-n:]]
                head_bytes = [row // src_heads for row in src_row_bytes]
                dst_row_bytes = [b * dst_heads for b in head_bytes]
                packed = try_pack_dcp_src(
                    pack_buffer=pack_buffer,
                    kv_data_ptrs=[
                        ptr + src_head * b
                        for ptr, b in zip(self.kv_args.kv_data_ptrs[-n:], head_bytes)
                    ],
                    src_token_indices=src_rows,
                    token_item_lens=dst_row_bytes,
                    src_token_item_lens=src_row_bytes,
                )
                if packed is None:
                    return None
                packed_ptrs, _ = packed
                # Packed rows are the decode rank's whole rows, page after page.
                src_runs, dst_runs = group_concurrent_contiguous(
                    np.arange(dst_kv_indices.size), dst_kv_indices
                )
                blocks = [
                    (
                        src + s[0] * page_size * row,
                        dst + d[0] * page_size * row,
                        len(s) * page_size * row,
                    )
                    for src, dst, row in zip(
                        packed_ptrs, registration_info.dst_kv_ptrs[-n:], dst_row_bytes
                    )
                    for s, d in zip(src_runs, dst_runs)
                ]
                return self._transfer_data(mooncake_session_id, blocks)
            ''',
        ),
        AddImport(
            CONN,
            module="sglang.srt.disaggregation.common.staging_buffer",
            names=("StagingBuffer",),
        ),
    ],
    files=["test/registered/unit/disaggregation/test_mooncake_draft_kv_pack.py"],
)
