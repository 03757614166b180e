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


def fail_next_draft_send(original, *args, **kwargs):
    """``original(manager, send plan, session, src pages, dst pages, ...)``."""
    directory = os.environ.get(ENV)
    if directory:
        try:
            os.remove(os.path.join(directory, TRIGGER))
        except FileNotFoundError:
            pass
        else:
            session = args[2] if len(args) > 2 else kwargs.get("session")
            record = {"pid": os.getpid(), "session": str(session), "time": time.time(), **_ranks()}
            path = os.path.join(directory, f"injected-{os.getpid()}-{next(_count)}.json")
            with open(path + ".tmp", "w") as f:
                json.dump(record, f)
            os.replace(path + ".tmp", path)
            raise RuntimeError(MESSAGE)
    return original(*args, **kwargs)


DIGEST_TARGET = "sglang_dflash_pp.srt.disaggregation.kv_digest_send._send_contribution"
DIGEST_TRIGGER = "drop-next-digest"


def drop_next_digest(original, manager, contribution, req, *args, **kwargs):
    directory = os.environ.get(ENV)
    if directory:
        try:
            os.remove(os.path.join(directory, DIGEST_TRIGGER))
        except FileNotFoundError:
            pass
        else:
            record = {"pid": os.getpid(), "room": int(contribution.room), "time": time.time(),
                      "session": str(req.mooncake_session_id), **_ranks()}  # fmt: skip
            path = os.path.join(directory, f"dropped-{os.getpid()}-{next(_count)}.json")
            with open(path + ".tmp", "w") as f:
                json.dump(record, f)
            os.replace(path + ".tmp", path)
            return None
    return original(manager, contribution, req, *args, **kwargs)


HOOKS = (
    (TARGET, fail_next_draft_send, "around"),
    (DIGEST_TARGET, drop_next_digest, "around"),
)
