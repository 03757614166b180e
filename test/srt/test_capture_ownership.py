"""The feature-ownership rule (pure), on the production geometry and on every refusal."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_dflash_pp.srt.models.capture_ownership import (
    OwnershipError,
    compute_feature_ownership,
    owning_layer,
)

KIMI_K3_LAYERS = 93
KIMI_K3_IDS = [19, 37, 54, 66, 78, 90]


def even_partition(num_layers, pp_size):
    """sglang's default split (``get_pp_indices`` without SGLANG_PP_LAYER_PARTITION): the last
    ``num_layers % pp_size`` stages get one extra layer. Checked against the real function in
    test_pp_partition_matches_sglang."""
    base, extra = divmod(num_layers, pp_size)
    sizes = [base + (1 if s >= pp_size - extra else 0) for s in range(pp_size)]
    starts = [sum(sizes[:s]) for s in range(pp_size)]
    return [(a, a + n) for a, n in zip(starts, sizes)]


def test_pp_partition_matches_sglang(monkeypatch):
    from sglang.srt.distributed.utils import get_pp_indices

    monkeypatch.delenv("SGLANG_PP_LAYER_PARTITION", raising=False)
    for layers in (8, 61, 93, 96):
        for pp in range(1, 9):
            assert even_partition(layers, pp) == [get_pp_indices(layers, r, pp) for r in range(pp)]


def test_kimi_k3_pp8_owns_one_feature_on_stages_1_3_4_5_6_7():
    ownership = compute_feature_ownership(
        even_partition(KIMI_K3_LAYERS, 8), KIMI_K3_IDS, KIMI_K3_LAYERS
    )
    assert [s.features for s in ownership.stages] == [(), (0,), (), (1,), (2,), (3,), (4,), (5,)]
    assert [s.layer_ids for s in ownership.stages][1] == (19,)
    assert [ownership.sends_partial(s) for s in range(8)] == [False] + [True] * 6 + [False]
    assert [ownership.receives_partial(s) for s in range(8)] == [False, False] + [True] * 6


def test_final_layer_is_owned_by_the_last_stage():
    ownership = compute_feature_ownership([(0, 4), (4, 8)], [3, 7], 8)
    # Layer 3's output is read where layer 4 runs (stage 1); layer 7 (final) at the final norm.
    assert [s.features for s in ownership.stages] == [(), (0, 1)]


def test_capture_at_the_stage_boundary_moves_to_the_next_stage():
    ownership = compute_feature_ownership([(0, 4), (4, 8)], [2, 3, 7], 8)
    assert [s.features for s in ownership.stages] == [(0,), (1, 2)]


@settings(deadline=None)  # a slow example on a loaded CI box is no failure
@given(
    num_layers=st.integers(2, 120),
    pp_size=st.integers(1, 8),
    data=st.data(),
)
def test_every_feature_is_owned_once_by_the_stage_holding_its_reading_layer(num_layers, pp_size, data):
    if pp_size > num_layers:
        pp_size = num_layers
    stages = even_partition(num_layers, pp_size)
    last_start = stages[-1][0]
    ids = sorted(
        data.draw(st.sets(st.integers(0, num_layers - 1), min_size=1, max_size=8))
    )
    if owning_layer(ids[-1], num_layers) < last_start:
        with pytest.raises(OwnershipError, match="SGLANG_PP_LAYER_PARTITION"):
            compute_feature_ownership(stages, ids, num_layers)
        return
    ownership = compute_feature_ownership(stages, ids, num_layers)
    owned = [j for s in ownership.stages for j in s.features]
    assert owned == list(range(len(ids)))  # each once, in fc column order
    for j, layer in enumerate(ids):
        start, end = stages[ownership.owner_of(j)]
        assert start <= min(layer + 1, num_layers - 1) < end


@pytest.mark.parametrize(
    "stages, ids, layers, fragment",
    [
        ([(0, 4), (4, 8)], [1, 2], 8, "last PP stage (layers [4, 8)) captures none"),
        ([(0, 4), (4, 8)], [1, 8], 8, "outside the target's [0, 8)"),
        ([(0, 4), (4, 8)], [-1, 7], 8, "outside the target's [0, 8)"),
        ([(0, 4), (5, 8)], [1, 7], 8, "contiguous, non-empty stages"),
        ([(0, 4), (4, 4), (4, 8)], [1, 7], 8, "contiguous, non-empty stages"),
        ([(0, 4), (4, 7)], [1, 6], 8, "cover [0, 7) of the target's 8 layers"),
        ([(0, 4), (4, 8)], [5, 1, 7], 8, "out of order"),
        ([(0, 4), (4, 8)], [5, 5, 7], 8, "duplicates [5]"),
        ([(0, 8)], [], 8, "no target_layer_ids"),
    ],
)
def test_refusals_name_the_fix(stages, ids, layers, fragment):
    with pytest.raises(OwnershipError) as info:
        compute_feature_ownership(stages, ids, layers)
    assert fragment in str(info.value)


def test_last_stage_refusal_suggests_the_partition():
    with pytest.raises(OwnershipError) as info:
        compute_feature_ownership([(0, 4), (4, 8)], [1, 2], 8)
    assert "starts at layer 3 or earlier" in str(info.value)
