"""One prefill PP stage of ``preflight``, in its own process.

    python -m sglang_dflash_pp.tools.preflight_stage SPEC.json STAGE

A non-last stage imports no sglang: it reads its ``fc`` column blocks from the draft checkpoint
(``dflash_fc_columns``, as ``PPDFlashWorkerV2`` does on a non-last stage), takes its captures,
and turns them plus the inbound partial into the outbound partial with the PP worker's own
``pp_stage_carry.replace_capture_with_partial``. The carry crosses processes through
``torch.distributed`` (a gloo process group bound to 127.0.0.1, rendezvous through a file in the
work directory, so no port is opened on any other address). The last stage runs
``preflight_last`` instead.

Why one process per stage and not per (stage, TP rank): every TP rank of a stage computes the
same partial from the same replicated captures and ``fc`` blocks, so one process per stage
carries exactly the bytes each TP rank would carry.
"""

from __future__ import annotations

import json
import sys
import time

from sglang_dflash_pp.tools import peer_process as proc
from sglang_dflash_pp.tools.preflight_carry import CARRY_TAG, carry_group, recv_partial
from sglang_dflash_pp.tools.preflight_spec import OWNERSHIP_FILE, PreflightSpec

def stage_ownership(spec: PreflightSpec):
    """The ownership every stage computes from sglang's partition (written by the last stage,
    which imports sglang's ``get_pp_indices``) and the draft's capture layers."""
    from sglang_dflash_pp.srt.models.capture_ownership import compute_feature_ownership

    with open(spec.path(OWNERSHIP_FILE)) as f:
        stage_layers = json.load(f)["stage_layers"]
    return compute_feature_ownership(stage_layers, spec.target_layer_ids, spec.num_layers)


def run_stage(spec: PreflightSpec, stage: int) -> None:
    import torch

    torch.set_num_threads(1)
    from sglang_dflash_pp.srt.models.dflash_fc_columns import load_fc_column_blocks
    from sglang_dflash_pp.srt.speculative.pp_stage_carry import (
        CAPTURE_KEY,
        PARTIAL_KEY,
        StageCarry,
        replace_capture_with_partial,
    )

    ownership = stage_ownership(spec)
    carry = StageCarry.of(ownership, stage, spec.hidden)
    dtype = spec.torch_dtype(spec.dtype)
    w_stage = None
    if carry.features:
        w_stage = load_fc_column_blocks(
            spec.draft_dir, carry.features, spec.hidden, ownership.num_features, dtype=dtype
        )
    group = carry_group(spec, stage)
    group.barrier().wait()
    t0 = time.perf_counter()
    inbound = {PARTIAL_KEY: recv_partial(spec, group, stage)} if carry.receives else None
    t_recv = time.perf_counter()
    outbound = {CAPTURE_KEY: spec.captures(carry.features)} if carry.features else {}
    replace_capture_with_partial(
        carry, outbound, inbound, w_stage, spec.torch_dtype(spec.carry_dtype)
    )
    t_compute = time.perf_counter()
    sent = 0
    if carry.sends:
        partial = outbound[PARTIAL_KEY]
        group.send([partial], stage + 1, CARRY_TAG).wait()
        sent = partial.nbytes
    t_sent = time.perf_counter()
    proc.send(
        "result",
        stage=stage,
        features=list(carry.features),
        receives=carry.receives,
        sends=carry.sends,
        sent_bytes=sent,
        recv_wait_s=t_recv - t0,
        compute_s=t_compute - t_recv,
        send_s=t_sent - t_compute,
        done_s=t_sent - t0,
    )


def main() -> None:
    spec = PreflightSpec.load(sys.argv[1])
    stage = int(sys.argv[2])
    if stage == spec.pp - 1:
        from sglang_dflash_pp.tools.preflight_last import run_last_stage

        run_last_stage(spec)
    else:
        run_stage(spec, stage)


if __name__ == "__main__":
    proc.run_child(main)
