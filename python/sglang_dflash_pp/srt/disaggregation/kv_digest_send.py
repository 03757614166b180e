"""The sending half of the composed KV digest (``kv_digest``) on a Mooncake PD prefill rank, with
``--disaggregation-enable-kv-checksum`` (sglang 0.5.23).

Each prefill rank adds up, per decode rank and per room, the digest terms of every word it
writes there: the target KV entries and the KDA / Mamba state as sglang's own send path moves
them, the DFlash draft entries as the draft plan writes them (read from the pool, not from a
pack slab). Before the room's aux data of a decode rank, the last thing sent to it, the rank's
sums go to the decode as one small ZMQ message on the socket the transfer status follows, so a
decode that sees the room complete holds every sender's contribution. The decode side is
``kv_digest_verify``.

Where the work runs (one :class:`_Pending` per chunk, made by :func:`begin_chunk`). Where the
Mooncake engine has the asynchronous batch API (:func:`transfer_windows`, decided at startup): on
the transfer worker itself, inside its own long transfers (:func:`_transfer_in_window`: the
transfer submitted, what the chunk queued digested while the bytes move, one engine call per
window, then a GIL-free wait), the tail at the room's status (:func:`flush`), so no thread of
ours competes with the worker for the GIL. An engine call only queues the kernel: no window
waits for the GPU, which in serving runs the next chunk's forward meanwhile. Its sums are read
where they are ready, in a later window (this chunk's, or a later chunk's for a middle chunk,
which is parked: :meth:`SendDigest.park`), and at the latest at the room's status, which waits
for every chunk's (:meth:`_Pending.settle`): the request's pages, which the kernels read, are
held until then. Without that API, the schedule below: on a thread of its own
(``kv_digest_thread``), while Mooncake moves bytes (its transfers release the GIL).
The send hooks only hand it references: sglang's descriptor lists and the draft's page lists.
The thread resolves everything queued in one pass (``kv_digest.ListResolver``: a few numpy
calls for every decode rank's lists, not a few per list) and digests it in one engine call
(:func:`_digest_pending`). A middle chunk is digested once the worker is done with it, during
the next chunk's transfers. A room's last chunk must be read before its status goes out (the
prefill frees the request's pages after it) and nothing after it hides the work: some of its
transfers of at least ``EAGER_DIGEST_MIN_BYTES`` also have the thread digest what was handed
over before them (an engine call hidden by that transfer: once half the decode ranks' sends
were handed over, at the last rank's first, and at its later ones; engine calls are few and
large, as each costs ~0.1-0.2 ms of thread time), so at the status the worker waits (bounded)
only for the chunk's tail, what its last transfers handed over (``benchmark/gpu/results``,
``benchmark/kv_digest``: the cost; :meth:`_Pending.digest_during`). Its state sends, sent last,
are known from its start: the thread runs them dry then and digests them while the KV moves
(:func:`prepare_states`), so the tail holds no state to digest.

Hooks (``sglang/srt/disaggregation/``):

* AFTER ``prefill.PrefillBootstrapQueue.__init__``: on a DFLASH Mooncake prefill with the
  checksum flag, build the digest engine (``kv_digest_engine``: kernel compiled, buffers
  allocated, before serving), start its thread, and turn off stock's whole-request digest on
  this prefill (``scheduler.kv_checksum_computer = None``): it digests this rank's own KV range, which a
  decode can compare only at the same TP width and without PP, and the composed digest covers
  that layout too.
* AROUND ``sglang/srt/distributed/device_communicators/mooncake_transfer_engine.py``
  ``MooncakeTransferEngine.batch_transfer_sync``, where every send path's descriptors meet (some
  call it directly, e.g. ``send_kvcache_slice``): inside a digest scope (a stock send
  ``mooncake_draft_kv`` makes for one decode rank, or the state send below), the descriptors
  sglang built are digested on their way to the engine, their destinations resolved against the
  decode's registered buffers; a transfer of at least ``WINDOW_MIN_BYTES`` wakes the digest
  thread for the worker's GIL-free wait. On the digest thread, in a state send run dry
  (:func:`prepare_states`), the descriptors are kept and the engine is not called.
* AROUND ``MooncakeKVManager.maybe_send_extra``: the room's state send, in a scope.
* AROUND ``MooncakeKVManager.send_aux``: the decode rank's contribution, then the aux data.

A failure of the digest itself is this rank's (never the decode's): the room fails with the
reason and the session stays healthy, as for the draft KV send.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from sglang_dflash_pp.hooks import PluginHook, registered_hooks, require_applied
import sglang_dflash_pp.srt.disaggregation.transfer_chunk as transfer_chunk
from sglang_dflash_pp.srt.disaggregation.draft_kv_digest import (
    DigestEntries,
    digest_blocks_of,
    digest_entries,
)
from sglang_dflash_pp.srt.disaggregation.kv_digest import (
    Blocks,
    BufferKind,
    BufferTable,
    Contribution,
    DEFAULT_TIMEOUT_S,
    ListResolver,
    TIMEOUT_ENV,
    Sender,
    encode,
    slots_of,
)
from sglang_dflash_pp.srt.disaggregation.kv_digest_engine import unsupported_state
from sglang_dflash_pp.srt.disaggregation.kv_digest_thread import DigestThread

logger = logging.getLogger(__name__)

_ENGINE_ATTR = "_dflash_kv_digest"  # on the KV manager: the SendDigest, when on
_TABLES_ATTR = "_dflash_kv_digest_tables"  # on a decode's KVArgsRegisterInfo
_scope = threading.local()
_NO_SESSIONS: frozenset = frozenset()
# A transfer shorter than a job of the digest thread is no window for it: a worker that wakes
# while the thread holds the GIL waits for the job (a state slice, a few KB, is ~1 us of link).
WINDOW_MIN_BYTES = 1 << 20
# A last chunk's transfer this long (0.34 ms at 50 GB/s) hides an engine call (~0.1-0.3 ms of
# host and GPU time on an H200 host): the thread digests what is queued during it.
EAGER_DIGEST_MIN_BYTES = 16 << 20
# With Mooncake's asynchronous batch API, a worker's transfer at least this long is submitted,
# the worker digests what its chunk queued while the bytes move, then waits for the transfer
# (:func:`_transfer_in_window`): the same bound as above, for the same reason.
WINDOW_DIGEST_MIN_BYTES_ENV = "SGLANG_DFLASH_KV_DIGEST_WINDOW_MIN_BYTES"
# Engine calls a sender keeps in flight (``DeviceDigest`` lanes): a submit finding all of them
# unread reads the oldest first, long finished by then (a window's transfer is ~0.5 ms or more).
SEND_LANES = 4


class SendDigest:
    """One prefill rank's digest state: its engine, its name, the thread it digests on, the
    rooms' running sums (per (room, decode rank): one uint64 per decode buffer, added to in
    place: uint64 wraps mod 2**64; turned into a :class:`Contribution` when sent)."""

    def __init__(self, engine, sender: Sender):
        self.engine = engine
        self.sender = sender
        self._lock = threading.Lock()
        self._sums: Dict[Tuple[int, str], Tuple[tuple, np.ndarray]] = {}
        self.thread = DigestThread(f"kv-digest-{sender.describe()}")
        self.resolver = ListResolver()  # its joined tables are this rank's decodes'
        # Whether the worker digests its chunk inside its own transfers (set at startup where
        # the manager's Mooncake engine has the asynchronous batch API: ``transfer_windows``),
        # and from which transfer size; else the digest thread does, during them.
        self.windows = False
        self.window_min_bytes = int(os.environ.get(WINDOW_DIGEST_MIN_BYTES_ENV,
                                                   EAGER_DIGEST_MIN_BYTES))  # fmt: skip
        self.windows_used = 0  # transfers the worker digested in (logged at the first)
        # Chunks whose sums are still on their way from the GPU (:meth:`park`): a worker's
        # middle chunks, read in a later window or at a status (:meth:`settle_parked`).
        self._parked: List["_Pending"] = []

    def add(self, room: int, session: str, tables, sums: np.ndarray) -> None:
        with self._lock:
            entry = self._sums.get((room, session))
            if entry is None:
                self._sums[(room, session)] = (tables, np.array(sums, dtype=np.uint64))
            else:
                entry[1][:] += sums

    def pop(self, room: int, session: str) -> Contribution:
        with self._lock:
            entry = self._sums.pop((room, session), None)
        c = Contribution(int(room), self.sender)
        if entry is not None:
            c.add_slots(*entry)
        return c

    def forget_room(self, room: int) -> None:
        with self._lock:
            for key in [k for k in self._sums if k[0] == room]:
                del self._sums[key]
            parked = list(self._parked)
        for p in parked:
            p.drop_room(room)

    def park(self, pending: "_Pending") -> None:
        """``pending``'s sums, still on the GPU, are added to its rooms later, by whichever
        worker settles parked chunks next (the sums are the same whoever reads them)."""
        if pending.unsettled:
            with self._lock:
                self._parked.append(pending)

    def settle_parked(self, block: bool) -> None:
        """Add parked chunks' sums to their rooms: those whose kernels finished, or (``block``,
        at a status) all of them, waiting for the GPU."""
        if not block and not self._parked:  # every window asks; most find none
            return
        with self._lock:
            parked, self._parked = self._parked, []
        for p in parked:
            p.settle(block)
        left = [p for p in parked if p.unsettled]
        if left:
            with self._lock:
                self._parked.extend(left)


def digest_of(manager) -> Optional[SendDigest]:
    return getattr(manager, _ENGINE_ATTR, None)


def _tables_and_keys(registration):
    """(tables, their keys, their sizes) of a decode registration, made once (the keys a tuple:
    the engine knows it again by identity, ``DeviceDigest._keys_np``)."""
    cached = getattr(registration, _TABLES_ATTR, None)
    if cached is None:
        kv = BufferTable(BufferKind.KV, list(registration.dst_kv_ptrs))
        flat = [p for ptrs in (registration.dst_state_data_ptrs or []) for p in ptrs]
        tables = (kv, BufferTable(BufferKind.STATE, flat, first_slot=len(kv)))
        cached = (tables, tuple(slots_of(tables)), tuple(len(t) for t in tables))
        setattr(registration, _TABLES_ATTR, cached)
    return cached


def tables_of(registration) -> Tuple[BufferTable, BufferTable]:
    """(KV entries, state components) of a decode registration as digest slots, made once (at
    the registration's first digested send; the send path does not rebuild them)."""
    return _tables_and_keys(registration)[0]


def _fail(manager, room: int, session: str, error: BaseException) -> None:
    logger.error("KV digest of room %s for decode %s failed on this prefill: %r", room, session,
                 error, exc_info=True)  # fmt: skip
    manager.conclude_failure(
        bootstrap_room=room,
        failure_reason=(
            f"KV digest of room {room} for decode {session} failed on prefill rank "
            f"{getattr(manager, 'attn_tp_rank', '?')} (pp rank {getattr(manager, 'pp_rank', '?')}): "
            f"{error}"
        ),
    )


class _Descriptors(NamedTuple):
    """sglang's descriptor lists of one ``batch_transfer_sync`` (fresh lists per call in 0.5.23,
    kept by reference) into the decode buffers of ``kind``."""

    kind: BufferKind
    src: Sequence[int]
    dst: Sequence[int]
    length: Sequence[int]


class _Pending:
    """One chunk's sends not digested yet (as the send hooks handed them: sglang's descriptor
    lists, the draft's blocks or what builds them), and the sums it already digested. They are
    resolved and digested on the digest thread, all that is queued in one pass and one engine
    call (:func:`_digest_pending`); ``last``: a room's last chunk, digested in several such calls
    during its own transfers (:func:`digest_transfer`), the rest at its status. ``inline``: the
    synchronous design, the chunk digested by the worker that sends it (the benchmark's
    comparison; nothing in serving sets it)."""

    def __init__(self, last: bool = False, ranks: int = 0, manager=None, room: Optional[int] = None,
                 written: Tuple = ()):  # fmt: skip
        self.last = last
        self.ranks = ranks  # decode ranks the chunk goes to (0: not known)
        # The worker chunk this is (:func:`begin_chunk`): its manager, room and KV-write events
        # as ``transfer_chunk`` (their owner) gave them at the chunk's start, read here so the
        # send hooks do not ask for them per send; and its digest scopes, one per decode rank and
        # kind (its sends to a rank share it).
        self.of, self.room, self.chunk_written = manager, room, written
        self.scopes: Dict[Tuple[str, BufferKind], "_Scope"] = {}
        self.inline = False
        # decode sessions whose sends were handed over since the last digest during a transfer
        self.handed: set = set()
        self.seen: set = set()  # every decode session this chunk handed over sends for
        self.halfway = False  # the engine call at half the decode ranks was made
        self.manager = None
        self.items: List[Tuple[int, str, object, object]] = []  # room, session, registration, what
        self.written: Tuple = ()
        # This chunk's sums per part signature (:func:`_signed_parts`): a prefill rank sends the
        # same target MLA KV, at the same offsets, to each of its decode ranks, and a draft head
        # to each rank that holds it; whichever digest sees such a part first, the others reuse
        # its sums (also across the engine calls of one last chunk). Each as (the engine call's
        # sums, still on their way from the GPU, where its slots begin, how many).
        self.known: Dict[Tuple, Tuple[object, int, int]] = {}
        # Parts digested whose sums are not added to their rooms yet (:meth:`settle`): the
        # manager, room, decode session, registration tables and signature of each.
        self.adds: List[Tuple] = []
        # State sends prepared at the chunk's start (:func:`prepare_states`): sglang's lists as
        # tuples -> (blocks, signature), their sums in ``known``.
        self.prepared: Dict[Tuple, Tuple[Blocks, Tuple]] = {}
        # With windows: the state send to run dry in a window with nothing new to digest (the
        # arguments of :func:`_capture_states` after ``pending``), None once run or dropped;
        # the lists it captured, (manager, written, [(room, session, registration, lists)]),
        # until the next engine call digests them with what is queued then.
        self.prep: Optional[tuple] = None
        self.captured: Optional[tuple] = None
        self.windows = 0  # transfers this chunk digested in (:func:`_digest_window`)
        self._lock = threading.Lock()  # sglang's executor threads hand over here too

    def hand(self, manager, room: int, session: str, registration, what, written) -> None:
        """Queue one send (on the sending thread: nothing here raises into sglang's send)."""
        with self._lock:
            other = self.manager is not None and self.manager is not manager
            if not other:
                self.manager = manager
                self.written = written or self.written
                self.items.append((int(room), session, registration, what))
                self.handed.add(session)
                self.seen.add(session)
        if other:
            error = RuntimeError("one transfer worker digesting for two KV managers")
            _fail(manager, room, session, error)

    def take(self):
        with self._lock:
            taken = (self.items, self.manager, self.written)
            self.items, self.manager, self.written = [], None, ()
        return taken

    def nothing_new(self) -> bool:
        """Whether everything queued is a draft part whose sums this chunk already knows (a
        head another decode rank holds too): digesting it is no engine call. Descriptor lists
        count as new, as only resolving them tells."""
        with self._lock:
            items = list(self.items)
        return all(isinstance(what, DraftPart)
                   and what.signature + _tables_and_keys(reg)[2] in self.known
                   for _, _, reg, what in items)  # fmt: skip

    @property
    def unsettled(self) -> bool:
        return bool(self.adds)

    def defer(self, manager, room: int, session: str, tables, signature) -> None:
        with self._lock:
            self.adds.append((manager, room, session, tables, signature))

    def drop_room(self, room: int) -> None:
        with self._lock:
            self.adds = [a for a in self.adds if a[1] != room]

    def settle(self, block: bool) -> None:
        """Add the digested parts' sums to their rooms: those whose engine call finished, or
        (``block``) all of them, waiting for it. A part whose digest raised fails its room (once
        per decode rank), naming the reason."""
        with self._lock:
            ready, waiting, done = [], [], {}
            for a in self.adds:
                sums = self.known[a[4]][0]
                if block or done.setdefault(id(sums), sums.done()):
                    ready.append(a)
                else:
                    waiting.append(a)
            self.adds = waiting
        failed = set()
        for manager, room, session, tables, signature in ready:
            sums, base, n = self.known[signature]
            try:
                value = sums.result()[base : base + n]
            except Exception as e:  # noqa: BLE001 - the kernel refused a block: this room's
                if (room, session) not in failed:
                    failed.add((room, session))
                    _fail(manager, room, session, e)
                continue
            if (room, session) not in failed:
                digest_of(manager).add(room, session, tables, value)

    def digest_during(self, session: str, handed_before: set) -> bool:
        """Whether a long transfer to ``session`` should hide an engine call over what is
        queued, on a last chunk: its status waits for whatever the thread has not digested when
        the last transfer ends, so the work is cut where transfers hide it. With the room's
        decode ranks known, two calls cover the ranks before the last (at the first long
        transfer once half of them were handed over, and at the last rank's first), and each
        further long transfer to the last rank hides its own sends so far: the status waits
        only for what its last transfers handed over. For a single decode rank, at each long
        transfer after its first; with the ranks not known, at the first long transfer to each
        new rank. Never on a middle chunk (digested after it) or in the synchronous design."""
        if not self.last or self.inline:
            return False
        if self.ranks == 1:
            return session in handed_before
        if self.ranks == 0:
            return bool(handed_before - {session})
        others = len(self.seen - {session})
        if others >= self.ranks - 1:
            return bool(handed_before)
        if others >= self.ranks // 2 and not self.halfway:
            self.halfway = True
            return True
        return False

    def digest(self) -> None:
        """Digest what is queued (nothing: no job) and add its sums to the rooms: here in the
        synchronous design, else on the digest thread."""
        manager = self.manager
        if manager is None:
            return
        if self.inline:
            _digest_and_settle(self)
        else:
            digest_of(manager).thread.submit(_digest_and_settle, self)


def _pending() -> _Pending:
    """This worker thread's current chunk's (``begin_chunk`` starts one per chunk)."""
    p = getattr(_scope, "pending", None)
    if p is None:
        p = _scope.pending = _Pending()
    return p


def _aux() -> Dict[int, List[object]]:
    """This worker thread's rooms whose aux went to some of their decode ranks already."""
    a = getattr(_scope, "aux", None)
    if a is None:
        a = _scope.aux = {}
    return a


def add_blocks(manager, room: Optional[int], session: str, registration, blocks) -> None:
    """Queue ``blocks`` (destinations already as decode offsets and slots of the registration's
    tables; or a :class:`DraftPart` or a function that builds them, built where the chunk is
    digested) for the room's sums of ``session``."""
    if digest_of(manager) is None or room is None:
        return
    _pending().hand(manager, int(room), session, registration, blocks, transfer_chunk.written())


def _signed_parts(resolver: ListResolver, items, prepared=None) -> List[Tuple]:
    """``items`` (a :meth:`_Pending.take`) as ``(room, session, registration, blocks,
    signature)``, signatures equal for parts whose sums are equal (the same blocks over
    registrations of the same sizes: the keys are a function of the tables' sizes,
    ``kv_digest.buffer_key``). Blocks None: a part that failed (its error as the signature), or
    a function that built nothing (signature None). ``prepared``: state lists already resolved
    (:func:`prepare_states`), by their tuples."""
    prints: Dict[int, bytes] = {}  # one fingerprint per distinct Blocks object
    out: Dict[int, Tuple] = {}
    lists, tables = [], []
    for i, (room, session, reg, what) in enumerate(items):
        hit = prepared.get(_list_key(what)) if prepared and _preparable(what) else None
        if hit is not None:
            out[i] = (room, session, reg) + hit
        elif isinstance(what, _Descriptors):
            try:  # a registration whose tables cannot be made fails its own room only
                tables.append(_table_of(reg, what.kind))
                lists.append(i)
            except Exception as e:
                out[i] = (room, session, reg, None, e)
    out.update(zip(lists, _resolved_lists(resolver, [items[i] for i in lists], tables)))
    return [out[i] if i in out else _built(item, prints) for i, item in enumerate(items)]


def _resolved_lists(resolver: ListResolver, items, tables) -> List[Tuple]:
    """:func:`_signed_parts` of descriptor lists (``tables``: each one's decode table), all
    resolved in one pass; where that raises, each alone, so that a bad list fails its own room
    only."""
    if not items:
        return []
    lists = [what for *_, what in items]
    try:
        resolved, ends = resolver.resolve(tables, [w.src for w in lists], [w.dst for w in lists],
                                          [w.length for w in lists])  # fmt: skip
    except Exception:

        def alone(t, w):
            return lambda: t.blocks(*(np.asarray(a, np.int64) for a in (w.src, w.dst, w.length)))

        return [_built((room, session, reg, alone(t, what)), {})
                for (room, session, reg, what), t in zip(items, tables)]  # fmt: skip
    rows = np.stack([resolved.src, resolved.dst, resolved.nbytes, resolved.slot])
    out, lo = [], 0
    for (room, session, reg, _), hi in zip(items, ends.tolist()):
        signature = ("rows", rows[:, lo:hi].tobytes()) + _tables_and_keys(reg)[2]
        out.append((room, session, reg, Blocks(*(c[lo:hi] for c in resolved)), signature))
        lo = hi
    return out


def _built(item, prints: Dict[int, bytes]) -> Tuple:
    """:func:`_signed_parts` of a :class:`DraftPart`, blocks, or a function that builds them."""
    room, session, reg, what = item
    try:
        sizes = _tables_and_keys(reg)[2]
        if isinstance(what, DraftPart):
            return room, session, reg, what.blocks(), what.signature + sizes
        if callable(what):
            what = what()
        if what is None:
            return room, session, reg, None, None
        if id(what) not in prints:
            prints[id(what)] = what.fingerprint()
        return room, session, reg, what, ("blocks", prints[id(what)]) + sizes
    except Exception as e:
        return room, session, reg, None, e


def _table_of(registration, kind: BufferKind) -> BufferTable:
    kv, state = tables_of(registration)
    return kv if kind is BufferKind.KV else state


def _preparable(what) -> bool:
    return isinstance(what, _Descriptors) and what.kind is BufferKind.STATE


def _list_key(what: _Descriptors) -> Tuple:
    return (tuple(what.src), tuple(what.dst), tuple(what.length))


def prepare_states(manager, chunk, reqs) -> None:
    """On a room's last chunk (``chunk``) with a state to send: the state send to its last
    decode rank is the chunk's last transfer, so nothing after it hides its digest, but it is
    known from the chunk's start. sglang's own state send (``maybe_send_extra``) to that rank
    runs dry early (:func:`captured_transfer`: its descriptors kept, nothing moved) and the
    descriptors are digested while the chunk's KV moves; when the worker's real state send
    hands over the same lists, their sums are known and the status does not wait for an engine
    call. A list the real send does not repeat is digested as it comes (nothing is added for a
    state the worker does not send). Only the last rank's: the others' state sends come before
    long transfers that hide their digests.

    Where: with windows, the worker runs the send dry in the first window, from the chunk's
    second, with nothing new to digest (:meth:`_Pending.nothing_new`), and the captured lists
    join the next window's engine call: a dry run, its resolving and an engine call together
    outlast a 0.5 ms draft transfer on an H200 host, and the chunk's first windows each have an
    engine call of their own (``benchmark/gpu/results``). Else the digest thread runs and
    digests it at once."""
    digest = digest_of(manager)
    states = getattr(chunk, "state_indices", None)
    pending = getattr(_scope, "pending", None)
    if digest is None or not states or pending is None or not pending.last or not reqs:
        return
    # ``reqs`` (:func:`_room_requests`) in the worker's order: the last one's state is the tail
    prep = (manager, int(chunk.room), states, reqs[-1], transfer_chunk.written())
    if digest.windows:  # run in a window (_digest_window)
        pending.prep = prep
    else:
        digest.thread.submit(_prepare_states, pending, *prep)


def _capture_states(pending: _Pending, manager, room: int, states, req, written) -> bool:
    """Run the room's state send to ``req``'s decode rank dry; its lists wait in
    ``pending.captured`` for the next engine call (:func:`_digest_pending`). False where
    nothing was captured."""
    session = req.mooncake_session_id
    reg = (getattr(manager, "decode_kv_args_table", None) or {}).get(session)
    if pending.inline or reg is None:  # the synchronous design digests where it sends
        return False
    captured = _scope.capture = []
    try:
        manager.maybe_send_extra(req, states, None, reg)
    except Exception as e:  # the real send raises it again, where sglang handles it
        logger.debug("KV digest: room %s's state send could not be prepared: %r", room, e)
    finally:
        _scope.capture = None
    if not captured:
        return False
    pending.captured = (manager, written, [(room, session, reg, w) for w in captured])
    return True


def _prepare_states(pending: _Pending, manager, room: int, states, req, written) -> None:
    """The digest thread's job: the state send run dry, and digested at once."""
    if _capture_states(pending, manager, room, states, req, written):
        _digest_pending(pending, queued=False)


def _prepared(pending: _Pending, captured, parts) -> None:
    """Remember the captured lists whose sums are known, for the real send to find."""
    pending.prepared.update({_list_key(item[3]): (p[3], p[4]) for item, p in zip(captured, parts)
                             if p[3] is not None and p[4] in pending.known})  # fmt: skip


def captured_transfer(session_id, buffers, peer_buffer_addresses, lengths) -> bool:
    """True when this thread runs a send dry (:func:`prepare_states`): the transfer's
    descriptors are kept, and the transfer must not happen."""
    captured = getattr(_scope, "capture", None)
    if captured is None:
        return False
    captured.append(_Descriptors(BufferKind.STATE, list(buffers), list(peer_buffer_addresses),
                                 list(lengths)))  # fmt: skip
    return True


def _known_sums(pending: _Pending, manager, parts, written) -> bool:
    """Digest the ``parts`` whose sums ``pending`` does not know yet, in one engine call, into
    ``pending.known`` (the call's sums are read later: :meth:`_Pending.settle`); False (their
    rooms failed) if the call could not be started."""
    todo: Dict[Tuple, Tuple[Blocks, List[int]]] = {}
    for _, _, registration, blocks, signature in parts:
        if signature not in pending.known and signature not in todo:
            todo[signature] = (blocks, _tables_and_keys(registration)[1])
    if not todo:
        return True
    if len(todo) == 1:  # the registration's own keys, as they are
        (signature, (blocks, keys)), = todo.items()
        bases = {signature: (0, len(keys))}
    else:
        keys, shifted, bases = [], [], {}
        for signature, (part, reg_keys) in todo.items():
            bases[signature] = (len(keys), len(reg_keys))
            shifted.append(part._replace(slot=part.slot + len(keys)))
            keys.extend(reg_keys)
        blocks = Blocks.concat(shifted)
    try:
        sums = digest_of(manager).engine.submit(blocks, keys, wait_events=written)
    except Exception as e:
        for room, session in {(r, s) for r, s, _, _, _ in parts}:
            _fail(manager, room, session, e)
        return False
    for signature, (base, n) in bases.items():
        pending.known[signature] = (sums, base, n)
    return True


def _digest_pending(pending: _Pending, queued: bool = True) -> None:
    """Resolve and digest every send ``pending`` holds (not ``queued``: none), and the state
    lists captured for it (:func:`_capture_states`), in one engine call (parts whose sums this
    chunk already knows: none); the sends' sums are added to the rooms by
    :meth:`_Pending.settle`, the captured lists' are kept for the real send
    (:func:`_prepared`)."""
    items, manager, written = pending.take() if queued else ([], None, ())
    captured: list = []
    if pending.captured is not None:
        prep_manager, prep_written, captured = pending.captured
        pending.captured = None
        manager, written = manager or prep_manager, written or prep_written
    digest = digest_of(manager) if manager is not None else None
    if digest is None or not (items or captured):
        return
    signed = _signed_parts(digest.resolver, items + captured, pending.prepared)
    parts = []
    for room, session, registration, blocks, signature in signed[: len(items)]:
        if blocks is None and signature is None:  # a function that built nothing
            continue
        if blocks is None:
            _fail(manager, room, session, signature)
        elif blocks.count:
            parts.append((room, session, registration, blocks, signature))
    # a captured list that fails to resolve fails nothing: the real send's list fails its room
    prep = [p for p in signed[len(items) :] if p[3] is not None and p[3].count]
    if not _known_sums(pending, manager, parts + prep, written):
        return
    for room, session, registration, _, signature in parts:
        pending.defer(manager, room, session, tables_of(registration), signature)
    if captured:
        _prepared(pending, captured, signed[len(items) :])


def _digest_and_settle(pending: _Pending) -> None:
    """The digest thread's job (and the synchronous design's): digest what is queued, then wait
    for its sums and add them."""
    _digest_pending(pending)
    pending.settle(block=True)


def flush(manager) -> bool:
    """Add every block this worker sent so far to its rooms' sums: the rest of this chunk and
    whatever the digest thread still has queued (earlier chunks included); False (and every
    room this worker has open failed) if the thread did not finish in time."""
    digest = digest_of(manager)
    if digest is None:
        return True
    pending = _pending()
    if digest.windows and not pending.inline:
        pending.prep = None  # the state send went out: its lists are queued
        _digest_window(pending, digest)  # the tail, here: nothing hides it, no hand-over to wait
    else:
        pending.digest()
    if digest.thread.idle or digest.thread.wait(_wait_bound_s()):  # earlier chunks' jobs
        pending.settle(block=True)  # the GPU's sums of this chunk and of earlier ones
        digest.settle_parked(block=True)
        return True
    error = RuntimeError(
        f"the digest thread did not finish this chunk's digest in {_wait_bound_s():g} s "
        f"({'stuck' if digest.thread.alive else 'gone'}; {TIMEOUT_ENV})"
    )
    for room, requests in list(_aux().items()):
        for r in requests:
            _fail(manager, room, r.mooncake_session_id, error)
    return False


def _wait_bound_s() -> float:
    return float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))


