"""The PR registry: for every PR of ``docs/upstream/README.md``, its in-tree edits, or why it
has none yet.

Only our code is written here: what each edit inserts, and the anchors it hooks onto (a symbol
and, inside it, one expression, statement or ``if`` test of the upstream code, matched by AST).
Titles and descriptions come from the stack document at run time. A PR with ``unfinished`` set
stops the export before it: the series then holds the finished prefix.
"""

from __future__ import annotations

from typing import Dict

from sglang_dflash_pp.tools.export_patches.cst_edits import (
    AddImport,
    AddKeywordArgument,
    GuardStatement,
    IfTest,
    InsertStatements,
    ReplaceExpression,
    Stmt,
    WidenCondition,
)
from sglang_dflash_pp.tools.export_patches.new_modules import NewModule
from sglang_dflash_pp.tools.export_patches.new_tests import NewTest
from sglang_dflash_pp.tools.export_patches import stack_digest, stack_mooncake, stack_pp
from sglang_dflash_pp.tools.export_patches.pr import PR


# -- PR 1 ------------------------------------------------------------------------------------

PR_1 = PR(
    "1",
    edits=(
        ReplaceExpression(
            "srt/model_executor/model_runner.py",
            "ModelRunner._extend_forward_kwargs",
            old="forward_batch.input_embeds.bfloat16()",
            new="forward_batch.input_embeds.to(self.dtype)",
        ),
    ),
    note=(
        "The embeddings are converted to the runner's model dtype (ModelRunner.dtype, the "
        "--dtype the model was loaded in), as the replace_embeds branch below already does for "
        "the embeddings it scatters. For a bf16 model nothing changes."
    ),
    bug="fp32-input-embeds-cast",
)

# -- PR 2 ------------------------------------------------------------------------------------

PR_2 = PR(
    "2",
    edits=(
        AddKeywordArgument(
            "srt/managers/scheduler_pp_mixin.py",
            "SchedulerPPMixin._pp_make_skip_output_result",
            call="GenerationBatchResult",
            keyword="next_draft_input",
            value="batch.spec_info",
            comment="A speculative batch keeps the draft input its forward bound.",
        ),
    ),
    note=(
        "Of the two fixes the bug report offers, this commit takes the one that keeps the "
        "optimisation: the result synthesised for a skipped middle chunk carries the batch's "
        "own draft input, so the PD prefill's `batch.spec_info is result.next_draft_input` "
        "holds as it does on the relayed path. A middle chunk's draft input is read by nothing "
        "else before the next chunk replaces it. Non-speculative batches carry None, as before."
    ),
    bug="pp-skip-output-comm-speculative",
)

# -- PR 3b -----------------------------------------------------------------------------------

KV_WRITE_FENCE_DOC = """\
The fence between a PP prefill stage's forward and the KV transfer that reads what it wrote.

A PD prefill with ``--pp-size > 1`` sends a middle chunk's KV from ``process_prefill_chunk``
right after that chunk's forward was launched on the forward stream, and the transfer worker
synchronises only the chunk's ``indices_event`` (schedule stream) before it reads the pages.
Only incidental waits of the PP communication order that read after the forward's write;
``--pp-async-batch-depth >= 1`` (last stage) and ``SGLANG_PP_COMM_OVERLAP=1`` (every stage)
remove them, and the decode then receives stale KV without an error.

``_pp_launch_batch`` records an event after each forward on the stream the forward ran on and
attaches it to the KV sender of every request of the batch (:func:`record_kv_written`);
``send_kv_chunk`` hands it to each later chunk of the request as its ``wait_event``
(:func:`chunk_wait_event`, together with the early-send event when there is one), which the
transfer worker synchronises before it reads a byte. Forwards run in order on one stream, so
the latest event covers every earlier chunk of the request. A readout on a side stream (a
pack of the KV before it is sent) waits on the same events (:func:`cuda_event_of`).

Inert on a device without streams (a CPU forward is synchronous). Torch only at import."""

