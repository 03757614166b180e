#!/usr/bin/env bash
# Kimi-K3 PREFILL (P) server: TP4 x PP8 x EP4 over 4 nodes x 8 GPUs, DFLASH, PD prefill, Mooncake.
# Start it on every P node, NODE_RANK=0..3; node 0 serves HTTP on $P_HEAD:$P_PORT.
#
#   KIMI_K3_PATH=/models/Kimi-K3 KIMI_K3_DFLASH_PATH=/models/Kimi-K3-DFlash \
#   P_HEAD=10.0.0.1 NODE_RANK=0 bash examples/kimi_k3/prefill.sh
#
# Needs an sglang that carries this repository's patch series: the sglang 0.5.23 wheel patched
# by `sglang-dflash-pp install`, or your fork with the series applied (git am; docs/series.md).
# Without the series, sglang refuses DFLASH with --pp-size > 1.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
require KIMI_K3_PATH KIMI_K3_DFLASH_PATH NODE_RANK P_HEAD

ARGS=(
    # Target checkpoint: Kimi-K3 (93 layers, hidden 7168). Same path on every P and D node.
    --model-path "$KIMI_K3_PATH"
    # Kimi-K3's tokenizer and processor ship as remote code in the checkpoint.
    --trust-remote-code
    # 4-way tensor parallelism inside each pipeline stage: one stage = 4 GPUs, two stages per node.
    --tp-size 4
    # 8 pipeline stages (93 layers -> 11 or 12 per stage). Each stage projects the DFlash capture
    # layers it owns with its column block of the draft fc; only the last stage holds the draft,
    # normalises the accumulated partial and writes the draft KV.
    --pp-size 8
    # Experts sharded over the 4 GPUs of a stage (expert-parallel MoE, MoE TP 1).
    --ep-size 4
    # 4 nodes x 8 GPUs = TP4 x PP8 = 32 ranks.
    --nnodes 4
    # This node's rank, 0..3; rank 0 serves HTTP and the KV bootstrap server.
    --node-rank "$NODE_RANK"
    # torch.distributed rendezvous: node rank 0's address, same value on all P nodes.
    --dist-init-addr "$P_HEAD:$P_DIST_PORT"
    # PD prefill: this server runs prefill only and hands KV to the decode server.
    --disaggregation-mode prefill
    # Mooncake transfer engine: the only backend DFLASH with PP accepts, and the one that sends
    # the draft KV head by head to a decode of another TP (P TP4 = 2 draft KV heads/rank,
    # D TP32 = 1 head/rank).
    --disaggregation-transfer-backend mooncake
    # Sum each request's KV, KDA state and draft KV per layer and head at its last chunk and
    # send the sums with the transfer status, for D to verify. Also on D. About 0.2 ms per
    # 8192-token chunk on a last-stage GPU (2% of its link time at 50 GB/s).
    --disaggregation-enable-kv-checksum
    # KV bootstrap port (8998 is also the default); the router's --prefill entry must name it.
    --disaggregation-bootstrap-port "$P_BOOTSTRAP_PORT"
    # Prefill in chunks of 8192 tokens (per PP micro-batch).
    --chunked-prefill-size 8192
    # bf16 KV cache; D uses the same dtype: the transfer copies KV bytes as they are.
    --kv-cache-dtype bf16
    # DFLASH with PP refuses a PP prefill CUDA graph (it would capture the raw hidden relay
    # instead of the context partial). Disabled is the default; stated so nobody turns it on.
    --cuda-graph-backend-prefill disabled
    # Listen on all interfaces; the router reaches node 0 at $P_HEAD:$P_PORT.
    --host 0.0.0.0
    # P HTTP port.
    --port "$P_PORT"
)
if [[ "$DFLASH" == 1 ]]; then
    ARGS+=(
        # DFlash speculative decoding: P builds the draft context KV that D drafts from.
        # The verify width (speculative_num_draft_tokens) is not passed: it resolves from the
        # draft's block_size (16) on P and D alike, so the two cannot disagree.
        --speculative-algorithm DFLASH
        # DFlash draft: 6 layers, 8 KV heads x 128, bf16, sliding window 4096, block size 16,
        # capture layers [19, 37, 54, 66, 78, 90]. Same path on P and D.
        --speculative-draft-model-path "$KIMI_K3_DFLASH_PATH"
    )
fi
if [[ -n "$IB_DEVICE" ]]; then
    # RDMA NICs for Mooncake; without it Mooncake auto-discovers them.
    ARGS+=(--disaggregation-ib-device "$IB_DEVICE")
fi

# Left at their defaults on purpose:
#   overlap schedule      PP forces it off (--disable-overlap-schedule is implied)
#   max running requests  DFLASH resolves it (48)
#   page size, attention and linear-attention backends, mamba radix-cache strategy: the GPU
#                         platform defaults for Kimi-K3
#   SGLANG_ENABLE_PP_SPEC must NOT be set: startup refuses it with DFLASH and PP.
launch "$PYTHON" -m sglang.launch_server "${ARGS[@]}"