def end_chunk(manager) -> None:
    """The worker is done with its chunk: what it queued is digested on the thread (the next
    chunk starts its own, whose bytes are other bytes)."""
    p = getattr(_scope, "pending", None)
    _scope.pending = None
    digest = digest_of(manager)
    if p is not None and digest is not None:
        if digest.windows and not p.inline:
            # its sums are read in a later window or at a status, not waited for here
            if p.items or p.captured is not None:
                digest.thread.submit(_digest_and_park, p, digest)
            else:
                digest.park(p)
        else:
            p.digest()  # a flushed chunk's: nothing left
    _aux().clear()


def _digest_and_park(pending: _Pending, digest: SendDigest) -> None:
    """The digest thread's job for what a worker's chunk queued after its last window."""
    _digest_pending(pending)
    digest.park(pending)


class _Scope:
    """The stock send to one decode rank whose descriptors are being digested."""

    def __init__(self, pending: _Pending, session: str, registration, kind: BufferKind):
        self.manager, self.room, self.session = pending.of, pending.room, session
        self.registration, self.kind = registration, kind
        # Made on the worker thread: what the executor threads it hands sends to digest is
        # queued for that worker's chunk, with that chunk's KV-write events.
        self.pending, self.written = pending, pending.chunk_written

    def add(self, src, dst, length) -> None:
        """sglang's descriptor lists of one ``batch_transfer_sync``, resolved where the chunk is
        digested."""
        self.pending.hand(self.manager, self.room, self.session, self.registration,
                          _Descriptors(self.kind, src, dst, length), self.written)  # fmt: skip


