"""The fence between a PP prefill stage's forward and the KV transfer that reads what it wrote.

The patch to ``sglang/srt/disaggregation/mooncake/conn.py`` (sglang 0.5.23) for it: AROUND
``MooncakeKVSender.send``.

Why: a DFLASH PP prefill stage runs its forward on the scheduler's forward stream, and sglang
sends a middle chunk's KV from ``process_prefill_chunk`` at the start of the next micro-batch,
right after that forward was launched (``disaggregation/prefill.py`` ~1444). The transfer worker
synchronises only the chunk's ``indices_event``, recorded on the schedule stream after the
page-index copy (~1760), and Mooncake reads the pages from the host's side. Nothing orders the
forward before that read: the default PP schedule happens to make the schedule stream wait on the
forward before it records the event (the proxy send on non-last stages, the output send on the
last), but with ``--pp-async-batch-depth >= 1`` the last stage's output send waits on an older
micro-batch, and with ``SGLANG_PP_COMM_OVERLAP=1`` every such wait moves to ``pp_comm_stream``.
The chunk's target KV and, on the last stage, its draft KV would then be sent before they are
written: no error, the decode drafts (and for the target, attends) from stale bytes. (A final
chunk is sent after its result came back through the PP output ring, which implies the forward
is done; the fence does not rely on that either.)

The fence: after each forward, the stage's worker (``dflash_pp_worker``) records an event on the
stream the forward ran on and attaches it to every request's KV sender of the batch
(:func:`record_kv_written`). Each later ``send`` of that request hands the event to the transfer
chunk as its ``wait_event``, the field sglang already has for the same purpose (the early-send of
a cached prefix under overlap, ``prefill.py`` ~1495): the transfer worker synchronises it before it
reads a byte (``mooncake/conn.py`` ~2532), and the draft pack's side stream waits on it before it
gathers a row (``draft_kv_pack.PackSlot.on_stream``). The event is the request's latest forward:
forwards run in order on one stream, so it also covers every earlier chunk of the request.

Inert unless a DFLASH PP prefill worker recorded an event for the request (CUDA only; a CPU
forward is synchronous). Torch only at import.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch

from sglang_dflash_pp.hooks import PluginHook

WRITTEN_ATTR = "_dflash_pp_kv_written"  # on a request's KV sender: the latest forward's event


def record_kv_written(reqs: Iterable, device) -> Optional["torch.cuda.Event"]:
    """Call right after a stage's forward of ``reqs`` was enqueued on the current stream.

    Returns the event (None on a device without streams)."""
    if torch.device(device).type != "cuda":
        return None
    written = torch.cuda.Event()
    written.record(torch.cuda.current_stream(device))
    for req in reqs:
        sender = getattr(req, "disagg_kv_sender", None)
        if sender is not None:
            setattr(sender, WRITTEN_ATTR, written)
    return written


class _BothEvents:
    """Two events as one ``wait_event``: sglang's transfer worker only calls ``synchronize``."""

    def __init__(self, first, second):
        self.events = (first, second)

    def synchronize(self) -> None:
        for event in self.events:
            event.synchronize()


def chunk_wait_event(early, written):
    """The ``wait_event`` a chunk carries: sglang's own early-send event, ours, or both."""
    if written is None or written is early:
        return early
    if early is None:
        return written
    return _BothEvents(early, written)


def send_around(original, self, *args, **kwargs):
    written = getattr(self, WRITTEN_ATTR, None)
    if written is not None:
        self._early_send_wait_event = chunk_wait_event(self._early_send_wait_event, written)
    return original(self, *args, **kwargs)


def cuda_event_of(wait_event):
    """The CUDA event(s) a chunk's ``wait_event`` stands for, for a device-side wait."""
    if wait_event is None:
        return ()
    if isinstance(wait_event, _BothEvents):
        return wait_event.events
    return (wait_event,)


HOOKS = (
    PluginHook(
        "sglang.srt.disaggregation.mooncake.conn.MooncakeKVSender.send",
        send_around,
        "around",
        "a DFLASH PP prefill chunk's transfer waits on the forward that wrote its KV",
    ),
)
