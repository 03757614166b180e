"""PRs 4 to 7 of the stack: the DFLASH draft KV over Mooncake, head-aware.

Only our code and the anchors it hooks onto are written here (see :mod:`.stack`). The logic is
our modules moved in-tree (``draft_kv_registration`` is the plugin's registration check, called
by its hook and, in-tree, by ``MooncakeKVManager._validate_peer_state_layout``); the upstream
functions get a few lines that call it.
"""

from __future__ import annotations

import ast
from typing import Dict, Tuple

from sglang_dflash_pp.tools.export_patches.cst_edits import (
    AddImport,
    AddKeywordArgument,
    AddParameter,
    IfTest,
    InsertStatements,
    ReplaceExpression,
    ReplaceKeywordArgument,
    Stmt,
)
from sglang_dflash_pp.tools.export_patches.new_modules import NewModule, our_module_path
from sglang_dflash_pp.tools.export_patches.new_tests import NewTest
from sglang_dflash_pp.tools.export_patches.pr import PR

_DISAGG = "sglang_dflash_pp.srt.disaggregation"
REGISTRATION_MODULE = "sglang.srt.disaggregation.mooncake.draft_kv_registration"
SEND_MODULE = "sglang.srt.disaggregation.mooncake.draft_kv_send"
CONN = "srt/disaggregation/mooncake/conn.py"
_WORKER = "MooncakeKVManager.transfer_worker"


def in_tree_docstring(module: str, *, without: str) -> str:
    """Our module's docstring without its paragraphs that mention ``without`` (the plugin's
    wiring), so the in-tree text is the same prose, not a copy kept in step by hand."""
    with open(our_module_path(module)) as f:
        doc = ast.get_docstring(ast.parse(f.read()), clean=False) or ""
    paragraphs = [p for p in doc.strip("\n").split("\n\n") if without not in p]
    return "\n\n".join(paragraphs)


# -- PR 4 ------------------------------------------------------------------------------------

DRAFT_KV_SOURCE_DOC = """\
The DFLASH draft KV pool behind a prefill rank's draft transfer entries, as the transfer layer
needs it (``KVArgs.draft_kv_source``, filled where ``_init_kv_manager`` appends the draft pool).

``KVArgs`` carries the entries' pointers and item lengths but not the draft's geometry (total KV
heads, head dims, element size): from an item length alone the prefill cannot tell how many
heads a decode rank holds. A pool this module cannot describe (not a plain NHD
``MHATokenToKVPool``, or an unknown head count) has ``shape`` None and the reason, and is served
only to a decode with the prefill's own layout."""

REGISTRATION_DOC = """\
The DFLASH draft KV verdict of one decode registration, from what a Mooncake prefill manager
holds.

The verdict itself is pure (``disaggregation/draft_kv_peer.py``); this module reads its inputs
off ``MooncakeKVManager`` and the decode's ``KVArgsRegisterInfo``: the entry pairs the send path
uses for the peer, the copy the transfer worker picks for its target entries, and whether this
rank's KV is skipped for it. ``_validate_peer_state_layout`` calls
:func:`draft_kv_layout_mismatch` after its own checks, so a refusal goes through
``state_layout_rejections`` and every request to that decode fails, naming the setting to
change, before a byte is written.

``head_aware``: whether this prefill can send each decode rank its own draft heads. Until it
can, every verdict but STOCK (equal heads per rank, or a layout the whole-page copy serves
exactly) is refused: the whole-page copy writes those peers wrong bytes, silently."""