class _ScopedExecutor:
    """sglang's transfer executor, carrying the digest scope into the threads it runs the
    per-layer sends on (its custom-memory-pool path)."""

    def __init__(self, executor, scope: _Scope):
        self._executor, self._scope = executor, scope

    def submit(self, fn, *args, **kwargs):
        scope = self._scope

        def run():
            _scope.value = scope
            try:
                return fn(*args, **kwargs)
            finally:
                _scope.value = None

        return self._executor.submit(run)

    def __getattr__(self, name):
        return getattr(self._executor, name)


class scope:
    """Digest what sglang's send path inside sends to ``session``; ``with scope(...) as ex``
    yields the executor to pass it. Outside a worker chunk, or with the digest off, nothing is
    digested. (A class, not a generator context manager: it runs once per decode rank and send.)"""

    __slots__ = ("_executor", "_current", "_previous")

    def __init__(self, manager, session: str, executor, kind: BufferKind = BufferKind.KV):
        self._executor, self._current = executor, None
        chunk = getattr(_scope, "pending", None)  # this worker's chunk, with the digest on
        if chunk is None or chunk.of is not manager:
            return
        current = chunk.scopes.get((session, kind))
        if current is None:
            registration = (getattr(manager, "decode_kv_args_table", None) or {}).get(session)
            if registration is None:
                return
            current = chunk.scopes[(session, kind)] = _Scope(chunk, session, registration, kind)
        self._current = current

    def __enter__(self):
        if self._current is None:
            return self._executor
        self._previous = getattr(_scope, "value", None)
        _scope.value = self._current
        ex = self._executor
        return _ScopedExecutor(ex, self._current) if ex is not None else ex

    def __exit__(self, *exc):
        if self._current is not None:
            _scope.value = self._previous
        return False


