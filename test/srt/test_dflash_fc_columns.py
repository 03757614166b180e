"""Reading fc column blocks from generated safetensors draft checkpoints."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

import tiny_models
from sglang_dflash_pp.srt.models.dflash_fc_columns import (
    DraftCheckpointError,
    load_fc_column_blocks,
)

H = tiny_models.HIDDEN
K = 4


def _fc(seed=0):
    return torch.randn(H, K * H, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _checkpoint(tmp_path, name, tensors, shards=1):
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(tiny_models.dflash_draft_config()))
    if shards == 1:
        save_file(tensors, str(path / "model.safetensors"))
        return str(path)
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::shards]}
        save_file(part, str(path / file))
        weight_map.update({n: file for n in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return str(path)


def _other_weights():
    return {
        "layers.0.self_attn.q_proj.weight": torch.zeros(4 * 16, H, dtype=torch.bfloat16),
        "hidden_norm.weight": torch.ones(H, dtype=torch.bfloat16),
    }


@pytest.mark.parametrize("name", ["fc.weight", "model.fc.weight", "encoder.fc.weight"])
@pytest.mark.parametrize("shards", [1, 3])
def test_exact_columns_under_every_alias(tmp_path, monkeypatch, name, shards):
    import sglang_dflash_pp.srt.models.dflash_fc_columns as fc_columns

    monkeypatch.setattr(fc_columns, "_ROW_BAND", 7)  # several bands, a ragged last one
    fc = _fc()
    draft = _checkpoint(tmp_path, "draft", {name: fc, **_other_weights()}, shards=shards)
    for features in ([0], [1, 2], [3], [0, 1, 2, 3]):
        block = load_fc_column_blocks(draft, features, H, K)
        expected = fc[:, features[0] * H : (features[-1] + 1) * H]
        assert block.shape == (H, len(features) * H)
        assert block.dtype == torch.bfloat16
        assert torch.equal(block, expected)


def test_columns_equal_what_the_real_draft_loader_loads(tmp_path, single_process_dist):
    """The stock ``DFlashDraftModel.load_weights`` resolves the same alias to the same fc."""
    from sglang.srt.models.dflash import DFlashDraftModel
    from sglang.srt.utils.hf_transformers_utils import get_config

    fc = _fc(seed=5).float()
    draft = _checkpoint(tmp_path, "draft", {"encoder.fc.weight": fc})
    model = DFlashDraftModel(get_config(draft, trust_remote_code=True))
    model.load_weights([("encoder.fc.weight", fc)])
    for features in ([0], [2, 3]):
        cols = slice(features[0] * H, (features[-1] + 1) * H)
        assert torch.equal(load_fc_column_blocks(draft, features, H, K), model.fc.weight[:, cols])


def test_missing_fc_names_the_aliases(tmp_path):
    draft = _checkpoint(tmp_path, "draft", _other_weights())
    with pytest.raises(DraftCheckpointError) as info:
        load_fc_column_blocks(draft, [0], H, K)
    message = str(info.value)
    assert "no fc weight" in message and "encoder.fc.weight" in message
    assert "--speculative-draft-model-path" in message


def test_missing_fc_in_a_sharded_checkpoint(tmp_path):
    draft = _checkpoint(tmp_path, "draft", _other_weights(), shards=2)
    with pytest.raises(DraftCheckpointError, match="model.safetensors.index.json"):
        load_fc_column_blocks(draft, [0], H, K)


def test_wrongly_shaped_fc_is_refused(tmp_path):
    draft = _checkpoint(tmp_path, "draft", {"fc.weight": torch.zeros(H, 3 * H)})
    with pytest.raises(DraftCheckpointError) as info:
        load_fc_column_blocks(draft, [0], H, K)
    message = str(info.value)
    assert f"shape ({H}, {3 * H}), expected ({H}, {K * H})" in message
    assert "4 context features" in message


def test_non_consecutive_features_are_a_programming_error(tmp_path):
    draft = _checkpoint(tmp_path, "draft", {"fc.weight": _fc()})
    with pytest.raises(ValueError, match="not consecutive"):
        load_fc_column_blocks(draft, [0, 2], H, K)


def test_reads_only_the_requested_columns(tmp_path):
    """Memory cost is one [H, H] block per owned feature, not the whole fc."""
    draft = _checkpoint(tmp_path, "draft", {"fc.weight": _fc()})
    block = load_fc_column_blocks(draft, [2], H, K)
    assert block.untyped_storage().nbytes() == H * H * 2
    assert torch.equal(block, _fc()[:, 2 * H : 3 * H])
    assert os.path.exists(os.path.join(draft, "model.safetensors"))
