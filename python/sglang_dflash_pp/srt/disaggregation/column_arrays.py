"""Parallel-array NamedTuples (transfer descriptors, digest blocks) joined column by column: one
owner for the join both use. numpy only."""

from __future__ import annotations

import numpy as np


def concat_columns(cls, parts):
    """``parts`` of the NamedTuple ``cls`` (columns of equal length, an ``empty()``), joined."""
    parts = [p for p in parts if p[0].size]
    if not parts:
        return cls.empty()
    return cls(*(np.concatenate([getattr(p, f) for p in parts]) for f in cls._fields))
