"""Static checks of a DFlash draft against its target: what no server reports later.

A draft that does not belong to its target never changes a greedy output token (the target
verifies every draft token); it only lowers acceptance, silently. The mismatches that do that
are in the two checkpoints' configs and tokenizers, so they are checked from the files, before
launch, with no GPU: the vocabulary and tokenizer, the mask token, ``target_layer_ids`` (and,
under PP, which stage captures each), RoPE, the block size against
``--speculative-num-draft-tokens``, layer types and sliding window, hidden size and dtypes.

sglang's own parser reads the draft's DFlash fields (``parse_dflash_draft_config``,
``get_dflash_layer_types``, ``get_dflash_attention_sliding_window_size``), so a draft is read
the way the server reads it. Each finding is a refusal (with what to change) or a note.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import asdict, dataclass
from types import SimpleNamespace
from typing import List, Optional

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token", "mask_token")


@dataclass(frozen=True)
class Finding:
    check: str
    refused: bool
    message: str


def read_config(path: str) -> dict:
    """The checkpoint's ``config.json`` as written (a directory or a hub id), which is what
    sglang's DFlash readers take."""
    from transformers import PretrainedConfig

    return PretrainedConfig.get_config_dict(path)[0]


def _text(config: dict) -> dict:
    return config.get("text_config", config)


def check_draft(
    target_path: str,
    draft_path: str,
    *,
    tokenizer_path: Optional[str] = None,
    num_draft_tokens: Optional[int] = None,
    context_length: Optional[int] = None,
    pp_size: int = 1,
    trust_remote_code: bool = False,
) -> List[Finding]:
    """Every finding for this draft/target pair, refusals first."""
    from sglang.srt.speculative.dflash_utils import (
        get_dflash_attention_sliding_window_size,
        get_dflash_layer_types,
        parse_dflash_draft_config,
    )

    out: List[Finding] = []

    def refuse(check: str, message: str) -> None:
        out.append(Finding(check, True, message))

    def note(check: str, message: str) -> None:
        out.append(Finding(check, False, message))

    draft_full, target = read_config(draft_path), _text(read_config(target_path))
    draft = _text(draft_full)
    try:
        cfg = parse_dflash_draft_config(draft_hf_config=draft_full)
    except ValueError as e:
        refuse("draft config", f"{e} (sglang's parse_dflash_draft_config)")
        return out

    vocab = int(target["vocab_size"])
    if draft.get("vocab_size") != vocab:
        refuse("vocabulary", f"the draft's vocab_size is {draft.get('vocab_size')}, the "
               f"target's {vocab}: the draft reads the target's embeddings and LM head; use "
               "the draft trained for this target")  # fmt: skip
    if draft.get("hidden_size") != target.get("hidden_size"):
        refuse("hidden size", f"the draft's hidden_size is {draft.get('hidden_size')}, the "
               f"target's {target.get('hidden_size')}: its fc projects the target's hidden "
               "states; use the draft trained for this target")  # fmt: skip

    layers = int(target["num_hidden_layers"])
    if cfg.num_target_layers is not None and cfg.num_target_layers != layers:
        refuse("target layers", f"the draft was trained on a target of {cfg.num_target_layers} "
               f"layers (num_target_layers); this target has {layers}")  # fmt: skip
    try:
        ids = cfg.resolve_target_layer_ids(target_num_layers=layers)
    except ValueError as e:
        refuse("target_layer_ids", f"{e} Use the draft trained for this target.")
    else:
        where = f"target_layer_ids {ids} of {layers} layers"
        if pp_size > 1:
            from sglang.srt.speculative.dflash_pp import feature_stages

            stages = feature_stages(ids, layers, pp_size)
            where += f"; captured at PP{pp_size} by stages {stages}"
        note("target_layer_ids", where)

    _mask_token(cfg, vocab, tokenizer_path or target_path, trust_remote_code, refuse, note)
    _tokenizers(target_path, tokenizer_path, draft_path, trust_remote_code, refuse, note)

    if num_draft_tokens and cfg.block_size and num_draft_tokens != cfg.block_size:
        refuse("block size", f"--speculative-num-draft-tokens {num_draft_tokens}, but the draft "
               f"was trained with block_size {cfg.block_size}: leave the flag unset (it "
               f"resolves from block_size) or set {cfg.block_size}")  # fmt: skip

    try:
        types = get_dflash_layer_types(draft_full)
        window = get_dflash_attention_sliding_window_size(draft_full)
    except ValueError as e:
        refuse("layer types", f"{e} (sglang's DFLASH config readers)")
    else:
        if types is not None and len(types) != cfg.num_hidden_layers:
            refuse("layer types", f"the draft has {cfg.num_hidden_layers} layers but "
                   f"{len(types)} layer_types; give one per layer")  # fmt: skip
        unknown = sorted(set(types or ()) - {"full_attention", "sliding_attention"})
        if unknown:
            refuse("layer types", f"layer_types {unknown}: a DFLASH draft has full_attention "
                   "and sliding_attention layers only")  # fmt: skip
        if window is not None:
            note("layer types", f"sliding window of {window + 1} tokens on "
                 f"{sum(t == 'sliding_attention' for t in types)} of {len(types)} layers")

    _rope(draft, target, context_length, refuse, note)
    if draft.get("torch_dtype") != target.get("torch_dtype"):
        note("dtype", f"the draft's torch_dtype is {draft.get('torch_dtype')}, the target's "
             f"{target.get('torch_dtype')}; both run in the server's --dtype")  # fmt: skip
    return sorted(out, key=lambda f: not f.refused)