PR_4 = PR(
    "4",
    new_modules=(
        NewModule(f"{_DISAGG}.column_arrays"),
        NewModule(f"{_DISAGG}.draft_kv_geometry"),
        NewModule(f"{_DISAGG}.draft_kv_plan"),
        NewModule(f"{_DISAGG}.draft_kv_peer"),
        NewModule(
            f"{_DISAGG}.draft_kv_source",
            drop=("_sources", "_sources_lock", "record_draft_kv_source", "draft_kv_source_for"),
            docstring=DRAFT_KV_SOURCE_DOC,
        ),
        NewModule(
            f"{_DISAGG}.draft_kv_registration",
            target=REGISTRATION_MODULE,
            docstring=REGISTRATION_DOC,
        ),
    ),
    edits=(
        # KVArgs carries the draft's geometry
        AddImport(
            "srt/disaggregation/base/conn.py",
            module="sglang.srt.disaggregation.draft_kv_source",
            names=("DraftKVSource",),
        ),
        InsertStatements(
            "srt/disaggregation/base/conn.py",
            "KVArgs",
            after=Stmt("num_draft_entries: int = 0"),
            code="""
            # A DFLASH draft pool behind those entries and its KV geometry, which their item
            # lengths alone do not give (how many heads a rank holds); None without one.
            draft_kv_source: Optional[DraftKVSource] = None
            """,
        ),
        # ... filled where the prefill appends the draft pool
        AddImport(
            "srt/disaggregation/prefill.py",
            module="sglang.srt.disaggregation.draft_kv_source",
            names=("describe_draft_pool", "draft_total_kv_heads"),
        ),
        InsertStatements(
            "srt/disaggregation/prefill.py",
            "PrefillBootstrapQueue._init_kv_manager",
            after=Stmt("num_draft_entries = len(draft_kv_data_ptrs)"),
            code="""
            if self.scheduler.spec_algorithm.is_dflash():
                # The decode registration check needs the draft's KV geometry.
                kv_args.draft_kv_source = describe_draft_pool(
                    draft_kv_pool, draft_total_kv_heads(self.scheduler, draft_kv_pool)
                )
            """,
        ),
        # ... and read by the registration check
        AddImport(
            "srt/disaggregation/mooncake/conn.py",
            module=REGISTRATION_MODULE,
            names=("draft_kv_layout_mismatch",),
        ),
        InsertStatements(
            "srt/disaggregation/mooncake/conn.py",
            "MooncakeKVManager._validate_peer_state_layout",
            before=Stmt("return fully_checked, None"),
            code="""
            # The DFLASH draft band, refused where this prefill cannot send it as the decode
            # holds it (the heads per rank of each side are read off its item lengths).
            draft_mismatch = draft_kv_layout_mismatch(
                self,
                registration_info,
                self.kv_args.draft_kv_source,
                head_aware=(),
            )
            if draft_mismatch is not None:
                return False, draft_mismatch
            """,
        ),
    ),
    note=(
        "The prefill describes its DFLASH draft pool (total KV heads, head dims, element size) "
        "in KVArgs where it appends the pool's entries, and the Mooncake registration check "
        "decides, after its own checks, what each decode peer's draft KV needs, from the item "
        "lengths the decode already publishes. Until the send is head-aware (the next PR), "
        "every verdict but STOCK is refused through state_layout_rejections, naming the "
        "setting to change: those are the layouts stock 0.5.23 writes wrong bytes for, "
        "silently. Equal heads per rank, and every deployment without a DFLASH draft, are "
        "served as before. Tested on the patched tree without the plugin: a Kimi-K3-shaped "
        "prefill TP4 refuses a decode TP32 rank and accepts a TP4 one."
    ),
)

# -- PR 5 ------------------------------------------------------------------------------------

_SEND = f"{_DISAGG}.draft_kv_send"

