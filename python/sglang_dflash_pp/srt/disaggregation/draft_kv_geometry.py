"""Where one PD side keeps its DFlash draft KV: which heads a TP rank holds and at which bytes.

Stdlib only, so the plan and the pack code can run where sglang is not installed.

The draft KV pool is sglang's ``MHATokenToKVPool`` in NHD layout. Each draft layer registers
two transfer entries, K then V, and one page of an entry is token-major:
``S`` token rows of ``h`` heads x ``head_dim`` elements of ``b`` bytes. Byte ``k`` of local
head ``j`` of token ``t`` of page ``pg`` therefore sits at ``pg*S*h*d*b + t*h*d*b + j*d*b + k``.

Heads are sharded the way ``QKVParallelLinear`` shards KV heads over attention TP ``T``:
``h = max(1, H // T)`` heads per rank; with ``T > H`` every head is replicated on
``R = T // H`` consecutive ranks, and rank ``q`` holds heads ``[(q // R) * h, (q // R + 1) * h)``.
That needs ``T`` to divide ``H`` or ``H`` to divide ``T``; any other pair is rejected here.

A decode peer publishes only per-entry item lengths, never head counts, so
:meth:`DraftKVGeometry.from_item_lengths` derives its geometry from those lengths and the
draft's shape, and says which setting differs when they disagree.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from fractions import Fraction
from typing import List


class DraftKVLayoutError(ValueError):
    """A draft KV layout that cannot be served; the message says what to change."""


class KVComponent(enum.Enum):
    K = "K"
    V = "V"


@dataclass(frozen=True)
class DraftKVShape:
    """The draft's KV heads, independent of parallelism: the same on both PD sides."""

    total_heads: int
    k_head_dim: int
    v_head_dim: int
    dtype_bytes: int

    def __post_init__(self) -> None:
        for name in ("total_heads", "k_head_dim", "v_head_dim", "dtype_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise DraftKVLayoutError(f"draft KV {name} must be a positive int, got {value!r}")

    def head_dim(self, component: KVComponent) -> int:
        return self.k_head_dim if component is KVComponent.K else self.v_head_dim

    def describe(self) -> str:
        dims = (
            f"head_dim {self.k_head_dim}"
            if self.k_head_dim == self.v_head_dim
            else f"K head_dim {self.k_head_dim}, V head_dim {self.v_head_dim}"
        )
        return f"{self.total_heads} KV heads, {dims}, {self.dtype_bytes}-byte elements"


def draft_entry_components(num_draft_entries: int) -> List[KVComponent]:
    """The component of each draft transfer entry: sglang's MHA pool registers K0..K(L-1), then
    V0..V(L-1)."""
    half = num_draft_entries // 2
    return [KVComponent.K] * half + [KVComponent.V] * (num_draft_entries - half)


def check_page_ids(pages, num_pages: int) -> None:
    """Refuse page ids outside a pool of ``num_pages`` before anything reads them: a GPU kernel
    faulting there is sticky and takes the stage down, a descriptor there fails the transfer."""
    if pages.size and (int(pages.min()) < 0 or int(pages.max()) >= num_pages):
        raise IndexError(
            f"draft KV page ids {int(pages.min())}..{int(pages.max())} outside the pool's "
            f"{num_pages} pages"
        )


def heads_divide_check(side: str, tp_size: int, total_heads: int) -> None:
    if total_heads % tp_size and tp_size % total_heads:
        lower = max(d for d in range(1, total_heads + 1) if total_heads % d == 0 and d <= tp_size)
        raise DraftKVLayoutError(
            f"{side} attention TP {tp_size} and the draft's {total_heads} KV heads: neither "
            f"divides the other, so the draft heads cannot be sharded over the {side} ranks. "
            f"Use a {side} attention TP that divides {total_heads} (e.g. {lower}) or is a "
            f"multiple of it (e.g. {total_heads * -(-tp_size // total_heads)})."
        )


@dataclass(frozen=True)
class DraftKVGeometry:
    """Draft KV geometry of one TP rank on one PD side."""

    side: str  # "prefill" or "decode", only for messages
    tp_size: int
    tp_rank: int
    total_heads: int
    k_head_dim: int
    v_head_dim: int
    dtype_bytes: int
    page_size: int

    def __post_init__(self) -> None:
        DraftKVShape(self.total_heads, self.k_head_dim, self.v_head_dim, self.dtype_bytes)
        if self.tp_size <= 0 or self.page_size <= 0:
            raise DraftKVLayoutError(
                f"{self.side} attention TP ({self.tp_size}) and page size ({self.page_size}) "
                "must be positive"
            )
        if not 0 <= self.tp_rank < self.tp_size:
            raise DraftKVLayoutError(
                f"{self.side} attention TP rank {self.tp_rank} is outside TP size {self.tp_size}"
            )
        heads_divide_check(self.side, self.tp_size, self.total_heads)

    @classmethod
    def for_rank(
        cls, shape: DraftKVShape, *, side: str, tp_size: int, tp_rank: int, page_size: int
    ) -> "DraftKVGeometry":
        return cls(
            side=side,
            tp_size=tp_size,
            tp_rank=tp_rank,
            total_heads=shape.total_heads,
            k_head_dim=shape.k_head_dim,
            v_head_dim=shape.v_head_dim,
            dtype_bytes=shape.dtype_bytes,
            page_size=page_size,
        )

    @classmethod
    def from_item_lengths(
        cls,
        shape: DraftKVShape,
        *,
        side: str,
        tp_size: int,
        tp_rank: int,
        page_size: int,
        k_item_len: int,
        v_item_len: int,
    ) -> "DraftKVGeometry":
        """The geometry a side's registered per-page item lengths describe, or a refusal.

        ``page_size`` and ``shape`` are what this prefill runs with; a side whose pages are
        laid out differently cannot be written head by head, so the refusal names the knob.
        """
        geometry = cls.for_rank(
            shape, side=side, tp_size=tp_size, tp_rank=tp_rank, page_size=page_size
        )
        expected = {c: geometry.page_bytes(c) for c in KVComponent}
        actual = {KVComponent.K: int(k_item_len), KVComponent.V: int(v_item_len)}
        if actual != expected:
            raise DraftKVLayoutError(geometry._item_length_mismatch(actual, expected))
        return geometry

    @property
    def shape(self) -> DraftKVShape:
        return DraftKVShape(self.total_heads, self.k_head_dim, self.v_head_dim, self.dtype_bytes)

    # -- ownership -------------------------------------------------------------------------

    @property
    def heads_per_rank(self) -> int:
        return max(1, self.total_heads // self.tp_size)

    @property
    def replication(self) -> int:
        """How many ranks of this side hold the same heads."""
        return max(1, self.tp_size // self.total_heads)

    @property
    def head_start(self) -> int:
        return (self.tp_rank // self.replication) * self.heads_per_rank

    @property
    def owned_heads(self) -> range:
        return range(self.head_start, self.head_start + self.heads_per_rank)

    # -- bytes -----------------------------------------------------------------------------

    def head_dim(self, component: KVComponent) -> int:
        # Not through ``shape``: it validates a new DraftKVShape, and the send path asks per entry.
        return self.k_head_dim if component is KVComponent.K else self.v_head_dim

    def head_bytes(self, component: KVComponent) -> int:
        return self.head_dim(component) * self.dtype_bytes

    def row_bytes(self, component: KVComponent) -> int:
        """One token of one entry: all heads this rank holds."""
        return self.heads_per_rank * self.head_bytes(component)

    def page_bytes(self, component: KVComponent) -> int:
        """sglang's per-page ``item_len`` of the entry."""
        return self.page_size * self.row_bytes(component)

    def same_shape(self, other: "DraftKVGeometry") -> bool:
        return self.shape == other.shape and self.page_size == other.page_size

    def describe(self) -> str:
        return (
            f"{self.side} attention TP {self.tp_size} rank {self.tp_rank}: "
            f"{self.heads_per_rank} of {self.total_heads} draft KV heads per rank "
            f"({format_heads(self.owned_heads)})"
        )

    # -- diagnosis -------------------------------------------------------------------------

    def _item_length_mismatch(self, actual, expected) -> str:
        S, b, h = self.page_size, self.dtype_bytes, self.heads_per_rank
        parts = [
            f"{c.value}={actual[c]} B (expected {expected[c]} B)"
            for c in KVComponent
            if actual[c] != expected[c]
        ]
        head = (
            f"The {self.side}'s draft KV pages are {', '.join(parts)}: expected = page size {S} "
            f"x {h} head(s) per rank ({self.total_heads} draft KV heads over {self.side} "
            f"attention TP {self.tp_size}) x head_dim x {b}-byte elements."
        )
        ratios = {c: Fraction(actual[c], expected[c]) for c in KVComponent}
        causes: List[str] = []
        if ratios[KVComponent.K] != ratios[KVComponent.V]:
            for c in KVComponent:
                if ratios[c] != 1:
                    dim = Fraction(actual[c], S * h * b)
                    causes.append(
                        f"the {self.side} draft has {c.value} head_dim "
                        f"{_fmt(dim)} where this prefill's has {self.head_dim(c)} "
                        "(different draft checkpoints)"
                    )
        else:
            ratio = ratios[KVComponent.K]
            # A prefill is checked against the page size and element size its own pool reports.
            peer = self.side != "prefill"
            if peer and (S * ratio).denominator == 1:
                causes.append(
                    f"--page-size {_fmt(S * ratio)} on the {self.side} server instead of {S}"
                )
            if peer and (b * ratio).denominator == 1:
                causes.append(
                    f"{_fmt(b * ratio)}-byte draft KV elements on the {self.side} server "
                    f"instead of {b}-byte (--kv-cache-dtype)"
                )
            heads = Fraction(actual[KVComponent.K], S * self.head_bytes(KVComponent.K))
            if heads.denominator == 1:
                causes.append(
                    f"{_fmt(heads)} draft KV head(s) per {self.side} rank instead of {h} "
                    "(a different draft checkpoint, or draft heads sharded over another TP "
                    "size, e.g. with attention data parallelism)"
                )
        found = f" Consistent with: {'; or '.join(causes)}." if causes else ""
        return (
            f"{head}{found} Run both servers with the same "
            "--page-size, --kv-cache-dtype and --speculative-draft-model-path."
        )


def format_heads(heads: range) -> str:
    if len(heads) == 1:
        return f"head {heads.start}"
    return f"heads {heads.start}-{heads.stop - 1}"


def _fmt(x: Fraction) -> str:
    return str(x.numerator) if x.denominator == 1 else f"{float(x):g}"
