# Shared settings of the Kimi-K3 P/D DFlash recipe; sourced by prefill.sh, decode.sh, router.sh
# and bench.sh. Every value can be overridden from the environment.
#
# Topology (see README.md next to this file):
#   P: 4 nodes x 8 GPUs, TP4 x PP8 x EP4, DFLASH (draft context KV built on the last PP stage)
#   D: 4 nodes x 8 GPUs, TP32 x EP4, DFLASH decode (propose / verify / commit), PP1
#   router: sglang_router in PD mode in front of both; the benchmark talks to the router.

# Interpreter whose sglang carries the patch series (the 0.5.23 wheel patched by
# `sglang-dflash-pp install`, or your fork with the series applied), plus sglang-router for
# router.sh. bench.sh needs no sglang: requests (and matplotlib for the histogram) will do.
PYTHON="${PYTHON:-python3}"

# Ports. Multi-node SGLang serves HTTP on node rank 0 only, so P_HEAD / D_HEAD (the node-rank-0
# addresses) are both the distributed-init address and the address the router talks to.
P_PORT="${P_PORT:-30000}"                    # P HTTP port (router -> P)
P_BOOTSTRAP_PORT="${P_BOOTSTRAP_PORT:-8998}" # P KV bootstrap server (D <-> P handshake)
P_DIST_PORT="${P_DIST_PORT:-5000}"           # P torch.distributed rendezvous on P_HEAD
D_PORT="${D_PORT:-30001}"                    # D HTTP port (router -> D)
D_DIST_PORT="${D_DIST_PORT:-5000}"           # D torch.distributed rendezvous on D_HEAD
ROUTER_PORT="${ROUTER_PORT:-8000}"           # router HTTP port (clients -> router)

# DFLASH=0 launches the same P and D without speculative decoding: the baseline run that
# bench.sh compares against (--baseline).
DFLASH="${DFLASH:-1}"

# Optional RDMA NICs for Mooncake (e.g. "mlx5_0,mlx5_1,mlx5_2,mlx5_3", or a per-GPU JSON
# mapping); unset = Mooncake auto-discovers them.
IB_DEVICE="${IB_DEVICE:-}"

require() {
    local name missing=0
    for name in "$@"; do
        if [[ -z "${!name:-}" ]]; then
            echo "$(basename "$0"): set $name (see examples/kimi_k3/README.md)" >&2
            missing=1
        fi
    done
    [[ $missing == 0 ]] || exit 2
}

# Run the command, or with RECIPE_PRINT_ARGS=1 print its argv NUL-separated and exit: the test
# (test/srt/test_kimi_k3_recipe.py) resolves exactly these arguments with the real ServerArgs.
launch() {
    if [[ "${RECIPE_PRINT_ARGS:-0}" == 1 ]]; then
        printf '%s\0' "$@"
        exit 0
    fi
    echo "+ $*" >&2
    exec "$@"
}