PR_5 = PR(
    "5",
    new_modules=(
        NewModule(_SEND, target=SEND_MODULE, docstring=in_tree_docstring(_SEND, without="plugin")),
    ),
    edits=(
        AddImport(CONN, module="sglang.srt.disaggregation.draft_kv_peer",
                  names=("PeerAction", "TargetPath")),  # fmt: skip
        AddImport(
            CONN,
            module=SEND_MODULE,
            names=(
                "draft_dst_pages",
                "draft_send_of",
                "fail_room",
                "room_failed",
                "send_draft_entries",
                "sends_draft_despite_skip",
                "target_entries",
            ),
        ),
        # the registration check serves head-aware verdicts beside the whole-page copy
        ReplaceKeywordArgument(
            CONN, "MooncakeKVManager._validate_peer_state_layout", call="draft_kv_layout_mismatch",
            keyword="head_aware", old="()", value="(TargetPath.WHOLE_PAGES,)",
        ),  # fmt: skip
        # the draft band by its plan, the target entries by the whole-page copy below
        InsertStatements(
            CONN,
            "MooncakeKVManager.send_kvcache",
            after=Stmt(
                "self._validate_envelope_kv_layout(dst_kv_ptrs, dst_kv_item_len, dst_attn_tp_size)"
            ),
            code="""
            draft_send = draft_send_of(self, mooncake_session_id)
            if draft_send is not None:
                # Other draft heads per rank on this decode: each side's own item length.
                ret = send_draft_entries(
                    self,
                    draft_send,
                    mooncake_session_id,
                    dst_kv_ptrs,
                    prefill_kv_indices,
                    draft_dst_pages(dst_kv_indices, dst_device_kv_indices),
                    room=room,
                )
                if (
                    ret != 0
                    or draft_send.plan.action is PeerAction.DRAFT_ONLY
                    or room_failed(self, room)
                ):
                    return ret
            kv_entries = target_entries(self.kv_args, draft_send)
            """,
        ),
        # ... told its room, which a local failure of the draft send fails (not the session)
        AddParameter(CONN, "MooncakeKVManager.send_kvcache", name="room",
                     annotation="Optional[int]"),  # fmt: skip
        AddKeywordArgument(CONN, _WORKER, call="self.send_kvcache", keyword="room",
                           value="kv_chunk.room"),  # fmt: skip
        # ... on the entries it sends
        *(
            ReplaceKeywordArgument(
                CONN,
                "MooncakeKVManager.send_kvcache",
                call="self._send_kvcache_generic",
                keyword=keyword,
                old=f"self.kv_args.{upstream}",
                value=f"kv_entries.{ours}",
            )
            for keyword, upstream, ours in (
                ("src_data_ptrs", "kv_data_ptrs", "ptrs"),
                ("item_lens", "kv_item_lens", "item_lens"),
                ("src_layer_ids", "kv_layer_ids", "layer_ids"),
            )
        ),
        # a rank whose replicated target KV is skipped still sends the draft heads it alone has
        InsertStatements(
            CONN,
            "MooncakeKVManager._get_dsa_cache_transfer_skip_flags",
            after=IfTest("info is not None and self.attn_tp_size > info.dst_attn_tp_size"),
            code="""
            if skip_kv and sends_draft_despite_skip(info):
                skip_kv = False  # its draft heads are sharded, not replicated
            """,
        ),
    ),
    note=(
        "A decode with other draft KV heads per rank than the prefill, behind the whole-page "
        "copy of send_kvcache (MLA and hybrid-MLA targets, or equal attention TP), is now "
        "served: the registration's verdict is kept with its record, and the first send "
        "builds its table (draft_send_of). send_kvcache then sends the draft band by the plan, "
        "each side addressed with its own item length (one descriptor per destination page "
        "run where rows match, per token row otherwise, in batches below "
        "SGLANG_DFLASH_DRAFT_KV_MAX_BATCH_DESCRIPTORS), and the target entries through its own "
        "copy on the entry list without the draft band, so the bounded index batches and "
        "HiSparse device pages keep working. With a hybrid-MLA target and a smaller decode TP "
        "a DRAFT_ONLY rank is no longer skipped. A plain-MHA target at another attention TP "
        "(send_kvcache_slice) stays refused until PR 7; equal heads stay byte-identical. A "
        "local failure of the draft send (a page id out of range, a decode that re-registered "
        "during a transfer) fails the chunk's room through conclude_failure and returns 0, so "
        "transfer_worker, which now passes send_kvcache the room, does not mark a healthy "
        "decode's session failed; a transport failure returns its code as before, and no "
        "exception reaches the transfer thread. "
        "Tested on the patched tree without the plugin: the real Mooncake engine over TCP "
        "on 127.0.0.1 (test_draft_kv_loopback's decode peer checks every byte against the "
        "heads each decode rank owns), TP4 -> TP32, TP2 -> TP1 and TP4 -> TP4."
    ),
)

# -- PR 7 ------------------------------------------------------------------------------------

_SLICE = "MooncakeKVManager.send_kvcache_slice"

