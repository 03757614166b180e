"""PR 16 of the stack: the composed KV digest behind ``--disaggregation-enable-kv-checksum``.

Only our code and the anchors it hooks onto are written here (see :mod:`.stack`). The logic is
our modules moved in-tree: the digest itself and its kernel (``kv_digest``, ``kv_digest_triton``,
``kv_digest_engine``, ``kv_digest_thread``, ``draft_kv_digest``), the sending half
(``kv_digest_send``: plain functions called by the plugin's hooks and, in-tree, by a few lines
in the transfer engine, ``MooncakeKVManager`` and ``PrefillBootstrapQueue``) and the verifying
half (``kv_digest_verify``, called by the decode thread, ``MooncakeKVReceiver.poll``,
``DecodePreallocQueue`` and ``_verify_kv_checksums``).
"""

from __future__ import annotations

from typing import Dict, Tuple

from sglang_dflash_pp.tools.export_patches.cst_edits import (
    AddImport,
    IfTest,
    InsertStatements,
    ReplaceBody,
    Stmt,
    WrapStatement,
)
from sglang_dflash_pp.tools.export_patches.new_modules import NewModule
from sglang_dflash_pp.tools.export_patches.pr import PR
from sglang_dflash_pp.tools.export_patches.stack_mooncake import CONN, PREFILL, SEND_FILE

_DISAGG = "sglang_dflash_pp.srt.disaggregation"
# Not in ``disaggregation/mooncake/``: importing a module there imports ``mooncake/conn.py``
# (its package's ``__init__``), and the transfer engine, which conn imports, imports the send half.
DIGEST_SEND_MODULE = "sglang.srt.disaggregation.kv_digest_send"
DIGEST_VERIFY_MODULE = "sglang.srt.disaggregation.kv_digest_verify"
DECODE = "srt/disaggregation/decode.py"
ENGINE = "srt/distributed/device_communicators/mooncake_transfer_engine.py"
_WORKER = "MooncakeKVManager.transfer_worker"

TRANSFER_CHUNK_DOC = """\
Which chunk a Mooncake transfer worker thread is sending: its room, the KV-write events it
waited on, and a memo its sends to several decode ranks share.

``transfer_worker`` sends a chunk to each of its decode ranks in turn through ``send_kvcache`` /
``send_kvcache_slice`` / ``maybe_send_extra``, none of which is told the chunk; the KV digest
(``kv_digest_send``) reads it here, where the worker marks it (``begin_digest_chunk``).

No sglang import."""

DIGEST_SEND_DOC = """\
The sending half of the composed KV digest (``disaggregation/kv_digest.py``) on a Mooncake PD
prefill rank, with ``--disaggregation-enable-kv-checksum`` on a DFLASH prefill.

Each prefill rank adds up, per decode rank and per room, the digest terms of every word it
writes there: the target KV entries and the KDA / Mamba state as the send path moves them
(``batch_transfer_sync`` calls :func:`digest_transfer`, which digests the descriptors where
``send_kvcache``, ``send_kvcache_slice`` or the worker's state send opened a scope for that
decode rank: :func:`send_scope`, :func:`state_scope`), and the DFLASH draft entries as the draft
plan writes them, read from the pool, not from a pack slab (:func:`add_draft_blocks`, from
``draft_kv_send.send_draft_entries``). At the start of ``send_aux`` for the room's last decode
rank, the rank's sums go to every decode rank of the room as one small ZMQ message on the socket
the transfer status follows (:func:`send_digest_sums`), so a decode that sees the room complete
holds every sender's contribution. The decode side is ``kv_digest_verify``.

Where the work runs: with Mooncake's asynchronous batch API, on the transfer worker itself,
inside its own transfers (``batch_transfer_sync`` submits a long one, the worker digests what its
chunk queued while the bytes move, then waits: :func:`digest_transfer`), so no other thread
competes with it for the GIL; the tail at the room's status. An engine call only queues the
kernel (``kv_digest_triton.DeviceDigest.submit``): the sums are read where they are ready, at
the latest at the room's status, so a window never waits behind the forward the GPU runs
meanwhile. Without that API, on a digest
thread per KV manager (``kv_digest_thread``), while Mooncake moves the bytes (its transfers
release the GIL); the send path only hands it the descriptor lists and the draft's page lists,
and the thread resolves all that is queued in one pass and digests it in one engine call. A middle chunk is digested after it, during the next chunk. A
room's last chunk must be read before the room's status (the prefill frees the request's pages
once the status is out): its work is cut where its own long transfers hide it, and its state
sends, known from its start, are run dry on the digest thread then (:func:`prepare_states`:
``batch_transfer_sync`` moves nothing for them, :func:`digest_transfer` says so) and digested
while the KV moves, so the status waits only for what its last transfers handed over. The
worker's wait for the thread is bounded by ``SGLANG_DFLASH_KV_DIGEST_TIMEOUT_S``.

Startup (:func:`start_send_digest`, from ``PrefillBootstrapQueue.__init__``): the digest engine
(``kv_digest_engine``: the kernel compiled, buffers allocated) and its thread, before serving;
stock's whole-request digest is then off on this prefill (it covers this rank's own KV range,
which a decode can compare only at the same TP width and without PP). A decode reached through
DCP relayout or the staging buffer is refused at registration (:func:`peer_refusal`): the
digest does not see those transfers.

A failure of the digest itself is this rank's (never the decode's): the room fails with the
reason and the session stays healthy."""

