"""Per-head sums of KV words, each hashed with the place it belongs to.

A transfer between a prefill and a decode of other TP widths or PP stages moves every
KV head to another rank, buffer and slot, so a digest keyed on a word's offset in a
buffer cannot compare across it. Here each 32-bit word is hashed with a key derived
from what it is (the buffer's key, the token's position in the request, the global
head index and the word's index in the head's row) and the hashes are added per head,
in any order: both sides get the same sum for a head wherever they keep its words, and
a word at the wrong place is hashed under the wrong key. Sums are modulo 2**32: for one
key the word hash is a bijection, so any single changed word changes the sum, and a
misplacement leaves it equal with probability about 2**-32 per head compared. The key is
a hash of the position plus a hash of the place in the head: one hash per word.

The kernel adds each token block's sums into a caller-owned output with atomics, so a
call allocates nothing. It does not specialize on the first position or the alignment of
the slot list (a row of the page table from any token); it does on the token count (1, a
multiple of 16, other: half the GPU time on an H200 at 8192 tokens), so its owner
compiles those three at startup (`WARM_TOKEN_COUNTS`).
"""

from dataclasses import dataclass
from typing import Sequence

import torch
import triton
import triton.language as tl

from sglang.kernels.ops.memory.gpu_tensor_hash import FMIX32_C1, FMIX32_C2, _fmix32

POS_MUL = 0x9E3779B1
PLACE_MUL = 0x85EBCA77
MASK32 = 0xFFFFFFFF
# A token count of each variant the kernel is compiled for.
WARM_TOKEN_COUNTS = (1, 16, 17)


@dataclass(frozen=True)
class HeadRows:
    """A KV buffer as ``[slots, heads, head elements]`` and what its words are."""

    data: torch.Tensor
    # Identity of the buffer's component, layer and K/V part, 32 bits.
    key: int
    # Global index of the buffer's head 0 (TP ranks hold consecutive heads).
    first_head: int


def fmix32_words(x):
    """The ``_fmix32`` finalizer on 32-bit values held in ints or int64 tensors."""
    x = x ^ (x >> 16)
    x = (x * FMIX32_C1) & MASK32
    x = x ^ (x >> 13)
    x = (x * FMIX32_C2) & MASK32
    return x ^ (x >> 16)


def _head_words(data: torch.Tensor) -> torch.Tensor:
    assert data.dim() == 3 and data.stride(2) == 1, "expects [slots, heads, elements]"
    assert data.shape[2] * data.element_size() % 4 == 0, "head rows must be whole words"
    return data.view(torch.int32)


def keyed_head_sums_reference(
    buffers: Sequence[HeadRows], locs: torch.Tensor, first_pos: int
) -> torch.Tensor:
    """``[len(buffers), max heads]`` int64: for each buffer and local head, the sum
    modulo 2**32 over the tokens at ``locs`` (positions ``first_pos, first_pos + 1,
    ...``) and the head's words of ``fmix32(word ^ key(buffer, position, global head,
    word))``."""
    max_heads = max(b.data.shape[1] for b in buffers)
    out = torch.zeros(len(buffers), max_heads, dtype=torch.int64, device=locs.device)
    pos = first_pos + torch.arange(locs.numel(), device=locs.device, dtype=torch.int64)
    for i, buf in enumerate(buffers):
        words = _head_words(buf.data)[locs].to(torch.int64) & MASK32
        heads, num_words = words.shape[1], words.shape[2]
        head = buf.first_head + torch.arange(heads, device=locs.device)
        word = torch.arange(num_words, device=locs.device)
        place = fmix32_words(
            ((head[:, None] << 16) | word[None, :]) * PLACE_MUL & MASK32
        )
        at = fmix32_words((pos * POS_MUL & MASK32) ^ buf.key)
        key = (at[:, None, None] + place[None]) & MASK32
        out[i, :heads] = fmix32_words(words ^ key).sum(dim=(0, 2)) & MASK32
    return out


