"""Stock 0.5.23: ``/abort_request`` on a PD prefill never tells the decode.

``Scheduler.abort_request`` (``managers/scheduler.py:5675``) aborts a PD prefill request through
its KV sender in every queue: ``CommonKVSender.abort`` (``disaggregation/common/conn.py:2458-2468``)
records the failure and marks the room Failed **locally**. Under the default decode allocation
policy (``early``) nothing on that path sends a message: ``update_status`` notifies a decode only
through the deferred bootstrap of ``--disaggregation-decode-allocation-policy prefill_complete``
(``common/conn.py:671-675``), and so does ``clear`` (``common/conn.py:2409-2444``), which the
scheduler's next poll reaches through ``failure_exception``. The decode has already allocated the
request's KV and sent its indices; its room stays ``WaitingForInput`` until
``SGLANG_DISAGGREGATION_WAITING_TIMEOUT`` (300 s) fails it (``common/conn.py:2888-2906``). The
manager has the call that tells the decode, ``conclude_failure`` (``common/conn.py:906-918``,
which the transfer worker uses when a send fails); the abort path does not use it.

What runs, each the real stock code: ``Scheduler.abort_request`` on a PD prefill ``Scheduler``
built with ``object.__new__`` (its queues; the tree cache and grammar queue are stand-ins), one
request in the bootstrap queue and one in the in-flight queue, each with a real
``MooncakeKVSender`` on one real ``MooncakeKVManager`` (``object.__new__`` with the fields these
paths read, no transfer engine). The decode has registered both rooms (``TransferInfo`` entries
naming a decode status port: a real ZMQ PULL socket on 127.0.0.1). Then the step the scheduler
runs next for a Failed room (``poll``, ``failure_exception``). Whatever arrives at the decode port
is applied to a decode-side ``MooncakeKVManager`` shell with its real ``parse_kv_status_message``
and ``apply_prefill_status``. Control: a third room concluded with ``conclude_failure``.

Run: ``python repro.py`` (stock sglang 0.5.23; no plugin is loaded, see ../stock_sglang.py).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import defaultdict
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import stock_sglang  # noqa: E402

stock_sglang.stock_only()

import numpy as np  # noqa: E402
import zmq  # noqa: E402

TARGETS = [
    "sglang.srt.managers.scheduler.Scheduler.abort_request",
    "sglang.srt.disaggregation.common.conn.CommonKVSender.abort",
    "sglang.srt.disaggregation.common.conn.CommonKVSender.failure_exception",
    "sglang.srt.disaggregation.common.conn.CommonKVSender.clear",
    "sglang.srt.disaggregation.common.conn.CommonKVManager.update_status",
    "sglang.srt.disaggregation.common.conn.CommonKVManager.conclude_failure",
    "sglang.srt.disaggregation.common.conn.CommonKVManager.apply_prefill_status",
    # The Mooncake classes inherit these; a hook on one of them would land in its own __dict__.
    "sglang.srt.disaggregation.mooncake.conn.MooncakeKVSender.abort",
    "sglang.srt.disaggregation.mooncake.conn.MooncakeKVSender.failure_exception",
    "sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager.update_status",
]
ROOMS = {"bootstrap_queue": 1001, "inflight_queue": 1002}
CONTROL_ROOM = 1003


def manager_shell(role: str):
    """A ``MooncakeKVManager`` with the fields the abort, clear and status paths read."""
    from sglang.srt.disaggregation.base.conn import KVArgs
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager

    m = object.__new__(MooncakeKVManager)
    m.kv_args = KVArgs()  # its defaults: no draft entries, nothing registered
    m.request_status, m.failure_records, m.failure_lock = {}, {}, threading.Lock()
    m.deferred_bootstrap, m.defer_decode_allocation = None, False  # the default policy, early
    m._staging_outstanding, m._deferred_ack_targets = defaultdict(int), {}
    m._deferred_ack_poisoned_rooms, m._staging_ctx = set(), None
    m.attn_tp_rank = m.attn_cp_rank = m.pp_rank = 0
    m.pp_size = m.attn_cp_size = 1
    if role == "prefill":
        m.transfer_infos, m.req_to_decode_prefix_len = {}, {}
        m._zmq_ctx, m._socket_lock = zmq.Context.instance(), threading.Lock()
        m._socket_cache, m._monitor_cache, m._socket_send_locks = {}, {}, {}
    return m


def register_decode_room(prefill, room: int, decode_port: int) -> None:
    """What the prefill's bootstrap thread stores once the decode sent its KV indices."""
    from sglang.srt.disaggregation.mooncake.conn import TransferInfo
    from sglang.srt.disaggregation.utils import KVPoll

    prefill.transfer_infos[room] = {"decode-session": TransferInfo(
        room=room, endpoint="127.0.0.1", dst_port=decode_port,
        mooncake_session_id="decode-session", dst_kv_indices=np.arange(4, dtype=np.int32),
        dst_aux_index=0, dst_state_indices=[], required_dst_info_num=1, is_dummy=False,
    )}  # fmt: skip
    prefill.update_status(room, KVPoll.Bootstrapping)
    prefill.update_status(room, KVPoll.WaitingForInput)