PR_7 = PR(
    "7",
    edits=(
        AddImport(CONN, module=SEND_MODULE, names=("decode_target_entries",)),
        ReplaceKeywordArgument(
            CONN, "MooncakeKVManager._validate_peer_state_layout", call="draft_kv_layout_mismatch",
            keyword="head_aware", old="(TargetPath.WHOLE_PAGES,)", value="tuple(TargetPath)",
        ),  # fmt: skip
        InsertStatements(
            CONN,
            _SLICE,
            at="start",
            code="""
            draft_send = draft_send_of(self, mooncake_session_id)
            if draft_send is not None:
                # The draft band follows its plan; the slicing below, made for the target's
                # heads, sees the target entries of both sides only.
                target = decode_target_entries(draft_send, dst_kv_ptrs, dst_layer_ids)
                if target is None:
                    return fail_room(self, room, mooncake_session_id,
                                     "the decode's draft entries are not its last entries")
                ret = send_draft_entries(
                    self,
                    draft_send,
                    mooncake_session_id,
                    dst_kv_ptrs,
                    prefill_kv_indices,
                    dst_kv_indices,
                    room=room,
                )
                if ret != 0 or room_failed(self, room):
                    return ret
                dst_kv_ptrs, dst_layer_ids = target
            kv_entries = target_entries(self.kv_args, draft_send)
            """,
        ),
        AddParameter(CONN, _SLICE, name="room", annotation="Optional[int]"),
        AddKeywordArgument(CONN, _WORKER, call="self.send_kvcache_slice", keyword="room",
                           value="kv_chunk.room"),  # fmt: skip
        ReplaceExpression(CONN, _SLICE, old="self.kv_args.kv_data_ptrs", new="kv_entries.ptrs"),
        ReplaceExpression(
            CONN, _SLICE, old="self.kv_args.kv_layer_ids", new="kv_entries.layer_ids"
        ),
        ReplaceExpression(
            CONN,
            _SLICE,
            old="any(item_len != src_kv_item_len for item_len in self.kv_args.kv_item_lens)",
            new="any(item_len != src_kv_item_len for item_len in kv_entries.item_lens)",
        ),
    ),
    note=(
        "A plain-MHA target (Llama, Qwen3, ...) whose attention TP differs from the decode's "
        "goes through send_kvcache_slice, which slices every entry with the target's head "
        "count: wrong for a draft with other heads, and stock refuses entries of unequal item "
        "lengths outright (-1). The registration now serves head-aware verdicts on that copy "
        "too: the draft band is sent by the draft's own plan, and the slicing sees the target "
        "entries of both sides only (its K/V split without layer ids, and its id pairing, are "
        "then exact). Without a DFLASH draft, or for a STOCK verdict, the function runs as "
        "before. Tested on the patched tree without the plugin: a plain-MHA prefill TP2 rank "
        "sends a decode TP4 rank its own target and draft heads, byte for byte."
    ),
)

# -- PR 6 ------------------------------------------------------------------------------------

STAGING_DOC = """\
The DFLASH draft KV pack staging of one prefill rank: sized, allocated, compiled at startup
(:func:`with_pack_staging`, from ``PrefillBootstrapQueue._init_kv_manager``, into
``KVArgs.draft_kv_source.staging``), registered with the transfer engine after the KV manager's
own regions (:func:`register_staging`, from ``MooncakeKVManager.register_buffer_to_engine``) and
deregistered with them (:func:`deregister_staging`, from ``deregister_buffer_to_engine``).

Why at startup: a buffer allocated at the first request lands after the KV pool took its share
of the memory, fails there instead of at startup, and a failed allocation or registration
inside a decode's registration would be taken for a layout the decode cannot be served. The
same goes for the fused pack kernel: compiling it, or capturing a graph, while serving stalls
the transfer thread and (a capture) disables the allocator's free-and-retry on the device for
the scheduler's forward. So everything a pack uses exists before the server reports ready: the
buffer (from Mooncake's custom memory pool when ``SGLANG_MOONCAKE_CUSTOM_MEM_POOL`` is set, as
sglang's own staging buffers are, which NVLink / MNNVL transports need), one slot per transfer
queue with its stream and row-index buffers, and every pack this rank can be asked for, run once
and captured into CUDA graphs for every slot and row bucket (``PreparedPacks.warm``; the eager
launch costs the host more than the kernel takes, measured on an H200).

Size: one slot packs a whole transfer chunk of ``max_prefill_buffer_tokens()`` tokens (the
``--chunked-prefill-size`` ceiling sglang sizes its prefill buffers by) in one step:
``(chunk pages + 1) x page size x`` this rank's draft KV bytes per token
(``draft_kv_pack.pack_slot_bytes``): 48.4 MiB per slot, 193.5 MiB for 4 transfer queues, on a
Kimi-K3 TP4 prefill rank at 8192 tokens. ``SGLANG_DFLASH_DRAFT_KV_PACK_BUFFER_MB`` sets the
total instead; a slot that cannot hold a chunk's slices together is warned about at startup
(such chunks are packed one slice at a time, or per decode rank in page windows, and a decode
whose page does not fit a slot is sent per token row). A rank holding one draft head per rank
never packs (no decode holds fewer) and gets no buffer.

Stdlib and torch at import; sglang is read lazily."""