KV_WRITE_FENCE_TEST_DOC = """\
The fence between a PP stage's forward and the transfer that reads its KV
(``disaggregation/kv_write_fence.py``): where no stream exists nothing is recorded, and on CUDA
one event, recorded on the forward's stream, is attached to every request's KV sender. A CUDA
event cannot exist on a CPU: the event and the stream are stand-ins."""

PR_3B = PR(
    "3b",
    new_modules=(
        NewModule(
            "sglang_dflash_pp.srt.disaggregation.kv_write_fence",
            drop=("send_around", "HOOKS"),
            docstring=KV_WRITE_FENCE_DOC,
            values=(("WRITTEN_ATTR", '"_kv_written_event"'),),
        ),
    ),
    edits=(
        AddImport(
            "srt/managers/scheduler_pp_mixin.py",
            module="sglang.srt.disaggregation.utils",
            names=("DisaggregationMode",),
        ),
        AddImport(
            "srt/managers/scheduler_pp_mixin.py",
            module="sglang.srt.disaggregation.kv_write_fence",
            names=("record_kv_written",),
        ),
        InsertStatements(
            "srt/managers/scheduler_pp_mixin.py",
            "SchedulerPPMixin._pp_launch_batch",
            after=Stmt("event.record(self.device_module.current_stream())"),
            code="""
            if self.disaggregation_mode == DisaggregationMode.PREFILL:  # a PD prefill
                # The KV transfer of these requests' chunks waits on this forward.
                record_kv_written(cur_batch.reqs, self.device)
            """,
        ),
        AddImport(
            "srt/disaggregation/prefill.py",
            module="sglang.srt.disaggregation.kv_write_fence",
            names=("WRITTEN_ATTR", "chunk_wait_event"),
        ),
        InsertStatements(
            "srt/disaggregation/prefill.py",
            "SchedulerDisaggregationPrefillMixin._send_kv_chunk",
            after=Stmt("sender = req.disagg_kv_sender"),
            code="""
            written = getattr(sender, WRITTEN_ATTR, None)
            if written is not None:
                # Under PP the forward that wrote this chunk's KV may still be running.
                sender._early_send_wait_event = chunk_wait_event(
                    getattr(sender, "_early_send_wait_event", None), written
                )
            """,
        ),
    ),
    tests=(
        # its sends through the real sender and transfer worker need the plugin's hooks and
        # harness (and PR 6's packs): they stay in this repository
        NewTest(
            "test/srt/test_kv_write_fence.py",
            "test/registered/unit/disaggregation/test_kv_write_fence.py",
            est_time=5,
            drop=(
                "Event", "sender_shell",
                "test_every_send_of_a_request_carries_its_latest_kv_written_event",
                "test_stock_early_send_event_is_kept_and_both_are_waited_on",
                "test_the_transfer_worker_waits_before_the_first_send_and_the_pack_sees_the_event",
            ),
            docstring=KV_WRITE_FENCE_TEST_DOC,
        ),
    ),
    note=(
        "The first fix the bug report suggests: the forward's completion event, recorded in "
        "_pp_launch_batch on the forward stream, is every later chunk's wait_event. The "
        "scheduler thread never waits on it; the transfer thread already synchronises "
        "wait_event before it reads (mooncake/conn.py transfer_worker), so it waits for what it "
        "must read. Without PP, or on a device without streams, nothing is recorded."
    ),
)


# -- PR 3 ------------------------------------------------------------------------------------

CPU_DRAFT_BACKENDS = '("torch_native", "triton")'

