"""What the last PP stage passes to sglang's draft-worker builder (pure, no sglang import).

Stock ``DFlashWorkerV2.__init__`` builds its draft with ``build_draft_tp_worker(...)`` and no
``random_seed`` / ``load_group``. A draft that exists on the last PP stage only cannot use those
defaults:

* ``random_seed=None`` makes the draft ``TpModelWorker`` broadcast the seed over the WORLD CPU
  group (managers/tp_worker.py). The other stages never enter that broadcast (they build no draft
  and go on to size their KV cache, an all-reduce over the same group), so the server deadlocks
  at startup. The seed the broadcast would return is the one the target worker of this very
  process already received from the same broadcast, with every stage taking part: we pass it.
* the default load group is the world group for loaders that synchronise (InstantTensor); the
  last stage alone would wait for the others forever. We pass the stage-local group, captured
  before ``draft_pp_context`` (inside it ``pp_size`` reads 1), as stock DSpark does.

``PPDFlashWorkerV2`` sets these around its ``super().__init__`` on the last stage, with the
features that stage captures (the KV-write-only draft build, ``models/kv_write_draft``, reads
them); ``build_draft_tp_worker`` applies the seed and the load group to that one call.
"""

from __future__ import annotations

import contextvars
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence, Tuple


@dataclass(frozen=True)
class LastStageDraftBuild:
    load_group: Any
    random_seed: int
    features: Tuple[int, ...] = ()  # the draft features this stage captures


_current: contextvars.ContextVar = contextvars.ContextVar(
    "dflash_last_stage_draft_build", default=None
)


@contextmanager
def last_stage_draft_build(
    load_group: Any, random_seed: int, features: Sequence[int] = ()
) -> Iterator[None]:
    build = LastStageDraftBuild(load_group, int(random_seed), tuple(int(f) for f in features))
    token = _current.set(build)
    try:
        yield
    finally:
        _current.reset(token)


def current_draft_build() -> Optional[LastStageDraftBuild]:
    return _current.get()