@triton.jit(do_not_specialize=["loc_ptr", "first_pos"])
def _keyed_head_sums_kernel(
    base_ptr,
    table_ptr,
    loc_ptr,
    out_ptr,
    num_tokens,
    first_pos,
    max_heads,
    FM_C1: tl.constexpr,
    FM_C2: tl.constexpr,
    POS_C: tl.constexpr,
    PLACE_C: tl.constexpr,
    TOKENS: tl.constexpr,
    WORDS: tl.constexpr,
):
    buf = tl.program_id(0)
    block = tl.program_id(1)
    # One table row per buffer: word offset from base, slot and head strides in
    # words, words per head, heads, global head of head 0, key.
    row = table_ptr + buf * 7
    offset = tl.load(row)
    slot_stride = tl.load(row + 1)
    head_stride = tl.load(row + 2)
    head_words = tl.load(row + 3)
    num_heads = tl.load(row + 4)
    first_head = tl.load(row + 5)
    buf_key = tl.load(row + 6).to(tl.uint32)

    tok = block * TOKENS + tl.arange(0, TOKENS)
    tok_mask = tok < num_tokens
    loc = tl.load(loc_ptr + tok, mask=tok_mask, other=0)
    pos = (first_pos + tok).to(tl.uint32)
    at = _fmix32(pos * tl.full((), POS_C, tl.uint32) ^ buf_key, FM_C1, FM_C2)
    rows = offset + loc * slot_stride
    out = out_ptr + buf * max_heads
    for h in range(num_heads):
        head = (first_head + h).to(tl.uint32)
        total = tl.zeros((), dtype=tl.uint32)
        for w0 in range(0, head_words, WORDS):
            word = w0 + tl.arange(0, WORDS)
            mask = tok_mask[:, None] & (word < head_words)[None, :]
            addr = rows[:, None] + h * head_stride + word[None, :]
            v = tl.load(base_ptr + addr, mask=mask, other=0).to(tl.uint32)
            place = ((head << 16) | word.to(tl.uint32)) * tl.full(
                (), PLACE_C, tl.uint32
            )
            place = _fmix32(place, FM_C1, FM_C2)
            term = _fmix32(v ^ (at[:, None] + place[None, :]), FM_C1, FM_C2)
            total += tl.sum(tl.where(mask, term, 0)).to(tl.uint32)
        tl.atomic_add(out + h, total.to(tl.int64))


def keyed_head_table(buffers: Sequence[HeadRows]) -> torch.Tensor:
    """The kernel's per-buffer parameters, built once for buffers that never move."""
    base = buffers[0].data.data_ptr()
    rows = []
    for buf in buffers:
        words = _head_words(buf.data)
        assert (words.data_ptr() - base) % 4 == 0
        rows.append(
            [
                (words.data_ptr() - base) // 4,
                words.stride(0),
                words.stride(1),
                words.shape[2],
                words.shape[1],
                buf.first_head,
                buf.key,
            ]
        )
    return torch.tensor(rows, dtype=torch.int64, device=buffers[0].data.device)


def keyed_head_sums(
    buffers: Sequence[HeadRows],
    locs: torch.Tensor,
    first_pos: int,
    table: torch.Tensor,
    out: torch.Tensor,
    tokens_per_block: int = 32,
    words_per_step: int = 32,
) -> torch.Tensor:
    """``keyed_head_sums_reference`` in one launch, written into ``out`` (int64,
    ``[len(buffers), max heads]``) and returned; ``table`` is
    ``keyed_head_table(buffers)``. The words of every buffer are addressed from the
    first buffer's, so all must live on one device."""
    num_tokens = locs.numel()
    num_blocks = triton.cdiv(max(num_tokens, 1), tokens_per_block)
    out.zero_()
    _keyed_head_sums_kernel[(len(buffers), num_blocks)](
        _head_words(buffers[0].data),
        table,
        locs,
        out,
        num_tokens,
        first_pos,
        out.shape[1],
        FM_C1=FMIX32_C1,
        FM_C2=FMIX32_C2,
        POS_C=POS_MUL,
        PLACE_C=PLACE_MUL,
        TOKENS=tokens_per_block,
        WORDS=words_per_step,
    )
    return out.bitwise_and_(MASK32)