PR_3 = PR(
    "3",
    edits=(
        # 1. the platform check, and the draft attention backend it resolves next
        WidenCondition(
            "srt/arg_groups/speculative_hook.py",
            "_handle_dflash",
            condition='cfg.device.startswith("cuda") or cfg.device == "npu" or cfg.device == "xpu"',
            extra='cfg.device == "cpu"',
        ),
        InsertStatements(
            "srt/arg_groups/speculative_hook.py",
            "_resolve_dflash_draft_attention_backend.is_supported_backend",
            at="start",
            code=f"""
            if cfg.device == "cpu" and not current_platform.is_out_of_tree():
                return backend in {CPU_DRAFT_BACKENDS}
            """,
        ),
        InsertStatements(
            "srt/arg_groups/speculative_hook.py",
            "_resolve_dflash_draft_attention_backend.get_fallback_backend",
            at="start",
            code="""
            if cfg.device == "cpu" and not current_platform.is_out_of_tree():
                return "torch_native"
            """,
        ),
        # 2. the draft worker keeps the CPU backend resolution chose
        AddImport(
            "srt/speculative/draft_worker_common.py",
            module="sglang.srt.runtime_context",
            names=("get_device",),
        ),
        InsertStatements(
            "srt/speculative/draft_worker_common.py",
            "resolve_draft_worker_attention_backend",
            before=IfTest("draft_backend not in DRAFT_ATTENTION_BACKEND_CHOICES"),
            code="""
            if get_device().device == "cpu" and draft_backend == "torch_native":
                return draft_backend  # the CPU backend the target runs too
            """,
        ),
        # 3. extend cache locations: a torch gather for CPU tensors
        InsertStatements(
            "kernels/ops/speculative/cache_locs.py",
            "assign_extend_cache_locs_func",
            before=IfTest("_is_cuda or _is_hip or _is_musa or _is_xpu"),
            code="""
            if req_to_token.device.type == "cpu" and not _is_cpu:
                # CPU tensors without the CPU engine's kernels: the same gather in torch.
                rows = [
                    req_to_token[
                        int(req_pool_indices[i]), int(start_offset[i]) : int(end_offset[i])
                    ]
                    for i in range(batch_size)
                ]
                if not rows:
                    return torch.empty(0, dtype=torch.int64, device=device)
                return torch.cat(rows).to(torch.int64)
            """,
        ),
        # 4. req_to_token rows: the same assignment in torch for CPU tensors
        InsertStatements(
            "srt/mem_cache/allocation.py",
            "assign_req_to_token_pool_func",
            after=IfTest("_is_cpu"),
            code="""
            if req_to_token.device.type == "cpu":
                # CPU tensors without the CPU engine's kernels: the same rows in torch.
                taken = 0
                for i in range(batch_size):
                    start, end = int(start_offset[i]), int(end_offset[i])
                    locs = out_cache_loc[taken : taken + end - start]
                    req_to_token[int(req_pool_indices[i]), start:end] = locs.to(
                        req_to_token.dtype
                    )
                    taken += end - start
                return
            """,
        ),
        # 5. no stream bookkeeping for a CPU tensor
        GuardStatement(
            "srt/speculative/dflash_worker_v2.py",
            "DFlashWorkerV2.forward_batch_generation",
            statement=(
                "batch.seq_lens.record_stream("
                "torch.get_device_module(self.device).current_stream())"
            ),
            condition='batch.seq_lens.device.type != "cpu"',
        ),
    ),
    note=(
        "DFLASH on --device cpu: the platform check admits cpu, whose draft attention backend "
        "is torch_native (or triton, when asked for); the draft worker keeps it instead of "
        "falling back to flashinfer; extend cache locations and req_to_token rows get torch "
        "paths for CPU tensors when the CPU engine's kernels are not built (the CUDA wheel); "
        "and a CPU seq_lens tensor records no stream. Every branch is for CPU tensors or "
        "--device cpu only; CUDA, NPU and XPU take the paths they took."
    ),
    bug="dflash-cpu-only-spots",
    # spot 5 of the repro calls torch's record_stream itself, not the worker's guarded call
    bug_unshown=("5_record_stream_on_cpu_tensor",),
)


# -- the registry -----------------------------------------------------------------------------

UNFINISHED: Dict[str, str] = {}

FINISHED = (PR_1, PR_2, PR_3B, PR_3) + stack_mooncake.PRS + stack_pp.PRS + stack_digest.PRS

REGISTRY: Dict[str, PR] = {p.number: p for p in FINISHED}
for _group in (stack_mooncake.UNFINISHED, stack_pp.UNFINISHED, stack_digest.UNFINISHED,
               UNFINISHED):
    REGISTRY.update({n: PR(n, unfinished=why) for n, why in _group.items() if n not in REGISTRY})
