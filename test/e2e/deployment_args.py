"""Launch arguments shared by the end-to-end deployments: fp32, small pools, chunked prefill, and
``--sleep-on-idle`` (an idle scheduler otherwise busy-polls a core, and several deployments share
this box's two cores)."""

from __future__ import annotations

CHUNK = 64


def server_args(draft: str, *extra: str) -> list:
    return [
        "--dtype", "float32", "--max-total-tokens", "4096", "--max-running-requests", "4",
        "--chunked-prefill-size", str(CHUNK), "--speculative-algorithm", "DFLASH",
        "--speculative-draft-model-path", draft, "--sleep-on-idle", *extra,
    ]  # fmt: skip


def prefill_args(bootstrap: int) -> list:
    return ["--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", "mooncake",
            "--disaggregation-bootstrap-port", str(bootstrap)]


DECODE_ARGS = ["--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "mooncake",
               "--disaggregation-decode-retraction-backup", "cpu_tensor"]

# The router's own failure policies off: a failed request is the test's to see.
ROUTER_ARGS = ("--disable-retries", "--disable-circuit-breaker", "--disable-health-check")