_PACKED = f"{_DISAGG}.draft_kv_packed_send"
PACKED_SEND_MODULE = "sglang.srt.disaggregation.mooncake.draft_kv_packed_send"
SEND_FILE = "srt/disaggregation/mooncake/draft_kv_send.py"  # PR 5's module
PREFILL = "srt/disaggregation/prefill.py"
_STAGING_CHECK = "self.kv_args.draft_kv_source is not None"

DRAFT_KV_PLAN_TEST_DOC = """\
The head-aware draft KV plan (``disaggregation/draft_kv_plan.py``), on every (prefill TP,
decode TP, heads) combination, simulated byte by byte.

Every byte of every prefill rank's draft pool gets a unique identity; the plan's descriptors (and,
for the packed path, the real pack function of ``draft_kv_pack``) run against a tiny address
space that, like Mooncake, refuses any range outside a registered buffer; then every decode
rank's pool is checked: each byte of each sent page holds the right identity and was written
exactly once, nothing else was written, and the bytes moved equal the decode rank's own draft
bytes. No server, no transfer engine."""

PR_6 = PR(
    "6",
    new_modules=(
        NewModule(f"{_DISAGG}.draft_kv_pack"),
        NewModule(f"{_DISAGG}.draft_kv_pack_triton"),
        NewModule(f"{_DISAGG}.draft_kv_chunk_packs"),
        NewModule(
            f"{_DISAGG}.draft_kv_staging",
            drop=("_staging_of", "register_buffer_to_engine_around",
                  "deregister_buffer_to_engine_around", "_MANAGER", "HOOKS"),  # fmt: skip
            docstring=STAGING_DOC,
        ),
        NewModule(
            _PACKED,
            target=PACKED_SEND_MODULE,
            docstring=in_tree_docstring(_PACKED, without="plugin"),
        ),
    ),
    edits=(
        # the staging, built where the prefill describes its draft pool (PR 4)
        AddImport(PREFILL, module="sglang.srt.disaggregation.draft_kv_staging",
                  names=("with_pack_staging",)),  # fmt: skip
        InsertStatements(
            PREFILL,
            "PrefillBootstrapQueue._init_kv_manager",
            after=Stmt(
                "kv_args.draft_kv_source = describe_draft_pool("
                "draft_kv_pool, draft_total_kv_heads(self.scheduler, draft_kv_pool))"
            ),
            code="""
            if self.transfer_backend == TransferBackend.MOONCAKE:
                # The draft KV pack staging (a decode of more ranks gets a slice
                # of this rank's heads), built before the KV manager registers it.
                kv_args.draft_kv_source = with_pack_staging(
                    kv_args.draft_kv_source,
                    draft_kv_pool.page_size,
                    get_parallel().attn_tp_size,
                    get_parallel().attn_tp_rank,
                )
            """,
        ),
        # ... registered and deregistered with the KV manager's regions
        AddImport(CONN, module="sglang.srt.disaggregation.draft_kv_staging",
                  names=("deregister_staging", "register_staging")),  # fmt: skip
        InsertStatements(
            CONN,
            "MooncakeKVManager.register_buffer_to_engine",
            at="end",
            code=f"""
            # The DFLASH draft KV pack staging, where this rank packs.
            if {_STAGING_CHECK}:
                register_staging(self.engine, self.kv_args.draft_kv_source.staging)
            """,
        ),
        InsertStatements(
            CONN,
            "MooncakeKVManager.deregister_buffer_to_engine",
            at="end",
            code=f"""
            if {_STAGING_CHECK}:
                deregister_staging(self.kv_args.draft_kv_source.staging)
            """,
        ),
        # the worker's chunk packs, handed to each send of the chunk and released after it
        AddImport(CONN, module=PACKED_SEND_MODULE, names=("ChunkDraftPacks",)),
        InsertStatements(
            CONN,
            _WORKER,
            after=Stmt(
                "reqs_to_be_processed = (self.transfer_infos[kv_chunk.room].values() "
                "if kv_chunk.room in self.transfer_infos else [])"
            ),
            code="""
            # The chunk's draft head slices, packed once for all its decode ranks.
            draft_packs = ChunkDraftPacks(self, kv_chunk)
            """,
        ),
        InsertStatements(
            CONN,
            _WORKER,
            before=IfTest("staging_deferred"),
            code="""
            draft_packs.release()  # the chunk's pack slot, however its loop ended
            """,
        ),
        *(
            AddKeywordArgument(CONN, _WORKER, call=call, keyword="draft_packs",
                               value="draft_packs")  # fmt: skip
            for call in ("self.send_kvcache", "self.send_kvcache_slice")
        ),
        *(
            edit
            for symbol in ("MooncakeKVManager.send_kvcache", _SLICE)
            for edit in (
                AddParameter(CONN, symbol, name="draft_packs",
                             annotation="Optional[ChunkDraftPacks]"),  # fmt: skip
                AddKeywordArgument(CONN, symbol, call="send_draft_entries", keyword="packs",
                                   value="draft_packs"),  # fmt: skip
            )
        ),
        # PR 5's draft send packs where it is given the chunk's packs
        AddParameter(SEND_FILE, "send_draft_entries", name="packs"),
        InsertStatements(
            SEND_FILE,
            "send_draft_entries",
            before=Stmt("return send_from_pool(manager, send, session, src_pages, dst_pages)"),
            code="""
            if packs is not None:  # the transfer worker's chunk packs (draft_kv_packed_send)
                return packs.send(manager, send, session, src_pages, dst_pages)
            """,
        ),
    ),
    tests=(
        # PR 4's plan and geometry, with the pack function this PR adds; the check that the
        # plugin's pure modules import without sglang stays in this repository
        NewTest(
            "test/srt/test_draft_kv_plan.py",
            "test/registered/unit/disaggregation/test_draft_kv_plan.py",
            est_time=30,
            drop=("test_pure_modules_import_without_sglang",),
            docstring=DRAFT_KV_PLAN_TEST_DOC,
        ),
    ),
    note=(
        "Performance only: no byte a decode receives changes. A decode whose TP is larger "
        "than the prefill's holds a slice of each prefill rank's draft heads, which PR 5 sends "
        "one descriptor per token row straight from the pool. The prefill rank now packs the "
        "slice into a staging buffer allocated, compiled (the Triton gather on GPU, torch's "
        "index_select elsewhere) and registered with the transfer engine at startup, and "
        "sends one descriptor per destination page run. transfer_worker makes the chunk's "
        "packs (ChunkDraftPacks) for each chunk and hands them to every send of the chunk: "
        "the first send gathers every distinct head slice the chunk's decode ranks need in "
        "one launch (Kimi-K3 TP4 -> TP32: 2 slices for 8 decode ranks), the others send from "
        "the same slab, and the slot is given back after the last reader or when the loop "
        "over the chunk's decode ranks ends. A slice that does not fit the chunk's slot is "
        "packed alone in page windows; with every slot held, or a page too large for a slot, "
        "the send goes per token row as before. Staging memory: "
        "SGLANG_DFLASH_DRAFT_KV_PACK_BUFFER_MB, by default one chunk per transfer queue. "
        "Tested on the patched tree without the plugin: the real Mooncake engine over TCP, "
        "TP4 -> TP32, every byte of 8 decode ranks checked, one descriptor per page run."
    ),
)

PRS: Tuple[PR, ...] = (PR_4, PR_5, PR_7, PR_6)

UNFINISHED: Dict[str, str] = {}
