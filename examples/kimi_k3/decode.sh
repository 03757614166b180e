#!/usr/bin/env bash
# Kimi-K3 DECODE (D) server: TP32 x EP4 over 4 nodes x 8 GPUs, DFLASH decode, PD decode, Mooncake.
# Start it on every D node, NODE_RANK=0..3; node 0 serves HTTP on $D_HEAD:$D_PORT.
#
#   KIMI_K3_PATH=/models/Kimi-K3 KIMI_K3_DFLASH_PATH=/models/Kimi-K3-DFlash \
#   D_HEAD=10.0.1.1 NODE_RANK=0 bash examples/kimi_k3/decode.sh
#
# D is an ordinary DFLASH decode (PP1), on the same patched sglang as P: P checks D's draft KV
# layout when D registers and writes each D rank exactly its own draft KV heads.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
require KIMI_K3_PATH KIMI_K3_DFLASH_PATH NODE_RANK D_HEAD

ARGS=(
    # Target checkpoint: the same Kimi-K3 as on P.
    --model-path "$KIMI_K3_PATH"
    # Kimi-K3's tokenizer and processor ship as remote code in the checkpoint.
    --trust-remote-code
    # 32-way tensor parallelism over all 32 GPUs (each of the 8 draft KV heads on 4 ranks).
    --tp-size 32
    # No pipeline parallelism on D: DFLASH with --pp-size > 1 is refused on a decode server.
    --pp-size 1
    # Experts in 4 groups (MoE TP 8 inside each).
    --ep-size 4
    # 4 nodes x 8 GPUs.
    --nnodes 4
    # This node's rank, 0..3; rank 0 serves HTTP.
    --node-rank "$NODE_RANK"
    # torch.distributed rendezvous: node rank 0's address, same value on all D nodes.
    --dist-init-addr "$D_HEAD:$D_DIST_PORT"
    # PD decode: receives prompt KV, KDA state and draft KV from P, then decodes.
    --disaggregation-mode decode
    # Must match P's transfer backend.
    --disaggregation-transfer-backend mooncake
    # Verify every transfer (target MLA KV, KDA state, draft KV) against what P reported,
    # per layer and head; a request whose KV differs fails by name. Also on P. About 0.2 ms
    # per 8192-token chunk on D (4% of its link time at 50 GB/s).
    --disaggregation-enable-kv-checksum
    # /metrics, for sglang:kv_checksum_reqs_total{outcome="verified"|"failed"|"unverified"}.
    --enable-metrics
    # bf16 KV cache, the same dtype as P (the transfer copies bytes).
    --kv-cache-dtype bf16
    # Listen on all interfaces; the router reaches node 0 at $D_HEAD:$D_PORT.
    --host 0.0.0.0
    # D HTTP port.
    --port "$D_PORT"
)
if [[ "$DFLASH" == 1 ]]; then
    ARGS+=(
        # DFlash speculative decoding: propose a block of 16 from the draft, verify with the
        # target, commit the accepted prefix plus the bonus token. The verify width resolves
        # from the draft's block_size, as on P.
        --speculative-algorithm DFLASH
        # The same DFlash draft checkpoint as P.
        --speculative-draft-model-path "$KIMI_K3_DFLASH_PATH"
    )
fi
if [[ -n "$IB_DEVICE" ]]; then
    # RDMA NICs for Mooncake; without it Mooncake auto-discovers them.
    ARGS+=(--disaggregation-ib-device "$IB_DEVICE")
fi

# Left at their defaults on purpose: max running requests (DFLASH resolves 48, enough for C8),
# decode CUDA graph (on), radix cache (a PD decode server disables it), page size and attention
# backends (GPU platform defaults).
launch "$PYTHON" -m sglang.launch_server "${ARGS[@]}"
