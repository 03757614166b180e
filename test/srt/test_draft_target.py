"""Static checks of a DFlash draft against its target, on real config pairs.

The Kimi-K3 example pair (the user's configs) and a Llama target with a byte-level tokenizer and
its DFlash draft pass; then each mismatch is made in a copy of one side and must be refused with
its own message, through ``sglang-dflash-pp check-draft`` and through ``check``.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

import tiny_models
from sglang_dflash_pp.cli import main
from sglang_dflash_pp.tools.draft_target import check_draft

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "python", "sglang_dflash_pp",
                       "examples", "kimi_k3")  # fmt: skip
K3_TARGET, K3_DRAFT = os.path.join(EXAMPLE, "target"), os.path.join(EXAMPLE, "draft")


def edited(tmp_path, source: str, name: str, edit) -> str:
    """A copy of ``source`` whose config.json ``edit`` changed."""
    path = str(tmp_path / name)
    shutil.copytree(source, path)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    edit(config)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


def refusals(findings) -> dict:
    return {f.check: f.message for f in findings if f.refused}


@pytest.fixture(scope="module")
def llama_pair(tmp_path_factory):
    """The e2e tests' Llama target (byte tokenizer, 512 tokens, 4 layers) and DFlash draft."""
    root = tmp_path_factory.mktemp("pair")
    target = tiny_models.write_model_dir(str(root / "target"), dict(
        tiny_models.llama_target_config(), vocab_size=512, num_hidden_layers=4,
        max_position_embeddings=4096))  # fmt: skip
    tiny_models.write_byte_tokenizer(target)
    draft = tiny_models.write_model_dir(str(root / "draft"), dict(
        tiny_models.dflash_draft_config((0, 1, 2)), vocab_size=512, num_target_layers=4,
        hidden_size=tiny_models.llama_target_config()["hidden_size"],
        max_position_embeddings=4096))  # fmt: skip
    return target, draft


def test_the_kimi_k3_example_pair_passes_with_its_facts():
    findings = check_draft(K3_TARGET, K3_DRAFT, pp_size=8, context_length=262144)
    assert refusals(findings) == {}
    notes = {f.check: f.message for f in findings}
    assert "captured at PP8 by stages [1, 3, 4, 5, 6, 7]" in notes["target_layer_ids"]
    assert "sliding window of 4096 tokens on 6 of 6 layers" in notes["layer types"]
    assert "rope_scaling" in notes["RoPE"]  # yarn on the draft, none on the target: noted


def test_the_llama_pair_with_its_tokenizer_passes(llama_pair):
    target, draft = llama_pair
    findings = check_draft(target, draft)
    assert refusals(findings) == {}
    notes = {f.check: f.message for f in findings}
    assert notes["tokenizer"] == "the draft ships no tokenizer: it uses the target's"
    assert "'<|mask|>'" in notes["mask token"]


@pytest.mark.parametrize("side, edit, check, message", [
    ("draft", lambda c: c.update(vocab_size=163841), "vocabulary",
     "the draft's vocab_size is 163841, the target's 163840"),
    ("draft", lambda c: c.update(hidden_size=4096), "hidden size",
     "the draft's hidden_size is 4096, the target's 7168"),
    ("draft", lambda c: c.update(num_target_layers=61), "target layers",
     "trained on a target of 61 layers (num_target_layers); this target has 93"),
    ("draft", lambda c: c["dflash_config"].update(target_layer_ids=[19, 37, 93]),
     "target_layer_ids", "target_layer_ids[2]=93, target_num_layers=93"),
    ("draft", lambda c: c["dflash_config"].update(mask_token_id=163840), "mask token",
     "DFLASH mask_token_id is outside the target vocab size. mask_token_id=163840, "
     "vocab_size=163840."),
    ("draft", lambda c: c.update(layer_types=["sliding_attention"] * 5), "layer types",
     "the draft has 6 layers but 5 layer_types"),
    ("draft", lambda c: c.pop("sliding_window"), "layer types",
     "DFLASH sliding_attention layers require config.sliding_window."),
    ("draft", lambda c: c.update(max_position_embeddings=131072), "RoPE",
     "the draft's max_position_embeddings is 131072, the target serves 262144 positions"),
    ("target", lambda c: c["text_config"].update(num_hidden_layers=61), "target layers",
     "this target has 61"),
], ids=["vocab", "hidden", "num-target-layers", "layer-id", "mask-id", "layer-types", "window",
        "rope-positions", "target-layers"])  # fmt: skip