def _mask_token(cfg, vocab: int, tokenizer_path: str, trust: bool, refuse, note) -> None:
    """The mask token id as the server resolves it (``DFlashWorkerV2._resolve_mask_token_id``:
    a tokenizer without the token gets it added, refused only past the target's vocabulary)."""
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    # A fresh tokenizer: the resolver adds a missing mask token to the one it is given.
    tokenizer = _load_tokenizer(tokenizer_path, trust)
    if tokenizer is None and cfg.mask_token_id is None:
        note("mask token", f"{cfg.mask_token!r} (no target tokenizer files to resolve it with)")
        return
    # The two fields of its worker the resolver reads; the TP rank only for its log line.
    runner = SimpleNamespace(model_config=SimpleNamespace(vocab_size=vocab))
    worker = SimpleNamespace(target_worker=SimpleNamespace(model_runner=runner,
                                                           tokenizer=tokenizer))  # fmt: skip
    added = tokenizer is not None and cfg.mask_token not in tokenizer.get_vocab()
    with _some_tp_rank(get_parallel()):
        try:
            resolved = DFlashWorkerV2._resolve_mask_token_id(
                worker, mask_token=cfg.mask_token, mask_token_id=cfg.mask_token_id)
        except (ValueError, RuntimeError) as e:
            refuse("mask token", f"{e} (sglang's DFlashWorkerV2._resolve_mask_token_id)")
            return
    if tokenizer is None:
        note("mask token", f"mask_token_id {resolved} (no target tokenizer files to check "
             "its string against)")  # fmt: skip
        return
    text = tokenizer.convert_ids_to_tokens(resolved)
    if added:
        kind = "not in the target's tokenizer: the server adds it"
    elif resolved in set(tokenizer.all_special_ids) or text in (tokenizer.get_added_vocab() or {}):
        kind = "a special token"
    else:
        kind = "an ordinary token, which prompts contain"
    note("mask token", f"mask token id {resolved} ({text!r}), {kind}")


def _some_tp_rank(parallel):
    """The resolver reads the TP rank (for a log line) when it adds the token. ``check`` runs
    in the prefill's runtime context (a TP size, no rank), ``check-draft`` in none; reading an
    unwritten name raises."""

    def written(name: str) -> bool:
        try:
            getattr(parallel, name)
        except (RuntimeError, ValueError):
            return False
        return True

    if written("tp_rank"):
        return contextlib.nullcontext()
    if written("tp_size"):
        return parallel.override(tp_rank=0)
    return parallel.override(tp_rank=0, tp_size=1)


def _has_tokenizer(path: Optional[str]) -> bool:
    return bool(path) and any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES)


def _load_tokenizer(path: Optional[str], trust: bool):
    if not _has_tokenizer(path):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust)


def _tokenizers(target_path, tokenizer_path, draft_path, trust, refuse, note) -> None:
    if not _has_tokenizer(draft_path):
        note("tokenizer", "the draft ships no tokenizer: it uses the target's")
        return
    target = _load_tokenizer(tokenizer_path or target_path, trust)
    if target is None:
        note("tokenizer", "the target has no tokenizer files to compare the draft's with")
        return
    draft = _load_tokenizer(draft_path, trust)
    a, b = target.get_vocab(), draft.get_vocab()
    differ = sorted(set(a.items()) ^ set(b.items()), key=lambda kv: kv[1])
    if differ:
        refuse("tokenizer", f"the draft's tokenizer differs from the target's in "
               f"{len({t for t, _ in differ})} token(s) (e.g. {differ[:3]}): the draft was "
               "trained with another tokenizer")  # fmt: skip
    for name in SPECIAL_TOKENS:
        if getattr(target, name, None) != getattr(draft, name, None):
            refuse("tokenizer", f"{name}: the target's is {getattr(target, name, None)!r}, "
                   f"the draft's {getattr(draft, name, None)!r}")  # fmt: skip
    if not differ:
        note("tokenizer", f"the draft's tokenizer equals the target's ({len(a)} tokens)")


def _rope(draft: dict, target: dict, context_length, refuse, note) -> None:
    positions = draft.get("max_position_embeddings")
    needed = context_length or target.get("max_position_embeddings")
    if positions is not None and needed is not None and positions < needed:
        refuse("RoPE", f"the draft's max_position_embeddings is {positions}, the target serves "
               f"{needed} positions: the draft's RoPE was not trained that far; lower "
               f"--context-length to {positions} or use a draft trained for it")  # fmt: skip
    for key in ("rope_theta", "rope_scaling"):
        if draft.get(key) != target.get(key):
            note("RoPE", f"the draft's {key} is {draft.get(key)}, the target's "
                 f"{target.get(key)}: the draft applies its own RoPE to the target's "
                 "positions, right only if it was trained with these")  # fmt: skip


def as_dicts(findings: List[Finding]) -> List[dict]:
    return [asdict(f) for f in findings]


def render(findings: List[Finding]) -> List[str]:
    return [f"  {'REFUSED' if f.refused else 'ok     '} {f.check}: {f.message}"
            for f in findings]  # fmt: skip
