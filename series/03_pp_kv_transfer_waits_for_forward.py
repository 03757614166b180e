from sglang_dflash_pp.patch_series.cst_anchors import Stmt
from sglang_dflash_pp.patch_series.cst_edits import InsertStatements

PR = dict(
    title="[Bugfix] PP PD prefill: send a chunk's KV only after its forward",
    description="""\
A pipeline-parallel PD prefill sends a middle chunk's KV from `process_prefill_chunk` right
after the chunk's forward was launched on the forward stream. The transfer worker synchronises
only the chunk's `indices_event` (schedule stream) before Mooncake reads the pages. The default
PP schedule happens to order that read after the forward: the proxy send of a non-last stage
and the output send of the last stage make the schedule stream wait for it. With
`--pp-async-batch-depth >= 1` the last stage's output send waits on an older micro-batch, and
with `SGLANG_PP_COMM_OVERLAP=1` every such wait moves to `pp_comm_stream`: the decode then
receives KV that was not yet written, with no error. On an H200, a 128-page chunk read this way
was 83-92% stale bytes.

`_pp_launch_batch` already records an event after each forward. It is now also attached to the
KV sender of every request of the batch (`CommonKVSender.kv_written_event`), and `send` hands
it to the chunk as its `wait_event`, which the Mooncake and Mori workers synchronise before
they read source KV. Forwards run in order on one stream, so the latest event covers every
earlier chunk of the request. PP runs without overlap scheduling, so the early-send event of a
cached prefix, the other user of `wait_event`, is never set there; it keeps precedence.

The scheduler thread never waits; only the transfer worker does, for what it must read.

Tests: `test/registered/unit/disaggregation/test_kv_written_event.py` (the event of a PP
forward reaches each request's sender and becomes the chunk's `wait_event`; without a PP
forward, nothing changes).
""",
    edits=[
        InsertStatements(
            "srt/disaggregation/common/conn.py",
            "CommonKVSender.__init__",
            after=Stmt("self._early_send_wait_event: Optional[object] = None"),
            code="""
            # Recorded after the latest PP forward of this request (_pp_launch_batch).
            self.kv_written_event: Optional[object] = None
            """,
        ),
        InsertStatements(
            "srt/disaggregation/common/conn.py",
            "CommonKVSender.send",
            after=Stmt("self._early_send_wait_event = None"),
            code="""
            if wait_event is None:
                # A PP stage sends a chunk right after launching the forward
                # that writes its KV.
                wait_event = self.kv_written_event
            """,
        ),
        InsertStatements(
            "srt/managers/scheduler_pp_mixin.py",
            "SchedulerPPMixin._pp_launch_batch",
            after=Stmt("event.record(self.device_module.current_stream())"),
            code="""
            for req in cur_batch.reqs:
                if req.disagg_kv_sender is not None:
                    # The PD transfer of this request's KV waits for this forward.
                    req.disagg_kv_sender.kv_written_event = event
            """,
        ),
    ],
    files=["test/registered/unit/disaggregation/test_kv_written_event.py"],
)
