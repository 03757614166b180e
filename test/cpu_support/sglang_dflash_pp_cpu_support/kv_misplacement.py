"""Test-only: misplace a transfer's KV on purpose, for the KV checksum to catch.

Enabled by ``SGLANG_DFLASH_PP_TEST_KV_MISPLACEMENT=<file>``. The test writes one word into the
file before a request and empties it after; while it holds a word, every send or verification
this process makes is misplaced that way:

- ``swap-source`` (prefill, last PP stage), AROUND ``disaggregation/mooncake/conn.
  MooncakeKVManager.send_kvcache``: the last two target entries (V of the stage's last two
  layers, the same size) trade places in ``kv_args.kv_data_ptrs`` for the call, so each layer's
  V is read from the other's buffer: the wrong-source send of the issue;
- ``swap-destination`` (prefill, last PP stage), same symbol: the decode's K buffers of the
  stage's two layers trade places in ``dst_kv_ptrs``, so a layer is paired with the wrong decode
  layer;
- ``wrong-head`` (prefill), AROUND ``MooncakeKVManager.send_kvcache_slice`` of the draft entries
  (``draft=True``): the heads are chosen for the other decode rank of a TP2 decode, so each rank
  gets the other's draft head;
- ``truncate-sums``, ``garbage-sums``, ``drop-sums`` (prefill, last PP stage), AROUND
  ``disaggregation/common/conn.CommonKVManager.send_kv_status_message``: the KV checksum sums a
  Success carries lose their last 3 bytes, become as many random bytes, or are left out: a
  damaged or missing frame from the wire;
- ``raise-sums`` (prefill, last PP stage), AROUND ``disaggregation/kv_placement_checksum.
  KvPlacementChecksumComputer.compute_head_sums``, and ``raise-compare`` (decode, attention TP
  rank 1 only), AROUND its ``compare_head_sums``: the call raises, as a device error would;
- ``flip-target``, ``flip-draft``, ``flip-state`` (decode), AROUND ``disaggregation/decode.
  SchedulerDisaggregationDecodeMixin._verify_kv_checksums``: one bit of layer 0's K (the MLA
  latent on Kimi-K3) at the request's first received token, or of the first state layer's
  temporal state in the request's slot, after the transfer, before the checksum is compared;
  ``zero-draft`` (decode, same symbol): the request's whole transferred draft KV set to 0,
  for the acceptance tool to see (on a decode without the checksum, which would fail it).

Nothing else changes; with the file empty every call is upstream's.
"""

from __future__ import annotations

import os

ENV = "SGLANG_DFLASH_PP_TEST_KV_MISPLACEMENT"
CONN = "sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager"


def _asked() -> str:
    try:
        with open(os.environ[ENV]) as f:
            return f.read().strip()
    except OSError:
        return ""


def _last_stage(manager) -> bool:
    return manager.pp_rank == manager.pp_size - 1


def send_kvcache(original, self, session, src_indices, dst_kv_ptrs, *args, **kwargs):
    asked = _asked()
    if asked not in ("swap-source", "swap-destination") or not _last_stage(self):
        return original(self, session, src_indices, dst_kv_ptrs, *args, **kwargs)
    if asked == "swap-destination":
        dst_layer_ids = kwargs["dst_layer_ids"]
        a, b = (dst_layer_ids.index(layer) for layer in self.kv_args.kv_layer_ids[:2])
        dst_kv_ptrs = list(dst_kv_ptrs)
        dst_kv_ptrs[a], dst_kv_ptrs[b] = dst_kv_ptrs[b], dst_kv_ptrs[a]
        return original(self, session, src_indices, dst_kv_ptrs, *args, **kwargs)
    ptrs = self.kv_args.kv_data_ptrs
    last = len(ptrs) - self.kv_args.num_draft_entries - 1
    assert self.kv_args.kv_item_lens[last - 1] == self.kv_args.kv_item_lens[last]
    ptrs[last - 1], ptrs[last] = ptrs[last], ptrs[last - 1]
    try:
        return original(self, session, src_indices, dst_kv_ptrs, *args, **kwargs)
    finally:
        ptrs[last - 1], ptrs[last] = ptrs[last], ptrs[last - 1]