def digest_transfer(engine, session_id, buffers, peer_buffer_addresses, lengths) -> Optional[int]:
    """What ``MooncakeTransferEngine.batch_transfer_sync`` is about to send: digested where a
    digest scope for ``session_id`` is open on this thread (sglang's descriptor lists, resolved
    against the decode's buffers). Runs where ``batch_transfer_sync`` starts. None: sglang's own
    synchronous transfer follows (a large one wakes the digest thread, as the GIL is free while
    Mooncake moves the bytes). An int is the transfer's result, sglang's body skipped: 0 for a
    send run dry on the digest thread (:func:`prepare_states`), whose transfer must not happen;
    else the transfer moved with the worker's chunk digested in its window
    (:func:`_transfer_in_window`)."""
    if captured_transfer(session_id, buffers, peer_buffer_addresses, lengths):
        return 0
    current = getattr(_scope, "value", None)
    own = getattr(_scope, "pending", None)  # the chunk of this thread's worker, if it is one
    if current is not None:
        pending, manager = current.pending, current.manager
        if not (current.session == session_id and len(buffers)
                and getattr(manager, "engine", None) is engine):  # fmt: skip
            current = None  # not this scope's send: nothing to digest
    else:
        pending, manager = own, transfer_chunk.chunk_manager()
    digest = digest_of(manager) if manager is not None else None
    if digest is not None and digest.windows:
        if (
            own is not None
            and pending is own
            and not own.inline
            and (current is not None or own.items or own.prep is not None
                 or own.captured is not None)
            and sum(lengths) >= digest.window_min_bytes
        ):  # fmt: skip
            # its lists are handed over once the bytes move (the window digests them)
            return _transfer_in_window(engine, own, digest, session_id, buffers,
                                       peer_buffer_addresses, lengths, current)  # fmt: skip
        if current is not None:
            current.add(buffers, peer_buffer_addresses, lengths)
        return None
    # the thread's schedule decides on the sessions handed over before this send
    handed_before = (set(pending.handed) if digest is not None and pending is not None
                     and pending.last else _NO_SESSIONS)  # fmt: skip
    if current is not None:
        current.add(buffers, peer_buffer_addresses, lengths)
    if digest is None:
        return None
    nbytes = sum(lengths)
    if nbytes >= WINDOW_MIN_BYTES:
        if (
            pending is not None
            and nbytes >= EAGER_DIGEST_MIN_BYTES
            and pending.digest_during(session_id, handed_before)
        ):
            pending.handed.clear()  # what is queued, digested during this transfer
            pending.digest()
        digest.thread.wake()  # the GIL is free while Mooncake moves the bytes
    return None


