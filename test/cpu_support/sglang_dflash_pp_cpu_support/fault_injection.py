"""Test-only: fail one prefill-side draft KV send, or drop one KV digest message, when a test
asks for it.

Enabled by ``SGLANG_DFLASH_PP_TEST_FAULT_DIR=<dir>`` (registered by the test-support plugin only
when that variable is set). AROUND the product's
``sglang_dflash_pp.srt.disaggregation.mooncake_draft_kv._send_draft_entries``, the body of one
prefill rank's draft KV send to one decode rank (the product's ``send_draft_entries`` calls it
through the module global, inside its own error handling, from sglang's transfer worker thread).

While ``<dir>/fail-next-draft-send`` does not exist every call runs unchanged. When it exists,
the next call in this process removes it and raises :data:`MESSAGE` instead of running (the
removal is the claim: of several racing calls exactly one wins), after writing
``<dir>/injected-<pid>-<n>.json`` (rank, Mooncake session, time) so the test can check that the
injection fired exactly once and where.

Likewise AROUND the product's ``sglang_dflash_pp.srt.disaggregation.kv_digest_send.
_send_contribution`` (one prefill rank's KV digest message to one decode rank, called through
the module global): while ``<dir>/drop-next-digest`` exists, the next call removes it and sends
nothing (recorded as ``dropped-<pid>-<n>.json``): a sender that never delivers its sums.
Nothing else is changed.
"""

from __future__ import annotations

import itertools
import json
import os
import time

ENV = "SGLANG_DFLASH_PP_TEST_FAULT_DIR"
TARGET = "sglang_dflash_pp.srt.disaggregation.mooncake_draft_kv._send_draft_entries"
TRIGGER = "fail-next-draft-send"
MESSAGE = "test-injected prefill-side failure in the draft KV send"
_count = itertools.count()


def _ranks() -> dict:
    try:
        from sglang.srt.runtime_context import get_parallel

        p = get_parallel()
        return {"pp_rank": p.pp_rank, "tp_rank": p.tp_rank}
    except Exception:  # the record is informative only
        return {}


def _claim(trigger: str, tag: str, record: dict) -> bool:
    """Remove ``<dir>/<trigger>`` if it exists (the claim: of racing callers one wins) and record
    the claim as ``<dir>/<tag>-<pid>-<n>.json``."""
    directory = os.environ.get(ENV)
    if not directory:
        return False
    try:
        os.remove(os.path.join(directory, trigger))
    except FileNotFoundError:
        return False
    path = os.path.join(directory, f"{tag}-{os.getpid()}-{next(_count)}.json")
    with open(path + ".tmp", "w") as f:
        json.dump({"pid": os.getpid(), "time": time.time(), **_ranks(), **record}, f)
    os.replace(path + ".tmp", path)
    return True


def fail_next_draft_send(original, *args, **kwargs):
    """``original(manager, send plan, session, src pages, dst pages, ...)``."""
    session = args[2] if len(args) > 2 else kwargs.get("session")
    if _claim(TRIGGER, "injected", {"session": str(session)}):
        raise RuntimeError(MESSAGE)
    return original(*args, **kwargs)


DIGEST_TARGET = "sglang_dflash_pp.srt.disaggregation.kv_digest_send._send_contribution"
DIGEST_TRIGGER = "drop-next-digest"


def drop_next_digest(original, manager, contribution, req, *args, **kwargs):
    record = {"room": int(contribution.room), "session": str(req.mooncake_session_id)}
    if _claim(DIGEST_TRIGGER, "dropped", record):
        return None
    return original(manager, contribution, req, *args, **kwargs)


HOOKS = (
    (TARGET, fail_next_draft_send, "around"),
    (DIGEST_TARGET, drop_next_digest, "around"),
)
