from sglang_dflash_pp.patch_series.cst_anchors import IfTest, Stmt
from sglang_dflash_pp.patch_series.cst_declaration_edits import AddImport, AddMethod, AddParameter
from sglang_dflash_pp.patch_series.cst_edits import (
    AddKeywordArgument,
    InsertStatements,
    ReplaceStatement,
)

PREFILL = "srt/disaggregation/prefill.py"
DECODE = "srt/disaggregation/decode.py"
COMMON = "srt/disaggregation/common/conn.py"
MOONCAKE = "srt/disaggregation/mooncake/conn.py"
METRICS = "srt/observability/metrics_collector.py"
CHECKSUM = "sglang.srt.disaggregation.kv_placement_checksum"

PR = dict(
    title="[PD] KV checksum across TP widths, PP stages and head slices",
    description="""\
Motivation. `--disaggregation-enable-kv-checksum` digests each rank's KV buffers in
registration order, so a decode compares only with a prefill of its own layout: one of
another attention TP, a PP stage or a sliced draft is admitted unverified. Those are the
layouts where KV lands in the wrong place: a source entry paired with the wrong decode
layer, a head sent to the wrong decode rank, a page at the wrong slot. None of them fails
a request, and a wrong draft KV or recurrent state only lowers acceptance.

Change. Each side also sums its own pools, read through the pool objects and the
request's page table (not through transfer descriptors), into one sum per (component,
layer, K/V part, global head): target KV, draft KV, and the recurrent state of a hybrid
model (per state tensor and TP-sharded channel, from the request's state slot). Every
32-bit word is hashed with its position in the request and its place in the head, and
the hashes are added modulo 2**32 (`keyed_head_sums`: one Triton launch for the KV, one
for the state; a torch reference on other devices), so a head's sum does not depend on
which rank, buffer or slot holds it. A prefill rank sums the request at its last chunk,
after `kv_written_event` (its latest PP forward), and sends its sums with the transfer's
Success status to each decode rank it wrote to (a frame after the reason). A decode whose
layout differs from the prefill's compares each head it holds with what the prefill rank
holding it reported, before the request's first batch. On a difference the request fails
(as a mismatch of the existing digest does, the TP ranks agreeing first) with the
component, layer, part, heads and the prefill ranks that wrote them; the server keeps
serving. Equal layouts keep the existing digest. `MambaPool` exposes its transfer state
entries as its slot siblings do. `sglang:kv_checksum_reqs_total{outcome=verified|failed|
unverified}` counts the decode's requests once each.

Cost, Kimi-K3 geometry (P = TP4 x PP8, D = TP32), one 8192-token chunk, H200: a
last-stage prefill rank sums 79 MB in 73 us on the GPU, 96 us of host time with the
copy of the sums, 1.1% of the 8.6 ms its 428 MB take at 50 GB/s; a decode rank sums
252 MB in 126 us (148 us host), 2.9% of its 5.0 ms. The kernel adds into outputs made
at startup and is compiled there (for a token count of 1, a multiple of 16 and other):
requests of 1 to 8192 tokens from any position then compile nothing, and their KV sums
allocate no device memory (a hybrid model's state is copied per request).

Tests: `test/registered/unit/disaggregation/test_kv_placement_checksum.py`: every prefill
layout against every decode layout (attention TP 1..64 each side, 1..16 KV heads, PP2)
compares equal, and each misplacement (wrong layer, head, page, a page shifted by one
token, K and V swapped, one flipped byte) is named with its component, layer, part and
head; an MLA latent in a hybrid pool; a hybrid model's conv and temporal state at TP2 x
PP2 against TP1, a flipped byte and another request's slot; the Triton kernel equals the
reference (Triton interpreter).
""",
    edits=[
        # -- prefill: sum at the last chunk, hand the sums to the transfer ---------------
        AddImport(
            PREFILL,
            module=CHECKSUM,
            names=("encode_sums", "kv_placement_checksum_for"),
        ),
        AddImport(
            PREFILL,
            module="sglang.srt.disaggregation.utils",
            names=("_is_fake_transfer",),
        ),
        InsertStatements(
            PREFILL,
            "PrefillBootstrapQueue.__init__",
            after=Stmt("self.kv_checksum_signature = 0"),
            code="""
            # What this rank sums of a request: its target KV, the DFLASH draft KV
            # when it sends it, and the recurrent state of a hybrid target.
            self.kv_placement_checksum = None
            if get_disagg().disaggregation_enable_kv_checksum:
                has_draft = self.kv_manager.kv_args.num_draft_entries > 0
                spec_aux_config = self.scheduler.tp_worker.model_runner.spec_aux_config
                self.kv_placement_checksum = kv_placement_checksum_for(
                    self.token_to_kv_pool,
                    self.draft_token_to_kv_pool if has_draft else None,
                    self.scheduler.model_config,
                    spec_aux_config.draft_model_config,
                    get_parallel().attn_tp_rank,
                    get_parallel().attn_tp_size,
                )
            """,
        ),
        AddMethod(
            PREFILL,
            "PrefillBootstrapQueue",
            after="_init_kv_manager",
            code='''
            def record_kv_placement_sums(
                self,
                req: Req,
                start_idx: int,
                end_idx: int,
                state_indices: Optional[torch.Tensor],
            ) -> None:
                """Sum this rank's KV of the request for its transfer's Success status,
                which carries the sums to every decode rank this rank writes to."""
                if self.kv_placement_checksum is None or _is_fake_transfer(req):
                    return
                event = req.disagg_kv_sender.kv_written_event
                if event is not None:
                    # Read the pool after kv_written_event, the request's last PP forward.
                    self.scheduler.device_module.current_stream().wait_event(event)
                locs = self.scheduler.req_to_token_pool.req_to_token[
                    req.kv.req_pool_idx, start_idx:end_idx
                ]
                sums = self.kv_placement_checksum.compute(locs, start_idx, state_indices)
                self.kv_manager.kv_checksum_sums[req.bootstrap_room] = encode_sums(sums)
            ''',
        ),
        InsertStatements(
            PREFILL,
            "SchedulerDisaggregationPrefillMixin.send_kv_chunk",
            after=Stmt("digest = computer.compute(page_indices_gpu, state_indices)"),
            code="""
            self.disagg_prefill_bootstrap_queue.record_kv_placement_sums(
                req, start_idx, end_idx, state_indices
            )
            """,
        ),
        # -- the sums travel with the Success status -------------------------------------
        InsertStatements(
            COMMON,
            "CommonKVManager.__init__",
            after=Stmt("self.req_to_decode_prefix_len: Dict[int, int] = {}"),
            code="""
            # Placement-keyed KV checksum sums of a room, sent with its Success status.
            self.kv_checksum_sums: Dict[int, bytes] = {}
            """,
        ),
        InsertStatements(
            COMMON,
            "CommonKVManager.__init__",
            after=Stmt("self.prefill_response_tracker: Dict[int, Set[int]] = {}"),
            code="""
            # room -> prefill rank -> the KV checksum sums it sent with Success.
            self.kv_checksum_reports: Dict[int, Dict[int, bytes]] = {}
            """,
        ),
        AddParameter(
            COMMON,
            "CommonKVManager._encode_kv_status_message",
            name="kv_checksum_sums",
            annotation="Optional[bytes]",
            default="None",
        ),
        InsertStatements(
            COMMON,
            "CommonKVManager._encode_kv_status_message",
            before=Stmt("return parts"),
            code="""
            if kv_checksum_sums is not None:
                if not self.kv_status_msg_carries_reason:
                    parts.append(b"")
                parts.append(kv_checksum_sums)
            """,
        ),
        AddParameter(
            COMMON,
            "CommonKVManager.send_kv_status_message",
            name="kv_checksum_sums",
            annotation="Optional[bytes]",
            default="None",
        ),
        AddKeywordArgument(
            COMMON,
            "CommonKVManager.send_kv_status_message",
            call="self._encode_kv_status_message",
            keyword="kv_checksum_sums",
            value="kv_checksum_sums",
        ),
        InsertStatements(
            COMMON,
            "CommonKVManager.conclude_transfer",
            before=Stmt("self.update_status(bootstrap_room, status)"),
            code="""
            kv_checksum_sums = self.kv_checksum_sums.pop(bootstrap_room, None)
            """,
        ),
        AddKeywordArgument(
            COMMON,
            "CommonKVManager.conclude_transfer",
            call="self.send_kv_status_message",
            keyword="kv_checksum_sums",
            value="kv_checksum_sums if status == KVPoll.Success else None",
        ),
        AddMethod(
            COMMON,
            "CommonKVManager",
            after="parse_kv_status_message",
            code='''
            def parse_kv_checksum_sums(self, msg: List[bytes]) -> Optional[bytes]:
                """The KV checksum sums a prefill status message carries, if any."""
                if self.kv_status_msg_tag is not None:
                    msg = msg[1:]
                return msg[4] if len(msg) > 4 and msg[4] else None
            ''',
        ),
        AddParameter(
            COMMON,
            "CommonKVManager.apply_prefill_status",
            name="kv_checksum_sums",
            annotation="Optional[bytes]",
            default="None",
        ),
        InsertStatements(
            COMMON,
            "CommonKVManager.apply_prefill_status",
            after=Stmt("completed_ranks.add(prefill_rank)"),
            code="""
            if kv_checksum_sums is not None:
                reports = self.kv_checksum_reports.setdefault(bootstrap_room, {})
                reports[prefill_rank] = kv_checksum_sums
            """,
        ),
        InsertStatements(
            COMMON,
            "CommonKVReceiver._clear",
            after=Stmt(
                "self.kv_mgr.prefill_response_tracker.pop(self.bootstrap_room, None)"
            ),
            code="""
            self.kv_mgr.kv_checksum_reports.pop(self.bootstrap_room, None)
            """,
        ),
        AddKeywordArgument(
            MOONCAKE,
            "MooncakeKVManager.start_decode_thread",
            call="self.apply_prefill_status",
            keyword="kv_checksum_sums",
            value="self.parse_kv_checksum_sums(msg)",
        ),
        # -- decode: compare the heads it holds ------------------------------------------
        AddImport(
            DECODE,
            module=CHECKSUM,
            names=("find_mismatches", "kv_placement_checksum_for"),
        ),
        InsertStatements(
            DECODE,
            "DecodePreallocQueue.__init__",
            after=Stmt("self.kv_checksum_signature = 0"),
            code="""
            self.kv_placement_checksum = None
            if enable_kv_checksum:
                spec_aux_config = self.scheduler.tp_worker.model_runner.spec_aux_config
                self.kv_placement_checksum = kv_placement_checksum_for(
                    self.token_to_kv_pool,
                    self.draft_token_to_kv_pool,
                    self.scheduler.model_config,
                    spec_aux_config.draft_model_config,
                    get_parallel().attn_tp_rank,
                    get_parallel().attn_tp_size,
                )
            """,
        ),
        ReplaceStatement(
            DECODE,
            "DecodeTransferQueue._commit_transfer_to_req",
            statement=(
                "decode_req.req.expected_kv_checksum = "
                "(digest if self._kv_checksum_comparable(signature) else 0)"
            ),
            code="""
            prealloc_queue = self.scheduler.disagg_decode_prealloc_queue
            reports = prealloc_queue.kv_manager.kv_checksum_reports.pop(
                decode_req.req.bootstrap_room, None
            )
            if (
                signature != prealloc_queue.kv_checksum_signature
                and reports
                and prealloc_queue.kv_placement_checksum is not None
            ):
                # Another layout: compare the sums of the heads this rank holds.
                decode_req.req.kv_checksum_reports = reports
            else:
                comparable = self._kv_checksum_comparable(signature)
                decode_req.req.expected_kv_checksum = digest if comparable else 0
                if not comparable and not (
                    is_health_check_req(decode_req.req)
                    or _is_fake_transfer(decode_req.req)
                ):
                    self.scheduler.count_kv_checksum("unverified")
            """,
        ),
        InsertStatements(
            DECODE,
            "SchedulerDisaggregationDecodeMixin._verify_kv_checksums",
            after=Stmt("messages: Dict[int, str] = {}"),
            code="""
            checked: List[int] = []
            """,
        ),
        InsertStatements(
            DECODE,
            "SchedulerDisaggregationDecodeMixin._verify_kv_checksums",
            after=Stmt("expected = req.expected_kv_checksum"),
            code="""
            if req.kv_checksum_reports is not None:
                reports, req.kv_checksum_reports = req.kv_checksum_reports, None
                checked.append(i)
                mismatch = self._verify_kv_placement(req, reports)
                if mismatch is not None:
                    mismatched[i] = 1
                    messages[i] = mismatch
                continue
            """,
        ),
        InsertStatements(
            DECODE,
            "SchedulerDisaggregationDecodeMixin._verify_kv_checksums",
            before=IfTest("actual != expected"),
            code="""
            checked.append(i)
            """,
        ),
        InsertStatements(
            DECODE,
            "SchedulerDisaggregationDecodeMixin._verify_kv_checksums",
            after=Stmt(
                "mismatched = all_reduce_flags("
                "mismatched, self.attn_tp_cpu_group, dist.ReduceOp.MAX)"
            ),
            code="""
            for i in checked:
                self.count_kv_checksum("failed" if mismatched[i] else "verified")
            """,
        ),
        AddMethod(
            DECODE,
            "SchedulerDisaggregationDecodeMixin",
            after="_verify_kv_checksums",
            code='''
            def _verify_kv_placement(self, req: Req, reports) -> Optional[str]:
                """Compare this rank's sums of the heads it holds with those the prefill
                ranks reported; what differs, or None."""
                checksum = self.disagg_decode_prealloc_queue.kv_placement_checksum
                start_idx, seq_len = req.kv.cache_protected_len, len(req.origin_input_ids)
                locs = self.req_to_token_pool.req_to_token[
                    req.kv.req_pool_idx, start_idx:seq_len
                ]
                state = state_indices_for_request(self, req, seq_len, start_idx=start_idx)
                sums = checksum.compute(locs, start_idx, state)
                mismatch = find_mismatches(sums, reports)
                if mismatch is None:
                    return None
                return (
                    f"KV checksum mismatch req={req.rid} "
                    f"bootstrap_room={req.bootstrap_room}: {mismatch}"
                )

            def count_kv_checksum(self, outcome: str) -> None:
                """Once per request: on the rank that logs the scheduler's stats."""
                reporter = self.metrics_reporter
                if reporter.enable_metrics and reporter.is_stats_logging_rank:
                    self.metrics_collector.increment_kv_checksum_reqs(outcome)
            ''',
        ),
        AddMethod(
            "srt/mem_cache/memory_pool.py",
            "MambaPool",
            after="_iter_transfer_state_entries",
            code='''
            def iter_transfer_state_entries(self):
                """The state entries PD transfers, as the slot siblings yield theirs."""
                return self._iter_transfer_state_entries()
            ''',
        ),
        InsertStatements(
            "srt/managers/schedule_batch.py",
            "Req.__init__",
            after=Stmt("self.expected_kv_checksum: int = 0"),
            code="""
            # What the prefill ranks reported of a transfer from another layout.
            self.kv_checksum_reports: Optional[Dict[int, bytes]] = None
            """,
        ),
        InsertStatements(
            METRICS,
            "SchedulerMetricsCollector.__init__",
            before=Stmt(
                "self.num_prefill_retries_total = Counter("
                'name="sglang:num_prefill_retries_total", '
                'documentation="Total number of prefill retries.", '
                "labelnames=labels.keys(),)"
            ),
            code="""
            self.num_kv_checksum_reqs = Counter(
                name="sglang:kv_checksum_reqs_total",
                documentation=(
                    "Requests whose received KV the checksum verified, found "
                    "different (failed), or could not compare (unverified)."
                ),
                labelnames=[*labels.keys(), "outcome"],
            )
            """,
        ),
        AddMethod(
            METRICS,
            "SchedulerMetricsCollector",
            after="increment_transfer_failed_reqs",
            code="""
            def increment_kv_checksum_reqs(self, outcome: str) -> None:
                self.num_kv_checksum_reqs.labels(**self.labels, outcome=outcome).inc(1)
            """,
        ),
    ],
    files=[
        "python/sglang/kernels/ops/memory/keyed_head_hash.py",
        "python/sglang/srt/disaggregation/kv_placement_checksum.py",
        "test/registered/unit/disaggregation/test_kv_placement_checksum.py",
    ],
)
