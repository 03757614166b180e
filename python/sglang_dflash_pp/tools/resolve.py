"""Resolve a server's launch arguments as ``python -m sglang.launch_server`` does.

``check`` plans a GPU deployment from any machine, including one without a GPU. Resolution makes
no CUDA call, so ``--device cuda`` is only a string there; the one decision that asks the local
platform instead of the argument is the Mamba radix-cache probe (see :func:`resolving_for_gpu`).
Every other startup refusal of sglang's ``ServerArgs`` (the series' gate included) runs for real.
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
import warnings
from typing import Iterator, List, Optional, Tuple


@contextlib.contextmanager
def quiet_sglang(verbose: bool = False) -> Iterator[None]:
    """Keep stdout for the report (what sglang prints goes to stderr) and, unless ``verbose``,
    drop sglang's INFO logs and import-time platform warnings."""
    log, level = logging.getLogger("sglang"), logging.getLogger("sglang").level
    log.setLevel(level if verbose else logging.WARNING)
    try:
        with contextlib.redirect_stdout(sys.stderr), warnings.catch_warnings():
            if not verbose:
                warnings.simplefilter("ignore")
            yield
    finally:
        log.setLevel(level)


@contextlib.contextmanager
def resolving_for_gpu(device: Optional[str]) -> Iterator[None]:
    """Answer the Mamba cache platform probe as the CUDA platform does, while resolving for CUDA.

    Why: Kimi-K3's default radix-cache strategy (``extra_buffer``) asks
    ``mamba_hook._platform_supports_mamba_cache_extra_buffer()``, which reads *this* process's
    platform, not the ``--device`` resolved for: without a GPU resolution fails ("extra_buffer
    requires platform support for Mamba cache state snapshots"), which a GPU server never does.
    """
    import sglang.srt.arg_groups.mamba_hook as mamba_hook
    from sglang.srt.runtime_context import get_platform

    if device != "cuda" or get_platform().is_cuda:
        yield
        return
    original = mamba_hook._platform_supports_mamba_cache_extra_buffer
    mamba_hook._platform_supports_mamba_cache_extra_buffer = lambda: True
    try:
        yield
    finally:
        mamba_hook._platform_supports_mamba_cache_extra_buffer = original


def launch_argv(argv: List[str]) -> List[str]:
    """``argv`` without a pasted ``python -m sglang.launch_server`` prefix, and with
    ``--device cuda`` appended when no device is given: the server planned runs on CUDA."""
    prefix = argv.index("sglang.launch_server") if "sglang.launch_server" in argv[:3] else -1
    argv = list(argv[prefix + 1 :])
    if not any(a == "--device" or a.startswith("--device=") for a in argv):
        argv += ["--device", "cuda"]
    return argv


def resolve(argv: List[str]) -> Tuple[object, Optional[str]]:
    """``(record, None)`` resolved as ``launch_server`` does, or ``(record or None, refusal)``."""
    from sglang.srt.server_args import prepare_server_args

    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            record = prepare_server_args(list(argv))
    except SystemExit:
        lines = [ln for ln in captured.getvalue().splitlines() if ln.strip()]
        return None, "the arguments do not parse: " + (lines[-1] if lines else "argparse")
    try:
        with resolving_for_gpu(record.device):
            record.resolve_once()
            record.check_server_args()
    except Exception as e:  # every startup refusal raised while resolving
        return record, f"{type(e).__name__}: {e}"
    return record, None