DIGEST_VERIFY_DOC = """\
The verifying half of the composed KV digest (``disaggregation/kv_digest.py``) on a Mooncake PD
decode rank, with ``--disaggregation-enable-kv-checksum``.

Every prefill rank that writes to this decode rank sends, per room, the digest sums of what it
wrote (``kv_digest_send``), ahead of its transfer status; the decode thread takes them into a
per-room inbox (:func:`take_digest_message`). A room whose transfer completed with some, not
all, of its senders' sums stays Transferring for at most ``SGLANG_DFLASH_KV_DIGEST_TIMEOUT_S``
seconds (default 10), then fails naming the senders that delivered (:func:`poll_digest_sums`);
a room with no sums at all came from a prefill that composes none and is left to stock's rules.

When a request enters its first batch (``_verify_kv_checksums``: after the transfer, before any
KV is cached or decoded), :func:`verify_composed_digests` digests the request's pages of every
KV entry and its state slot, adds up the senders' sums per buffer and compares, whatever the two
sides' layouts (PP stages, other TP widths, head slices). On a mismatch the request is dropped
with an error naming the room, the buffer (target / draft KV entry and layer, or state
component) and the prefill ranks that wrote it, and the server keeps serving; the drop set is
agreed over the attention TP group first, as stock does."""