def transfer_windows(engine) -> bool:
    """Whether sglang's ``MooncakeTransferEngine`` ``engine`` wraps a Mooncake engine with the
    asynchronous batch API (submit, then a GIL-free wait for completion)."""
    te = getattr(engine, "engine", None)
    return callable(getattr(te, "batch_transfer_async_write", None)) and callable(
        getattr(te, "get_batch_transfer_status", None)
    )


def _transfer_in_window(engine, pending: _Pending, digest: SendDigest, session_id, buffers,
                        peer_buffer_addresses, lengths, scoped=None) -> Optional[int]:  # fmt: skip
    """One transfer of the worker's chunk, submitted to Mooncake asynchronously; while the bytes
    move, the worker hands its lists over (``scoped``: the digest scope they belong to, if any)
    and digests what its chunk queued so far (:func:`_digest_window`), then waits for the
    transfer without the GIL. Its result is sglang's synchronous call's: 0 when every
    descriptor arrived, negative when one failed. None where the submit failed: sglang's own
    synchronous call follows (the same bytes to the same places; its error handling)."""
    te = engine.engine
    try:
        batch = te.batch_transfer_async_write(session_id, buffers, peer_buffer_addresses, lengths)
    except Exception as e:  # noqa: BLE001 - sglang's synchronous call runs and reports
        logger.debug("KV digest: asynchronous submit to %s failed: %r", session_id, e)
        batch = 0
    if scoped is not None:
        scoped.add(buffers, peer_buffer_addresses, lengths)
    if not batch:
        return None
    if not digest.windows_used:
        logger.info("KV checksum: the transfer worker digests inside its transfers (the first: "
                    "%d bytes to %s)", sum(lengths), session_id)  # fmt: skip
    digest.windows_used += 1
    try:
        _digest_window(pending, digest)
    finally:
        try:
            ret = int(te.get_batch_transfer_status([batch]))
        except Exception as e:  # noqa: BLE001 - as sglang's call reports a raising engine
            logger.debug("KV digest: transfer to %s failed: %r", session_id, e)
            ret = -1
    return ret