def sender(prefill, room: int):
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVSender
    from sglang.srt.observability.trace import TraceNullContext

    s = object.__new__(MooncakeKVSender)
    s.kv_mgr, s.bootstrap_room, s.conclude_state = prefill, room, None
    s.trace_ctx, s._owns_bootstrap_room, s.init_time = TraceNullContext(), True, time.time()
    s._transfer_start_time = None
    return s


def prefill_request(prefill, rid: str, room: int):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = Req(rid=rid, origin_input_text="", origin_input_ids=list(range(8)),
              sampling_params=SamplingParams(), bootstrap_room=room)  # fmt: skip
    req.disagg_kv_sender = sender(prefill, room)
    return req


def prefill_scheduler(bootstrap_queue, inflight_queue):
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.managers.scheduler import Scheduler

    s = object.__new__(Scheduler)
    s.chunked_req = s.mm_receiver = s.dllm_config = None
    s.waiting_queue, s.disaggregation_mode = [], DisaggregationMode.PREFILL
    s.running_batch = s.last_batch = None
    s.enable_continuous_input_polling, s.result_queue = False, []
    s.disagg_prefill_bootstrap_queue = SimpleNamespace(queue=bootstrap_queue)
    s.disagg_prefill_inflight_queue = inflight_queue
    # Stand-ins for the components the abort path touches besides the KV sender.
    s.grammar_manager = SimpleNamespace(abort_requests=lambda recv_req: None)
    s.tree_cache = SimpleNamespace(finish=lambda *a: None)
    return s


def poll_name(status: int) -> str:
    from sglang.srt.disaggregation.utils import KVPoll

    return next(k for k, v in vars(KVPoll).items() if not k.startswith("_") and v == status)


def drain(sock, settle_s: float = 0.5):
    msgs, deadline = [], time.monotonic() + settle_s
    while time.monotonic() < deadline:
        if sock.poll(50):
            msgs.append(sock.recv_multipart())
    return msgs


def main() -> None:
    from sglang.srt.disaggregation.utils import KVPoll
    from sglang.srt.managers.io_struct import AbortReq
    from sglang.srt.runtime_context import get_context, get_parallel

    mode = stock_sglang.begin(TARGETS)
    get_context().override_server_args(disaggregation_mode="prefill").install()
    decode_port_sock = zmq.Context.instance().socket(zmq.PULL)
    decode_port = decode_port_sock.bind_to_random_port("tcp://127.0.0.1")

    prefill = manager_shell("prefill")
    for room in (*ROOMS.values(), CONTROL_ROOM):
        register_decode_room(prefill, room, decode_port)
    in_bootstrap = prefill_request(prefill, "abort-me-b", ROOMS["bootstrap_queue"])
    in_flight = prefill_request(prefill, "abort-me-i", ROOMS["inflight_queue"])
    scheduler = prefill_scheduler([in_bootstrap], [in_flight])

    with get_parallel().override(pp_size=1, pp_rank=0, tp_rank=0):
        scheduler.abort_request(AbortReq(rid="abort-me"))
        local = {}
        for where, req in (("bootstrap_queue", in_bootstrap), ("inflight_queue", in_flight)):
            local[where] = poll_name(req.disagg_kv_sender.poll())
            try:  # the scheduler's next step for a Failed room (handle_*_failure)
                req.disagg_kv_sender.failure_exception()
            except Exception as e:  # KVTransferError: the recorded reason
                local[where] += f" ({getattr(e, 'failure_reason', e)})"
    after_abort = drain(decode_port_sock)
    prefill.conclude_failure(bootstrap_room=CONTROL_ROOM, failure_reason="a failed KV send")
    after_control = drain(decode_port_sock)

    decode = manager_shell("decode")
    for room in (*ROOMS.values(), CONTROL_ROOM):
        decode.request_status[room] = KVPoll.WaitingForInput  # allocated, indices sent

    def decode_sees(msgs):
        for msg in msgs:
            room, status, rank, reason = decode.parse_kv_status_message(msg)
            decode.apply_prefill_status(bootstrap_room=room, status=status, prefill_rank=rank,
                                        failure_reason=reason)  # fmt: skip
        return [[int(m[0]), poll_name(int(m[1]))] for m in msgs]

    observed = {
        "prefill_sender_after_abort": local,
        "status_messages_to_decode_after_abort": decode_sees(after_abort),
        "decode_room_status_after_abort": {
            where: poll_name(decode.check_status(room)) for where, room in ROOMS.items()
        },
        "control_conclude_failure_messages": decode_sees(after_control),
        "control_decode_room_status": poll_name(decode.check_status(CONTROL_ROOM)),
    }
    expected = {
        "prefill_sender_after_abort": {w: "Failed (Aborted by AbortReq.)" for w in ROOMS},
        "status_messages_to_decode_after_abort": [[room, "Failed"] for room in ROOMS.values()],
        "decode_room_status_after_abort": {w: "Failed" for w in ROOMS},
        "control_conclude_failure_messages": [[CONTROL_ROOM, "Failed"]],
        "control_decode_room_status": "Failed",
    }
    from sglang.srt.environ import envs

    stock_sglang.compare(
        mode, TARGETS, "prefill-abort-not-sent-to-decode", observed, expected,
        decode_waiting_timeout_s=envs.SGLANG_DISAGGREGATION_WAITING_TIMEOUT.get(),
    )
    decode_port_sock.close(linger=0)


if __name__ == "__main__":
    main()
