"""One PP stage of a two-process gloo pipeline (run by test_pp_carry_gloo.py).

Both processes initialise sglang's distributed state the way a scheduler does on CPU (gloo world of
2, PP groups from ``initialize_model_parallel``), build the same seeded draft, and carry the real
proxy dict between the stages with ``GroupCoordinator.send_tensor_dict`` / ``recv_tensor_dict``.
Stage 0 is the real non-last ``PPDFlashWorkerV2``; stage 1 runs the last-stage worker on the stock
forward path into a CPU ``MHATokenToKVPool`` and compares it with the PP1 path.

    python pp2_gloo_stage.py RANK PORT WORKDIR
"""

from __future__ import annotations

import os
import sys

import torch

RANK, PORT, WORKDIR = int(sys.argv[1]), sys.argv[2], sys.argv[3]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=PORT)
# The PP group defaults to PyNccl; with no CUDA device it must fail to load and disable itself.
os.environ["SGLANG_NCCL_SO_PATH"] = "/nonexistent/libnccl.so.2"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from sglang.srt.plugins import load_plugins  # noqa: E402

load_plugins()
import sglang.srt.layers.rotary_embedding.base as rotary_base  # noqa: E402
from sglang.srt.distributed.parallel_state import (  # noqa: E402
    get_pp_group,
    init_distributed_environment,
    initialize_model_parallel,
)
from sglang.srt.distributed.utils import get_pp_indices  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import PPProxyTensors  # noqa: E402
from sglang.srt.runtime_context import get_spec  # noqa: E402
from sglang.test.test_utils import publish_build_topology  # noqa: E402

import pp_worker_harness as H  # noqa: E402
from sglang_dflash_pp.srt.models.capture_ownership import compute_feature_ownership  # noqa: E402
from sglang_dflash_pp.srt.speculative.pp_stage_carry import StageCarry  # noqa: E402

rotary_base._is_cpu = True  # see conftest.single_process_dist
init_distributed_environment(world_size=2, rank=RANK, local_rank=RANK, backend="gloo")
publish_build_topology(world_rank=RANK, tp_size=1, pp_size=2)
initialize_model_parallel(backend="gloo")
pp = get_pp_group()
assert (pp.rank_in_group, pp.world_size) == (RANK, 2)

DTYPE = torch.float32
draft_dir = os.path.join(WORKDIR, f"draft{RANK}")
model = H.build_draft_model(draft_dir, DTYPE, seed=0)
ownership = compute_feature_ownership(
    [get_pp_indices(H.TARGET_LAYERS, r, 2) for r in range(2)], H.TARGET_LAYER_IDS, H.TARGET_LAYERS
)

# Micro-batches in the order the scheduler launches them: an unchunked batch of two requests,
# then request 2 prefilled in chunks of 10 (one with trailing padding rows), all sent before the
# last stage processes any of them.
loc = lambda a, b: torch.arange(a, b)  # noqa: E731
MICRO_BATCHES = [
    H.Chunk([(0, 0, 13), (1, 0, 9)], loc(100, 122)),
    H.Chunk([(2, 0, 10)], loc(200, 210)),
    H.Chunk([(2, 10, 20)], loc(210, 220), padding_rows=2),
    H.Chunk([(2, 20, 24)], loc(220, 224)),
]
UNCHUNKED_REQUEST_2 = H.Chunk([(2, 0, 24)], loc(200, 224))

if RANK == 0:
    features = ownership.stages[0].features
    target = H.CapturingTarget(features, is_last=False, dtype=DTYPE)
    with get_spec().override(speculative_draft_model_path=draft_dir):
        worker = H.non_last_stage_worker(target, draft_dir, dtype=DTYPE)
    sent = []
    for chunk in MICRO_BATCHES:
        target.chunk = chunk
        out = worker.forward_batch_generation(chunk.schedule_batch())
        tensors = out.pp_hidden_states_proxy_tensors.tensors
        sent.append({k: [list(v.shape), str(v.dtype)] for k, v in tensors.items()})
        pp.send_tensor_dict(tensors, all_gather_group=None)
    H.write_json(os.path.join(WORKDIR, "stage0.json"), {"features": list(features), "sent": sent})
else:
    features = ownership.stages[1].features
    carry = StageCarry.of(ownership, 1, H.HIDDEN)
    pool, translator = H.draft_pool(DTYPE)
    target = H.CapturingTarget(features, is_last=True, dtype=DTYPE, translator=translator)
    worker = H.last_stage_worker(model, carry, target, pool, translator)
    received = []
    for chunk in MICRO_BATCHES:
        tensors = pp.recv_tensor_dict(all_gather_group=None)
        received.append({k: [list(v.shape), str(v.dtype)] for k, v in tensors.items()})
        target.chunk = chunk
        worker.forward_batch_generation(chunk.schedule_batch(), pp_proxy_tensors=PPProxyTensors(tensors))

    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    def pp1(chunks):
        """The PP1 path: the stock forward on all features, nothing stashed."""
        ref_pool, ref_translator = H.draft_pool(DTYPE)
        ref_target = H.CapturingTarget(range(len(H.TARGET_LAYER_IDS)), True, DTYPE, ref_translator)
        ref = H.last_stage_worker(model, carry, ref_target, ref_pool, ref_translator)
        for chunk in chunks:
            ref_target.chunk = chunk
            DFlashWorkerV2.forward_batch_generation(ref, chunk.schedule_batch())
        return H.pool_image(ref_pool)

    written = H.pool_image(pool)
    same_chunks = pp1(MICRO_BATCHES)
    unchunked = pp1([MICRO_BATCHES[0], UNCHUNKED_REQUEST_2])
    touched = torch.cat([c.out_cache_loc for c in MICRO_BATCHES])
    mask = torch.zeros(written.shape[2], dtype=torch.bool)
    mask[touched] = True
    H.write_json(
        os.path.join(WORKDIR, "stage1.json"),
        {
            "features": list(features),
            "received": received,
            "max_abs_diff_vs_pp1_same_chunks": (written - same_chunks).abs().max().item(),
            "max_abs_diff_vs_pp1_unchunked": (written - unchunked).abs().max().item(),
            "max_abs_written": written.abs().max().item(),
            "min_row_abs_sum_touched": written[:, :, mask].abs().sum(dim=(0, 1, 3, 4)).min().item(),
            "abs_sum_untouched": written[:, :, ~mask].abs().sum().item(),
        },
    )