def test_each_mismatch_is_refused_with_its_message(tmp_path, side, edit, check, message):
    target, draft = K3_TARGET, K3_DRAFT
    if side == "draft":
        draft = edited(tmp_path, K3_DRAFT, "draft", edit)
    else:
        target = edited(tmp_path, K3_TARGET, "target", edit)
    got = refusals(check_draft(target, draft))
    assert check in got and message in got[check], got


def test_block_size_against_the_servers_draft_tokens():
    got = refusals(check_draft(K3_TARGET, K3_DRAFT, num_draft_tokens=8))
    assert got == {"block size": "--speculative-num-draft-tokens 8, but the draft was trained "
                   "with block_size 16: leave the flag unset (it resolves from block_size) or "
                   "set 16"}  # fmt: skip
    assert refusals(check_draft(K3_TARGET, K3_DRAFT, num_draft_tokens=16)) == {}


def test_a_draft_tokenizer_other_than_the_targets_is_refused(tmp_path, llama_pair):
    target, draft = llama_pair
    other = str(tmp_path / "draft")
    shutil.copytree(draft, other)
    tiny_models.write_byte_tokenizer(other)
    assert "tokenizer" not in refusals(check_draft(target, other))  # the same tokenizer
    with open(os.path.join(other, "tokenizer.json")) as f:
        tok = json.load(f)
    vocab = tok["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]  # two tokens trade ids
    with open(os.path.join(other, "tokenizer.json"), "w") as f:
        json.dump(tok, f)
    got = refusals(check_draft(target, other))
    assert "differs from the target's in 2 token(s)" in got["tokenizer"], got


def test_a_mask_token_the_tokenizer_places_elsewhere_is_refused(tmp_path, llama_pair):
    target, draft = llama_pair
    moved = edited(tmp_path, draft, "draft", lambda c: c["dflash_config"].update(
        mask_token="<|mask|>", mask_token_id=300))  # fmt: skip
    got = refusals(check_draft(target, moved))
    assert got == {"mask token": "DFLASH config mismatch: dflash_config.mask_token_id conflicts "
                   "with tokenizer vocab id for dflash_config.mask_token. mask_token='<|mask|>', "
                   "mask_token_id=300, tokenizer_vocab_id=260. (sglang's "
                   "DFlashWorkerV2._resolve_mask_token_id)"}  # fmt: skip


def test_a_mask_token_the_tokenizer_lacks_is_added_as_the_server_adds_it(tmp_path, llama_pair):
    """sglang adds a missing mask token to the target's tokenizer: a note where the target's
    vocabulary has room for it, refused where it has not (the byte tokenizer fills 512)."""
    target, draft = llama_pair

    def new_mask(c):
        c["dflash_config"]["mask_token"] = "<|new mask|>"
        c["dflash_config"].pop("mask_token_id", None)

    full = refusals(check_draft(target, edited(tmp_path, draft, "draft", new_mask)))
    assert full["mask token"].startswith("DFLASH mask_token_id is outside the target vocab "
                                         "size. mask_token_id=512, vocab_size=512."), full
    roomy = edited(tmp_path, target, "roomy", lambda c: c.update(vocab_size=640))
    draft = edited(tmp_path, draft, "draft640", lambda c: (c.update(vocab_size=640), new_mask(c)))
    findings = check_draft(roomy, draft)
    assert refusals(findings) == {}
    note = [f.message for f in findings if f.check == "mask token"]
    assert note == ["mask token id 512 ('<|new mask|>'), not in the target's tokenizer: the "
                    "server adds it"], note


def test_check_runs_them_and_check_draft_exits_by_them(tmp_path, capsys, patched_sglang):
    bad = edited(tmp_path, K3_DRAFT, "draft", lambda c: c.update(vocab_size=1000))
    code = main(["check-draft", "--target", K3_TARGET, "--draft", bad, "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 4 and not out["matches_target"]
    assert [f["check"] for f in out["findings"] if f["refused"]] == ["vocabulary"]
    assert main(["check-draft", "--target", K3_TARGET, "--draft", K3_DRAFT]) == 0
    assert "No refusal." in capsys.readouterr().out
    code = main(["check", "--json", "--example", "kimi-k3", "--",
                 "--speculative-draft-model-path", bad])  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    assert code == 4 and report["accepted"] and not report["draft_matches_target"]
    assert [f["check"] for f in report["draft_target"] if f["refused"]] == ["vocabulary"]