def _digest_window(pending: _Pending, digest: SendDigest) -> None:
    """The worker's digest while its transfer moves, one engine call per window, which does not
    wait for the GPU: everything queued (with the state lists captured in an earlier window);
    in the first window from the chunk's second with nothing new queued, the room's state send
    also runs dry (:func:`prepare_states`), its lists digested in the next window. Then the sums
    of earlier engine calls whose kernels finished are added to their rooms (this chunk's, and
    chunks parked before it). Never raises into the transfer: a failure fails the chunk's rooms
    with its reason."""
    manager = pending.manager
    pending.windows += 1
    try:
        prep = pending.prep
        due = prep is not None and pending.windows > 1 and pending.nothing_new()
        _digest_pending(pending)
        if due:
            pending.prep, manager = None, prep[0]
            _capture_states(pending, *prep)
        pending.settle(block=False)
        digest.settle_parked(block=False)
    except Exception as e:  # noqa: BLE001 - its rooms fail; the transfer and the server go on
        logger.exception("KV digest in a transfer's window failed")
        room = transfer_chunk.room_of(manager) if manager is not None else None
        for session in sorted(pending.seen) if room is not None else ():
            _fail(manager, room, session, e)


def batch_transfer_sync_around(original, self, session_id, buffers, peer_buffer_addresses,
                               lengths, *args, **kwargs):  # fmt: skip
    done = None if args or kwargs else digest_transfer(self, session_id, buffers,
                                                       peer_buffer_addresses, lengths)  # fmt: skip
    if done is not None:
        return done  # moved with the chunk's digest in its window, or a send run dry (0)
    return original(self, session_id, buffers, peer_buffer_addresses, lengths, *args, **kwargs)


def send_scope(manager, session: str, executor) -> scope:
    """The digest scope of a send of target KV entries to ``session`` (``send_kvcache``,
    ``send_kvcache_slice``); the draft entries are digested from the pool instead
    (:func:`add_draft_blocks`)."""
    return scope(manager, session, executor, BufferKind.KV)


