from sglang_dflash_pp.patch_series.cst_anchors import IfTest, Stmt
from sglang_dflash_pp.patch_series.cst_declaration_edits import (
    AddClassAttribute,
    AddImport,
    AddMethod,
    AddParameter,
)
from sglang_dflash_pp.patch_series.cst_edits import (
    AddKeywordArgument,
    InsertStatements,
    ReplaceExpression,
    ReplaceKeywordArgument,
    ReplaceStatement,
)

PR = dict(
    title="[PD] Mooncake: send DFLASH draft KV head by head across TP sizes",
    description="""\
A DFLASH prefill appends its draft's KV buffers to the transfer entries. The draft shards its
own KV heads over attention TP, independently of the target, so when the prefill and the decode
run different attention TP sizes a decode rank holds other draft heads per token row than the
prefill rank that sends to it. Today nothing handles that:

- A hybrid-MLA target (Kimi-K3) always takes `send_kvcache`, which copies the draft pages with
  the prefill's item length. For prefill TP4 (2 of 8 draft heads per rank) to decode TP32 (1
  head per rank) it writes twice the bytes of every page, at twice the right offset: other
  requests' pages are overwritten and the draft KV the decode reads is wrong. Nothing is
  reported; only the acceptance rate drops.
- A plain-MHA target at another TP takes `send_kvcache_slice`, which refuses entries of unequal
  item lengths and fails the decode's session.

Now the draft entries are sent by `send_draft_kvcache_heads` when the two attention TP sizes
differ: for each draft entry, the heads both ranks hold (`compute_head_slice_params` with the
draft's own head count, `KVArgs.draft_total_kv_head_num`) move between the token rows of each
side's own width, one descriptor per token row, as `send_kvcache_slice` does for the target. The
target entries keep their own path (`send_kvcache`, `send_kvcache_slice`) and that path no longer
sees the draft entries. Under DFLASH a plain-MHA pool publishes layer ids
(`build_kv_layer_ids(pair_mha_by_layer_id=)`), so a PP stage's entries, and the target entries
at another TP, pair with the decode's by id, not by a position the draft band shifts.

At registration the prefill checks the decode's draft entries against the layout it will write
(`_draft_kv_layout_mismatch`): their item lengths must hold the decode's share of the draft
heads. A decode that does not fit is refused before any byte is written, with a message naming
the setting, as stock refuses a mismatched state layout. Layouts this path cannot serve are
refused the same way: a DFLASH draft pool that is not a plain NHD MHA pool, or a pure-MLA
target (whose send path subtracts the draft band itself), at another TP; the staging buffer
(`SGLANG_DISAGG_STAGING_BUFFER`). A PP prefill whose layer ids only one peer publishes (say a
prefill without DFLASH into a DFLASH decode) is refused at registration too: it used to fail at
its first transfer and stop the transfer thread. A decode reached through DCP relayout keeps
`send_kvcache_dcp`'s own draft slicing.

Equal attention TP and other algorithms are unchanged on Mooncake. On other backends the only
change is that a DFLASH plain-MHA pool now publishes layer ids; both peers of a DFLASH
deployment do, so they pair by id where they paired by position.

Tests: `test/registered/unit/disaggregation/test_mooncake_draft_kv_heads.py`: over TP pairs
1->2, 2->1, 2->8, 4->32, 8->2 (and replicated heads), the bytes the descriptors move give every
decode rank exactly the heads its own draft would hold, once; registrations of a wrong layout are
refused; equal TP sends nothing here. End to end, real CPU servers over Mooncake TCP (a PP2
prefill into a TP2 decode, a TP2 x PP2 prefill into a TP1 decode) give the decode the draft KV
bytes a same-TP deployment gives it.
""",
    edits=[
        AddClassAttribute(
            "srt/disaggregation/base/conn.py",
            "KVArgs",
            code="""
            # The DFLASH draft's KV heads in all, which it shards over attention TP on
            # its own; 0 when no DFLASH draft KV is appended.
            draft_total_kv_head_num: int = 0
            """,
        ),
        InsertStatements(
            "srt/disaggregation/prefill.py",
            "PrefillBootstrapQueue._init_kv_manager",
            after=Stmt("num_draft_entries = len(draft_kv_data_ptrs)"),
            code="""
            if (
                self.scheduler.spec_algorithm.is_dflash()
                and type(draft_kv_pool) is MHATokenToKVPool
                and draft_kv_pool.kv_cache_layout == "nhd"
            ):
                # The draft shards its own KV heads over attention TP, token rows of
                # [heads, head_dim] that a decode of another TP takes slices of.
                spec_aux_config = self.scheduler.tp_worker.model_runner.spec_aux_config
                kv_args.draft_total_kv_head_num = (
                    spec_aux_config.draft_model_config.get_total_num_kv_heads()
                )
            """,
        ),
        AddImport(
            "srt/disaggregation/prefill.py",
            module="sglang.srt.mem_cache.memory_pool",
            names=("MHATokenToKVPool",),
        ),
        AddParameter(
            "srt/disaggregation/utils.py",
            "build_kv_layer_ids",
            name="pair_mha_by_layer_id",
            default="False",
            annotation="bool",
        ),
        ReplaceStatement(
            "srt/disaggregation/utils.py",
            "build_kv_layer_ids",
            statement="from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool",
            code="""
            from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, MHATokenToKVPool
            """,
        ),
        InsertStatements(
            "srt/disaggregation/utils.py",
            "build_kv_layer_ids",
            before=IfTest(
                "not isinstance(token_to_kv_pool, (HybridLinearKVPool, MiniMaxM3Nvfp4KVPool))"
            ),
            code="""
            # A plain MHA pool lists K then V of its own layers: a PP stage's entries
            # pair with a decode's by id, not by a position a draft band shifts.
            pairs_mha = pair_mha_by_layer_id and type(token_to_kv_pool) is MHATokenToKVPool
            """,
        ),
        ReplaceExpression(
            "srt/disaggregation/utils.py",
            "build_kv_layer_ids",
            old=(
                "not isinstance(token_to_kv_pool, "
                "(HybridLinearKVPool, MiniMaxM3Nvfp4KVPool))"
            ),
            new=(
                "not pairs_mha and not isinstance("
                "token_to_kv_pool, (HybridLinearKVPool, MiniMaxM3Nvfp4KVPool))"
            ),
        ),
        ReplaceExpression(
            "srt/disaggregation/utils.py",
            "build_kv_layer_ids",
            old="token_to_kv_pool.get_kv_layer_ids()",
            new=(
                "list(token_to_kv_pool.model_layer_ids) * 2 if pairs_mha "
                "else token_to_kv_pool.get_kv_layer_ids()"
            ),
        ),
        AddKeywordArgument(
            "srt/disaggregation/prefill.py",
            "PrefillBootstrapQueue._init_kv_manager",
            call="build_kv_layer_ids",
            keyword="pair_mha_by_layer_id",
            value="self.scheduler.spec_algorithm.is_dflash()",
        ),
        AddKeywordArgument(
            "srt/disaggregation/decode.py",
            "DecodePreallocQueue._init_kv_manager",
            call="build_kv_layer_ids",
            keyword="pair_mha_by_layer_id",
            value="self.scheduler.spec_algorithm.is_dflash()",
        ),
        InsertStatements(
            "srt/disaggregation/mooncake/conn.py",
            "MooncakeKVManager._validate_peer_state_layout",
            before=Stmt('state_types = getattr(self.kv_args, "state_types", [])'),
            code="""
            mismatch = self._draft_kv_layout_mismatch(registration_info)
            if mismatch is not None:
                return False, mismatch
            """,
        ),
        InsertStatements(
            "srt/disaggregation/mooncake/conn.py",
            "MooncakeKVManager.send_kvcache",
            at="start",
            code="""
            # A DFLASH draft at another attention TP goes head by head.
            num_entries = len(self.kv_args.kv_data_ptrs)
            if self._sends_draft_kv_heads(dst_attn_tp_size):
                num_entries -= self.kv_args.num_draft_entries
            """,
        ),
        ReplaceKeywordArgument(
            "srt/disaggregation/mooncake/conn.py",
            "MooncakeKVManager.send_kvcache",
            call="self._send_kvcache_generic",
            keyword="src_data_ptrs",
            old="self.kv_args.kv_data_ptrs",
            value="self.kv_args.kv_data_ptrs[:num_entries]",
        ),
        ReplaceKeywordArgument(
            "srt/disaggregation/mooncake/conn.py",
            "MooncakeKVManager.send_kvcache",
            call="self._send_kvcache_generic",
            keyword="item_lens",
            old="self.kv_args.kv_item_lens",
            value="self.kv_args.kv_item_lens[:num_entries]",
        ),
        ReplaceKeywordArgument(
            "srt/disaggregation/mooncake/conn.py",
            "MooncakeKVManager.send_kvcache",
            call="self._send_kvcache_generic",
            keyword="src_layer_ids",
            old="self.kv_args.kv_layer_ids",
            value="self.kv_args.kv_layer_ids[:num_entries]",
        ),
        InsertStatements(
            "srt/disaggregation/mooncake/conn.py",
            "MooncakeKVManager.send_kvcache_slice",
            before=Stmt("src_kv_item_len = self.kv_args.kv_item_lens[0]"),
            code="""
            # A DFLASH draft has its own head count: it goes head by head.
            num_entries = len(self.kv_args.kv_data_ptrs)
            if self._sends_draft_kv_heads(dst_attn_tp_size):
                num_entries -= self.kv_args.num_draft_entries
            """,
        ),
        ReplaceStatement(
            "srt/disaggregation/mooncake/conn.py",
            "MooncakeKVManager.send_kvcache_slice",
            statement="src_data_ptrs = self.kv_args.kv_data_ptrs",
            code="src_data_ptrs = self.kv_args.kv_data_ptrs[:num_entries]",
        ),
        ReplaceStatement(
            "srt/disaggregation/mooncake/conn.py",
            "MooncakeKVManager.send_kvcache_slice",
            statement="src_layer_ids = self.kv_args.kv_layer_ids",
            code="src_layer_ids = self.kv_args.kv_layer_ids[:num_entries]",
        ),
        ReplaceExpression(
            "srt/disaggregation/mooncake/conn.py",
            "MooncakeKVManager.send_kvcache_slice",
            old="any(item_len != src_kv_item_len for item_len in self.kv_args.kv_item_lens)",
            new=(
                "any(item_len != src_kv_item_len "
                "for item_len in self.kv_args.kv_item_lens[:num_entries])"
            ),
        ),
        InsertStatements(
            "srt/disaggregation/mooncake/conn.py",
            "MooncakeKVManager.transfer_worker",
            after=IfTest(
                "len(kv_chunk.prefill_kv_indices) == 0 "
                "or not self.kv_args.kv_data_ptrs or skip_kv"
            ),
            code="""
            if (
                ret == 0
                and len(kv_chunk.prefill_kv_indices) > 0
                and not is_dcp_transfer
                and self._sends_draft_kv_heads(
                    target_rank_registration_info.dst_attn_tp_size
                )
            ):
                ret = self.send_draft_kvcache_heads(
                    req.mooncake_session_id,
                    kv_chunk.prefill_kv_indices,
                    target_rank_registration_info,
                    (
                        chunked_dst_kv_indice
                        if chunked_dst_device_kv_indice is None
                        else chunked_dst_device_kv_indice
                    ),
                    executor,
                )
            """,
        ),
        AddMethod(
            "srt/disaggregation/mooncake/conn.py",
            "MooncakeKVManager",
            after="send_kvcache_slice",
            code='''
            def _sends_draft_kv_heads(self, dst_attn_tp_size: Optional[int]) -> bool:
                """Whether the DFLASH draft entries go head by head to a decode rank: at
                another attention TP it holds other draft heads per token row."""
                return (
                    self.kv_args.draft_total_kv_head_num > 0
                    and not self.is_mla_backend
                    and dst_attn_tp_size is not None
                    and dst_attn_tp_size != self.attn_tp_size
                )

            def _draft_kv_layout_mismatch(
                self, registration_info: KVArgsRegisterInfo
            ) -> Optional[str]:
                """Why a decode cannot take this rank's DFLASH draft KV, or None."""
                if self.pp_size > 1 and bool(self.kv_args.kv_layer_ids) != bool(
                    registration_info.dst_kv_layer_ids
                ):
                    # A PP stage's entries pair with the decode's only by layer id.
                    return (
                        "only one of prefill and decode publishes KV layer ids; run both "
                        "with the same model, draft and --speculative-algorithm"
                    )
                dst_tp = registration_info.dst_attn_tp_size
                if (
                    not self.kv_args.num_draft_entries
                    or get_spec().speculative_algorithm != "DFLASH"
                    or dst_tp == self.attn_tp_size
                    or registration_info.requires_dcp_relayout  # send_kvcache_dcp's own
                ):
                    return None
                where = (
                    f"DFLASH draft KV from prefill attention TP {self.attn_tp_size} to "
                    f"decode attention TP {dst_tp}"
                )
                if not self.kv_args.draft_total_kv_head_num or self.is_mla_backend:
                    return f"{where}: the draft KV can only be sent at equal attention TP"
                if self.enable_staging:
                    return f"{where}: unset SGLANG_DISAGG_STAGING_BUFFER"
                if max(dst_tp, self.attn_tp_size) % min(dst_tp, self.attn_tp_size):
                    return f"{where}: one TP size must divide the other"
                total = self.kv_args.draft_total_kv_head_num
                src_heads = max(1, total // self.attn_tp_size)
                dst_heads = max(1, total // dst_tp)
                n = self.kv_args.num_draft_entries
                expected = [
                    item_len // src_heads * dst_heads
                    for item_len in self.kv_args.kv_item_lens[-n:]
                ]
                registered = registration_info.dst_kv_item_lens[-n:]
                if registered != expected:
                    return (
                        f"{where}: decode rank {registration_info.dst_tp_rank} registered "
                        f"draft entries of {registered} bytes per page, but {dst_heads} of "
                        f"the draft's {total} KV heads take {expected}; serve the same "
                        "draft with the same --page-size and --kv-cache-dtype on both"
                    )
                return None

            def send_draft_kvcache_heads(
                self,
                mooncake_session_id: str,
                prefill_kv_indices: npt.NDArray[np.int32],
                registration_info: KVArgsRegisterInfo,
                dst_kv_indices: npt.NDArray[np.int32],
                executor: concurrent.futures.ThreadPoolExecutor,
            ) -> int:
                """Send the DFLASH draft entries to a decode rank of another attention TP:
                the draft heads both ranks hold, between token rows of each side's own
                width."""
                from sglang.srt.disaggregation.common.staging_buffer import (
                    compute_head_slice_params,
                )

                dst_tp = registration_info.dst_attn_tp_size
                total = self.kv_args.draft_total_kv_head_num
                src_heads = max(1, total // self.attn_tp_size)
                dst_heads = max(1, total // dst_tp)
                src_head, num_heads, dst_head, _ = compute_head_slice_params(
                    self.attn_tp_size,
                    dst_tp,
                    self.kv_args.engine_rank,
                    registration_info.dst_tp_rank,
                    total,
                )
                page_size = self.kv_args.page_size
                in_page = np.arange(page_size, dtype=np.int64)
                src_rows = prefill_kv_indices.astype(np.int64)[:, None] * page_size + in_page
                dst_rows = dst_kv_indices.astype(np.int64)[:, None] * page_size + in_page
                n = self.kv_args.num_draft_entries

                # One descriptor per token row and entry.
                def send_entry(src_ptr: int, dst_ptr: int, item_len: int) -> int:
                    head_bytes = item_len // page_size // src_heads
                    src = src_ptr + (src_rows * src_heads + src_head) * head_bytes
                    dst = dst_ptr + (dst_rows * dst_heads + dst_head) * head_bytes
                    src_addrs = src.reshape(-1).tolist()
                    return self.engine.batch_transfer_sync(
                        mooncake_session_id,
                        src_addrs,
                        dst.reshape(-1).tolist(),
                        [num_heads * head_bytes] * len(src_addrs),
                    )

                futures = [
                    executor.submit(send_entry, src_ptr, dst_ptr, item_len)
                    for src_ptr, dst_ptr, item_len in zip(
                        self.kv_args.kv_data_ptrs[-n:],
                        registration_info.dst_kv_ptrs[-n:],
                        self.kv_args.kv_item_lens[-n:],
                    )
                ]
                return self._await_transfer_futures(futures)
            ''',
        ),
    ],
    files=["test/registered/unit/disaggregation/test_mooncake_draft_kv_heads.py"],
)
