"""Test-only: the decode server's draft KV rows of every request, as the transfer left them.

Enabled by ``SGLANG_DFLASH_PP_TEST_DRAFT_KV_DUMP=<dir>``. AROUND
``disaggregation/decode.DecodeTransferQueue._commit_transfer_to_req`` (called once per request
whose KV transfer succeeded, before the request is scheduled): after the stock commit, the draft
pool's K and V rows at the request's prompt slots are saved to ``<dir>/tp<rank>-<rid>.pt``, one
``[draft layers, prompt tokens, heads on this rank, head dim]`` tensor each. This reads the
buffers the prefill wrote through Mooncake and nothing the product reads or writes; the
end-to-end tests compare these files between deployments.
"""

from __future__ import annotations

import os

ENV = "SGLANG_DFLASH_PP_TEST_DRAFT_KV_DUMP"


def commit_then_dump(original, self, decode_req, *args, **kwargs):
    req = decode_req.req
    outputs_before = len(req.output_ids)
    out = original(self, decode_req, *args, **kwargs)
    directory = os.environ.get(ENV)
    if not directory or len(req.output_ids) == outputs_before:
        return out  # not asked, or the commit aborted the request
    import torch
    from sglang.srt.runtime_context import get_parallel

    queue = self.scheduler.disagg_decode_prealloc_queue
    pool = queue.draft_token_to_kv_pool
    if pool is None:
        return out
    n = len(req.origin_input_ids)
    slots = queue.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :n].to(torch.int64)
    record = {
        "rid": req.rid,
        "input_ids": list(req.origin_input_ids),
        "k": torch.stack([pool.k_buffer[i][slots].clone() for i in range(pool.layer_num)]),
        "v": torch.stack([pool.v_buffer[i][slots].clone() for i in range(pool.layer_num)]),
    }
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"tp{get_parallel().tp_rank}-{req.rid}.pt")
    torch.save(record, path + ".tmp")
    os.replace(path + ".tmp", path)
    return out