def state_scope(manager, req, executor) -> scope:
    """The digest scope of the room's state send to ``req``'s decode rank
    (``maybe_send_extra``)."""
    return scope(manager, req.mooncake_session_id, executor, BufferKind.STATE)


def maybe_send_extra_around(original, self, req, prefill_state_indices, executor, *args, **kwargs):
    if digest_of(self) is None or getattr(req, "is_dummy", False):
        return original(self, req, prefill_state_indices, executor, *args, **kwargs)
    with state_scope(self, req, executor) as scoped:
        return original(self, req, prefill_state_indices, scoped, *args, **kwargs)


def send_digest_sums(manager, req) -> None:
    """sglang sends the room's status to its decode ranks once the last of them got its aux
    data; just before that last aux, the worker waits for the digest thread to finish the room's
    blocks, and every decode rank of the room gets its sums. Runs where ``send_aux`` starts."""
    digest = digest_of(manager)
    if digest is None or getattr(req, "is_dummy", False):
        return
    room = int(req.room)
    done = _aux().setdefault(room, [])
    done.append(req)
    if len(done) >= int(getattr(req, "required_dst_info_num", 1) or 1):
        verified = flush(manager)  # False: the worker's open rooms failed, naming the thread
        _aux().pop(room, None)
        for r in done if verified else ():
            try:
                _send_contribution(manager, digest.pop(room, r.mooncake_session_id), r)
            except Exception as e:
                _fail(manager, room, r.mooncake_session_id, e)


def send_aux_around(original, self, req, *args, **kwargs):
    send_digest_sums(self, req)
    return original(self, req, *args, **kwargs)


def _send_contribution(manager, contribution: Contribution, req) -> None:
    from sglang.srt.utils.network import NetworkAddress

    na = NetworkAddress(req.endpoint, req.dst_port)
    manager._send_multipart_locked(na.to_tcp(), encode(contribution), is_ipv6=na.is_ipv6)


def begin_chunk(manager, chunk) -> None:
    """A worker takes ``chunk``: its blocks get a :class:`_Pending` of their own; sums of a room
    that already failed are dropped."""
    digest = digest_of(manager)
    if digest is None or chunk is None:
        return
    reqs = _room_requests(manager, chunk.room)
    _scope.pending = _Pending(last=bool(getattr(chunk, "is_last_chunk", False)), ranks=len(reqs),
                              manager=manager, room=int(chunk.room),
                              written=transfer_chunk.written())  # fmt: skip
    statuses = getattr(manager, "request_status", None)
    status = statuses.get(chunk.room) if statuses is not None else None
    if statuses is not None and (status is None or _failed(status)):
        # after the sums its earlier chunks' jobs still add
        digest.thread.submit(digest.forget_room, chunk.room)
        return
    prepare_states(manager, chunk, reqs)


def _room_requests(manager, room) -> list:
    """The room's non-dummy decode requests in sglang's ``transfer_infos``, in the order the
    transfer worker sends to them (none when the room has no entry there)."""
    table = getattr(manager, "transfer_infos", None)
    infos = (table.get(room) if table is not None else None) or {}
    return [r for r in infos.values() if not getattr(r, "is_dummy", False)]


def _failed(status) -> bool:
    from sglang.srt.disaggregation.base.conn import KVPoll

    return status == KVPoll.Failed


def begin_digest_chunk(manager, chunk) -> None:
    """sglang's transfer worker takes ``chunk``, its KV written (the worker synchronised its
    events): this thread's chunk (``transfer_chunk``) and its digest."""
    if digest_of(manager) is not None:
        transfer_chunk.begin(manager, chunk)
        begin_chunk(manager, chunk)


def end_digest_chunk(manager) -> None:
    """The worker's loop over the chunk's decode ranks ended, however it ended."""
    if digest_of(manager) is not None:
        end_chunk(manager)
        transfer_chunk.end()


_DRAFT_ATTR = "_dflash_kv_digest_draft"  # on a decode's KVArgsRegisterInfo: (send, entries)
_interned_digest_entries: dict = {}
_interned_lock = threading.Lock()


def draft_digest_entries_of(kv_args, plan) -> Optional[DigestEntries]:
    """The KV digest's view of the draft entries ``plan`` (a decode registration's verdict)
    makes this rank write, or None where it writes none. Decode ranks holding the same heads get
    the same object, so a chunk builds and digests their blocks once."""
    pair = plan.pair
    if pair is None or not pair.writer or not plan.action.sends_draft:
        return None
    entries = plan.entries
    made = digest_entries(pair, [e.component for e in entries],
                          [kv_args.kv_data_ptrs[e.src_index] for e in entries],
                          [e.dst_index for e in entries])  # fmt: skip
    key = tuple(a.tobytes() if isinstance(a, np.ndarray) else a for a in made)
    with _interned_lock:
        return _interned_digest_entries.setdefault(key, made)


def _draft_entries(manager, registration, send) -> Optional[DigestEntries]:
    cached = getattr(registration, _DRAFT_ATTR, None)
    if cached is None or cached[0] is not send:
        cached = (send, draft_digest_entries_of(manager.kv_args, send.plan))
        setattr(registration, _DRAFT_ATTR, cached)
    return cached[1]


_OWN = object()


def add_draft_blocks(manager, session: str, send, src_pages, dst_pages, entries=_OWN) -> None:
    """Digest what one draft send (``draft_kv_send.send_draft_entries``) writes to ``session``:
    the pool rows the plan writes, at their decode slots, whatever the regime (a packed slab is a
    copy; digesting the pool also catches a pack that read stale rows). ``entries``: the
    registration's :func:`draft_digest_entries_of` where the caller keeps it with its send
    table, else made once per registration here. Raises where a page id is out of the pool's
    range (the digest reads the pool there)."""
    if digest_of(manager) is None:
        return
    memo = transfer_chunk.memo()  # the chunk's pages, checked once for its decode ranks
    checked = ("pages checked", id(src_pages), send.page_bound)
    if memo.get(checked) is not src_pages:  # the memo keeps the array, so its id is not reused
        send.check_pages(src_pages)
        memo[checked] = src_pages
    registration = manager.decode_kv_args_table.get(session)
    if entries is _OWN:
        entries = _draft_entries(manager, registration, send)
    if entries is None:
        return
    chunk = getattr(_scope, "pending", None)
    if chunk is not None and chunk.of is manager:
        chunk.hand(manager, chunk.room, session, registration,
                   DraftPart(entries, src_pages, dst_pages, memo), chunk.chunk_written)  # fmt: skip


