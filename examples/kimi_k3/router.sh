#!/usr/bin/env bash
# Router in front of P and D (PD mode). Needs `pip install sglang-router` (0.3.2 checked);
# run it on any host that reaches P node 0 and D node 0.
#
#   P_HEAD=10.0.0.1 D_HEAD=10.0.1.1 bash examples/kimi_k3/router.sh
#
# For each request the router picks a P and a D, adds the bootstrap host/port/room fields, sends
# the request to both, and returns D's response (whose meta_info carries the spec_* counters).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
require P_HEAD D_HEAD

ARGS=(
    # Prefill/decode disaggregated routing.
    --pd-disaggregation
    # The P server (node rank 0's HTTP address) and its KV bootstrap port (P's
    # --disaggregation-bootstrap-port); D uses it for the handshake.
    --prefill "http://$P_HEAD:$P_PORT" "$P_BOOTSTRAP_PORT"
    # The D server (node rank 0's HTTP address).
    --decode "http://$D_HEAD:$D_PORT"
    # Listen on all interfaces.
    --host 0.0.0.0
    # Router port: the benchmark's --port.
    --port "$ROUTER_PORT"
    # Loading Kimi-K3 on 4 nodes can take longer than the 30-minute default before /health
    # answers; give P and D an hour.
    --worker-startup-timeout-secs 3600
)
launch "$PYTHON" -m sglang_router.launch_router "${ARGS[@]}"
