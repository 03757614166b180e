"""One TP rank of a two-process gloo TP2 group (run by test_kv_write_draft.py): builds the draft
with sglang's dummy loader, stock and KV-write-only, for a draft whose K/V heads shard over the
two ranks and for one whose single K/V head is replicated, and writes each build's parameter bytes
and whether the pruned draft's K/V rows are this rank's rows of the stock draft.

    python tp2_gloo_draft_bytes.py RANK PORT WORKDIR
"""

from __future__ import annotations

import json
import os
import sys

import torch

RANK, PORT, WORKDIR = int(sys.argv[1]), sys.argv[2], sys.argv[3]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=PORT)
os.environ["SGLANG_NCCL_SO_PATH"] = "/nonexistent/libnccl.so.2"  # gloo only, as pp2_gloo_stage
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from sglang.srt.plugins import load_plugins  # noqa: E402

load_plugins()
import sglang.srt.layers.rotary_embedding.base as rotary_base  # noqa: E402
from sglang.srt.distributed.parallel_state import (  # noqa: E402
    get_tp_group,
    init_distributed_environment,
    initialize_model_parallel,
)
from sglang.test.test_utils import publish_build_topology  # noqa: E402

import pp_worker_harness as H  # noqa: E402
import tiny_models  # noqa: E402
from test_kv_write_draft import load_draft, param_bytes  # noqa: E402

rotary_base._is_cpu = True  # see conftest.single_process_dist
init_distributed_environment(world_size=2, rank=RANK, local_rank=RANK, backend="gloo")
publish_build_topology(world_rank=RANK, tp_size=2, pp_size=1)
initialize_model_parallel(backend="gloo")
assert get_tp_group().world_size == 2

LAST = (1, 2, 3)
result = {}
for kv_heads in (2, 1):
    path = os.path.join(WORKDIR, f"draft_kv{kv_heads}_rank{RANK}")
    tiny_models.write_model_dir(path, {**H.draft_config(), "num_key_value_heads": kv_heads})
    full = load_draft(path, "dummy")
    pruned = load_draft(path, "dummy", features=LAST)
    rows_match = all(
        torch.equal(lp.self_attn.qkv_proj.weight, lf.self_attn.qkv_proj.weight[lf.self_attn.q_size :])
        for lp, lf in zip(pruned.layers, full.layers)
    )
    result[kv_heads] = dict(stock=param_bytes(full), kv_write_only=param_bytes(pruned),
                            kv_rows_match=rows_match)
with open(os.path.join(WORKDIR, f"rank{RANK}.json"), "w") as f:
    json.dump(result, f)