def send_kvcache_slice(original, self, *args, **kwargs):
    if _asked() == "wrong-head" and kwargs.get("draft"):
        args = list(args)
        args[4] ^= 1  # dst_tp_rank
    return original(self, *args, **kwargs)


def send_kv_status_message(original, self, *args, **kwargs):
    asked, sums = _asked(), kwargs.get("kv_checksum_sums")
    if not _last_stage(self):
        pass
    elif sums is not None and asked == "truncate-sums":
        kwargs["kv_checksum_sums"] = sums[:-3]
    elif sums is not None and asked == "garbage-sums":
        kwargs["kv_checksum_sums"] = os.urandom(len(sums))
    elif asked == "drop-sums":
        kwargs["kv_checksum_sums"] = None
    return original(self, *args, **kwargs)


def raise_if_asked(word):
    """Raise on the last PP stage of a prefill, or on attention TP rank 1 of a decode (a
    failure on one rank)."""

    def hook(original, self, *args, **kwargs):
        from sglang.srt.runtime_context import get_parallel

        parallel = get_parallel()
        one_rank = (parallel.pp_rank == parallel.pp_size - 1 if word == "raise-sums"
                    else parallel.attn_tp_rank == 1)
        if _asked() == word and one_rank:
            raise RuntimeError(f"{word}: a failure injected by the test")
        return original(self, *args, **kwargs)

    return hook


def verify_kv_checksums(original, self, batch):
    import torch

    asked = _asked()
    if asked == "flip-state":
        mamba_pool = self.disagg_decode_prealloc_queue.token_to_kv_pool.mamba_pool
        for req in batch.reqs:
            slot = int(self.req_to_token_pool.req_index_to_mamba_index_mapping[
                req.kv.req_pool_idx])
            mamba_pool.mamba_cache.temporal[0, slot].view(-1).view(torch.uint8)[0] ^= 1
    if asked == "zero-draft":
        pool = self.disagg_decode_prealloc_queue.draft_token_to_kv_pool
        for req in batch.reqs:
            slots = self.req_to_token_pool.req_to_token[
                req.kv.req_pool_idx, : len(req.origin_input_ids)].to(torch.int64)
            for buffers in (pool.k_buffer, pool.v_buffer):
                for buffer in buffers:
                    buffer[slots] = 0
    if asked in ("flip-target", "flip-draft"):
        queue = self.disagg_decode_prealloc_queue
        pool = queue.token_to_kv_pool if asked == "flip-target" else queue.draft_token_to_kv_pool
        pool = getattr(pool, "full_kv_pool", pool)
        layer0 = pool.kv_buffer[0] if hasattr(pool, "kv_buffer") else pool.k_buffer[0]
        for req in batch.reqs:
            start = req.kv.cache_protected_len
            loc = int(self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, start])
            layer0[loc].view(-1).view(torch.uint8)[0] ^= 1
    return original(self, batch)


CHECKSUM = "sglang.srt.disaggregation.kv_placement_checksum.KvPlacementChecksumComputer"
HOOKS = (
    (f"{CONN}.send_kvcache", send_kvcache, "around"),
    (f"{CONN}.send_kvcache_slice", send_kvcache_slice, "around"),
    ("sglang.srt.disaggregation.common.conn.CommonKVManager.send_kv_status_message",
     send_kv_status_message, "around"),
    (f"{CHECKSUM}.compute_head_sums", raise_if_asked("raise-sums"), "around"),
    (f"{CHECKSUM}.compare_head_sums", raise_if_asked("raise-compare"), "around"),
    ("sglang.srt.disaggregation.decode.SchedulerDisaggregationDecodeMixin._verify_kv_checksums",
     verify_kv_checksums, "around"),
)