def _chunk_bytes(memo: dict, pages: np.ndarray) -> bytes:
    """``pages.tobytes()``, once per array for the chunk (``memo``: the worker's chunk memo,
    which keeps the array alive, so its id is not reused while the chunk lasts): the draft send
    passes every decode rank the chunk's same page arrays."""
    key = ("page bytes", id(pages))
    hit = memo.get(key)
    if hit is None or hit[0] is not pages:
        hit = memo[key] = (pages, pages.tobytes())
    return hit[1]


class DraftPart:
    """The blocks of one draft send, built where the chunk is digested, once per chunk for the
    decode ranks that share ``entries`` (interned by :func:`draft_digest_entries_of`); its
    signature names them without hashing them (``memo``: the sending worker's chunk memo). Both
    are made where the chunk is digested, not in the send (a window, with Mooncake's
    asynchronous API), so the send hands over references only."""

    __slots__ = ("entries", "src_pages", "dst_pages", "memo", "_signature")

    def __init__(self, entries: DigestEntries, src_pages, dst_pages, memo):
        self.entries, self.src_pages, self.dst_pages, self.memo = entries, src_pages, dst_pages, memo
        self._signature = None

    @property
    def signature(self) -> Tuple:
        if self._signature is None:
            memo = self.memo
            self._signature = ("draft", id(self.entries), _chunk_bytes(memo, self.src_pages),
                               _chunk_bytes(memo, self.dst_pages))  # fmt: skip
        return self._signature

    def blocks(self) -> Blocks:
        blocks = self.memo.get(self.signature)
        if blocks is None:
            blocks = self.memo[self.signature] = digest_blocks_of(self.entries, self.src_pages,
                                                                  self.dst_pages)  # fmt: skip
        return blocks


# -- startup ---------------------------------------------------------------------------------


def _is_dflash(scheduler) -> bool:
    algorithm = getattr(scheduler, "spec_algorithm", None)
    return algorithm is not None and bool(getattr(algorithm, "is_dflash", lambda: False)())


def composes_digest(queue) -> bool:
    """``--disaggregation-enable-kv-checksum`` on a DFLASH Mooncake prefill (``queue``: its
    ``PrefillBootstrapQueue``, the KV manager built)."""
    from sglang.srt.runtime_context import get_disagg

    backend = getattr(queue, "transfer_backend", None)
    return bool(
        get_disagg().disaggregation_enable_kv_checksum
        and _is_dflash(getattr(queue, "scheduler", None))
        and str(getattr(backend, "name", backend)).upper() == "MOONCAKE"
        and getattr(queue, "kv_manager", None) is not None
    )


def start_send_digest(queue) -> None:
    """Where :func:`composes_digest`: build the digest engine (kernel compiled, buffers
    allocated, before serving) and its thread, and turn stock's whole-request digest off on this
    prefill (it digests this rank's own KV range, which a decode can compare only at the same TP
    width and without PP; the composed digest covers that layout too). Runs once
    ``PrefillBootstrapQueue.__init__`` built the KV manager and stock's digest."""
    if not composes_digest(queue):
        return
    manager = queue.kv_manager
    reason = unsupported_state(manager.kv_args)
    if reason is not None:
        raise RuntimeError(reason)
    from sglang_dflash_pp.srt.disaggregation.kv_digest_engine import DigestEngine

    device = getattr(queue.token_to_kv_pool, "device", "cpu")
    # calls in flight at once: a last chunk's windows each submit one, read at the status
    engine = DigestEngine(device, lanes=SEND_LANES)
    sender = Sender(int(manager.pp_rank), int(manager.attn_tp_rank),
                    int(manager._prefill_unique_rank()))  # fmt: skip
    digest = SendDigest(engine, sender)
    digest.windows = transfer_windows(getattr(manager, "engine", None))
    setattr(manager, _ENGINE_ATTR, digest)
    queue.scheduler.kv_checksum_computer = None
    logger.info(
        "KV checksum: composed digest on %s (%s), %s; stock's same-layout digest is off on "
        "this prefill, the decode verifies every layout",
        sender.describe(),
        engine.describe(),
        f"digested by the worker inside its transfers of at least {digest.window_min_bytes} "
        "bytes (Mooncake's asynchronous batch API)" if digest.windows else
        "digested on a thread during the transfers (this Mooncake has no asynchronous batch API)",
    )


def prefill_queue_init_after(result, self, *args, **kwargs):
    if not composes_digest(self):
        return None
    require_hooks()
    start_send_digest(self)
    return None


def peer_refusal(manager, registration) -> Optional[str]:
    """Why this decode's transfers cannot be digested here, or None: the send paths whose
    descriptors the digest does not see (DCP relayout packs on the prefill, the staging copy)."""
    if digest_of(manager) is None:
        return None
    staged = bool(getattr(manager, "enable_staging", False)) and (
        getattr(registration, "staging_base_ptr", 0) or getattr(registration, "staging_total_size", 0)
    )
    if getattr(registration, "requires_dcp_relayout", False) or staged:
        path = "DCP relayout" if getattr(registration, "requires_dcp_relayout", False) else (
            "SGLANG_DISAGG_STAGING_BUFFER")
        return (
            f"--disaggregation-enable-kv-checksum cannot verify transfers through {path} (the "
            "composed KV digest does not see them); run this decode without it, or without the "
            "checksum flag on both servers"
        )
    return None


# The send hooks of mooncake_draft_kv open the digest scopes and mark the worker's chunk.
_SCOPE_OPENERS = tuple(f"MooncakeKVManager.{m}" for m in ("send_kvcache", "send_kvcache_slice",
                                                            "transfer_worker"))  # fmt: skip


def require_hooks() -> None:
    openers = [h for h in registered_hooks() if h.target.endswith(_SCOPE_OPENERS)]
    require_applied(HOOKS + tuple(openers),
                    "--disaggregation-enable-kv-checksum on a DFLASH Mooncake prefill")  # fmt: skip


_MANAGER = "sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager"

HOOKS = (
    PluginHook(
        "sglang.srt.disaggregation.prefill.PrefillBootstrapQueue.__init__",
        prefill_queue_init_after,
        "after",
        "KV checksum on a DFLASH Mooncake prefill: the composed digest replaces stock's",
    ),
    PluginHook(
        "sglang.srt.distributed.device_communicators.mooncake_transfer_engine."
        "MooncakeTransferEngine.batch_transfer_sync",
        batch_transfer_sync_around,
        "around",
        "digest the descriptors sglang sends to a decode rank, where a digest scope is open",
    ),
    PluginHook(
        f"{_MANAGER}.maybe_send_extra",
        maybe_send_extra_around,
        "around",
        "digest the KDA / Mamba state sent to a decode rank",
    ),
    PluginHook(
        f"{_MANAGER}.send_aux",
        send_aux_around,
        "around",
        "send a decode rank this prefill rank's digest sums before its aux data and status",
    ),
)