PR_16 = PR(
    "16",
    new_modules=(
        NewModule(f"{_DISAGG}.kv_digest"),
        NewModule(f"{_DISAGG}.kv_digest_triton"),
        NewModule(f"{_DISAGG}.kv_digest_engine"),
        NewModule(f"{_DISAGG}.kv_digest_thread"),
        NewModule(f"{_DISAGG}.draft_kv_digest"),
        NewModule(f"{_DISAGG}.transfer_chunk", docstring=TRANSFER_CHUNK_DOC),
        NewModule(
            f"{_DISAGG}.kv_digest_send",
            drop=("batch_transfer_sync_around", "maybe_send_extra_around", "send_aux_around",
                  "prefill_queue_init_after", "_SCOPE_OPENERS", "require_hooks", "_MANAGER",
                  "HOOKS"),  # fmt: skip
            docstring=DIGEST_SEND_DOC,
        ),
        NewModule(
            f"{_DISAGG}.kv_digest_verify",
            drop=("verify_kv_checksums_around", "handle_chunk_ready_around",
                  "receiver_poll_around", "prealloc_queue_init_after", "HOOKS"),  # fmt: skip
            docstring=DIGEST_VERIFY_DOC,
        ),
    ),
    edits=(
        # -- the prefill: the engine at startup, in place of stock's whole-range digest
        AddImport(PREFILL, module=DIGEST_SEND_MODULE, names=("start_send_digest",)),
        InsertStatements(
            PREFILL,
            "PrefillBootstrapQueue.__init__",
            after=IfTest("get_disagg().disaggregation_enable_kv_checksum"),
            code="""
            # The composed KV digest on a DFLASH Mooncake prefill: the transfer worker digests
            # what it sends to each decode rank, any PP stage or TP width, in place of the above.
            start_send_digest(self)
            """,
        ),
        # ... every descriptor the transfer engine is handed, where a send opened a scope
        AddImport(ENGINE, module=DIGEST_SEND_MODULE, names=("digest_transfer",)),
        InsertStatements(
            ENGINE,
            "MooncakeTransferEngine.batch_transfer_sync",
            at="start",
            code="""
            moved = digest_transfer(self, session_id, buffers, peer_buffer_addresses, lengths)
            if moved is not None:  # moved with the chunk's digest in its window, or run dry (0)
                return moved
            """,
        ),
        AddImport(
            CONN,
            module=DIGEST_SEND_MODULE,
            names=("begin_digest_chunk", "end_digest_chunk", "peer_refusal", "send_digest_sums",
                   "send_scope", "state_scope"),  # fmt: skip
        ),
        WrapStatement(
            CONN,
            "MooncakeKVManager.send_kvcache",
            call="self._send_kvcache_generic",
            context="send_scope(self, mooncake_session_id, executor) as executor",
        ),
        WrapStatement(
            CONN,
            "MooncakeKVManager.send_kvcache_slice",
            call="executor.submit",
            context="send_scope(self, mooncake_session_id, executor) as executor",
        ),
        WrapStatement(
            CONN,
            _WORKER,
            call="self.maybe_send_extra",
            context="state_scope(self, req, executor) as state_executor",
            rename=("executor", "state_executor"),
        ),
        # ... the worker's chunk (PR 6's chunk packs sit on the same two lines)
        InsertStatements(
            CONN,
            _WORKER,
            after=Stmt("draft_packs = ChunkDraftPacks(self, kv_chunk)"),
            code="begin_digest_chunk(self, kv_chunk)",
        ),
        InsertStatements(
            CONN, _WORKER, after=Stmt("draft_packs.release()"), code="end_digest_chunk(self)"
        ),
        # ... the draft entries from the pool, as the plan writes them
        AddImport(SEND_FILE, module=DIGEST_SEND_MODULE, names=("add_draft_blocks",)),
        InsertStatements(
            SEND_FILE,
            "send_draft_entries",
            before=IfTest("packs is not None"),
            code="add_draft_blocks(manager, session, send, src_pages, dst_pages)  # the KV digest",
        ),
        # ... the sums, before the room's aux data and status
        InsertStatements(
            CONN,
            "MooncakeKVManager.send_aux",
            at="start",
            code="send_digest_sums(self, req)  # this rank's KV digest sums, ahead of its status",
        ),
        # ... and a decode whose bytes the digest would not see is refused at registration
        InsertStatements(
            CONN,
            "MooncakeKVManager._validate_peer_state_layout",
            before=Stmt(
                "draft_mismatch = draft_kv_layout_mismatch(self, registration_info, "
                "self.kv_args.draft_kv_source, head_aware=tuple(TargetPath))"
            ),
            code="""
            digest_refusal = peer_refusal(self, registration_info)  # DCP relayout, staging
            if digest_refusal is not None:
                return False, digest_refusal
            """,
        ),
        # -- the decode: the senders' sums, waited for, then compared with its own bytes
        AddImport(CONN, module=DIGEST_VERIFY_MODULE,
                  names=("poll_digest_sums", "take_digest_message")),  # fmt: skip
        InsertStatements(
            CONN,
            "MooncakeKVManager.start_decode_thread.decode_thread",
            before=IfTest("msg[0] == MooncakeKVManager.AUX_DATA_HEADER"),
            code="""
            if take_digest_message(self, msg):
                continue  # a prefill rank's KV digest sums
            """,
        ),
        ReplaceBody(
            CONN,
            "MooncakeKVReceiver",
            code="""
            def poll(self) -> KVPoll:
                # Complete once every prefill rank's KV digest sums arrived (bounded wait).
                return poll_digest_sums(self, super().poll())
            """,
        ),
        AddImport(DECODE, module=DIGEST_VERIFY_MODULE,
                  names=("start_verify_digest", "verify_composed_digests")),  # fmt: skip
        InsertStatements(
            DECODE,
            "DecodePreallocQueue.__init__",
            after=IfTest("enable_kv_checksum"),
            code="start_verify_digest(self)  # the composed KV digest, any prefill layout",
        ),
        InsertStatements(
            DECODE,
            "SchedulerDisaggregationDecodeMixin._verify_kv_checksums",
            at="start",
            code="""
            # Every request a prefill composed a digest for; stock's check below finds no
            # digest of its own for those.
            verify_composed_digests(self, batch)
            """,
        ),
    ),
    note=(
        "Stock's checksum compares a prefill rank's whole-range digest with the decode's only "
        "at the same layout signature: a PP stage or another TP width is admitted unverified. "
        "Here every 4-byte word's term depends only on the word and on where it lands on the "
        "decode rank (the buffer's index in the decode's registration, the byte offset), so "
        "each sender adds up the terms of what it writes, per decode rank and room, and the "
        "decode adds its senders' sums and compares them with its own bytes: no collective on "
        "the prefill, no agreement on layout, one flipped byte always detected. The sender "
        "digests the descriptors the transfer engine is handed inside a scope the KV and state "
        "sends open (with an executor that carries it into their threads), and the draft "
        "entries from the pool as the plan writes them; middle chunks on a digest thread "
        "during the transfers, a room's last chunk on the worker before its status. The sums "
        "go to the decode as one ZMQ message at the start of send_aux; the decode thread takes "
        "them into an inbox, the receiver waits (bounded) for every sender's, and "
        "_verify_kv_checksums verifies each request before stock's check. Only with "
        "--disaggregation-enable-kv-checksum, and on the prefill only for DFLASH over Mooncake "
        "(stock's whole-range digest is then off there); DCP relayout and the staging buffer "
        "are refused at registration while it is on. Tested on the patched tree without the "
        "plugin: a DFLASH PP2 prefill into a TP1 decode, every request verified by the decode."
    ),
)

PRS: Tuple[PR, ...] = (PR_16,)

UNFINISHED: Dict[str, str] = {}
