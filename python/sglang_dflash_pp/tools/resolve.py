"""Resolve server arguments exactly as ``python -m sglang.launch_server`` does, with the plugin on.

``check`` plans a GPU deployment from any machine, including one without a GPU. Resolution
itself makes no CUDA call, so ``device="cuda"`` is only a string there; the one decision that
asks the local platform instead of the argument is the Mamba radix-cache probe (see
:func:`resolving_for_gpu`). Everything else, including every startup refusal of sglang and of
this plugin's argument gate, runs for real.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import shutil
import sys
import tempfile
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional

MODEL_PATH_FLAG = "--model-path"
DRAFT_PATH_FLAG = "--speculative-draft-model-path"


def load_plugin() -> None:
    """Load plugins the way every SGLang server process does (entry point ``dflash_pp``)."""
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang_dflash_pp.hooks import registered_hooks

    if not registered_hooks():
        raise RuntimeError(
            "sglang-dflash-pp did not register through the sglang.srt.plugins entry point in "
            "this environment; reinstall the package (pip install -e .) and check that "
            "SGLANG_PLUGINS, if set, lists 'dflash_pp'."
        )


@contextlib.contextmanager
def resolving_for_gpu(device: Optional[str]) -> Iterator[None]:
    """Answer the Mamba cache platform probe as the CUDA platform does, while resolving for CUDA.

    Why: Kimi-K3's default radix-cache strategy (``extra_buffer``) asks
    ``mamba_hook._platform_supports_mamba_cache_extra_buffer()``, which reads the platform of
    *this* process (``platform.is_cuda``, ...) rather than the ``--device`` being resolved for. On
    a machine without a GPU it answers False and resolution fails with "extra_buffer requires
    platform support for Mamba cache state snapshots", a refusal the GPU server never raises. So
    for ``--device cuda`` on a non-CUDA platform the probe answers True (the CUDA platform's
    answer) for the duration of the resolution only, and is restored afterwards. On a CUDA
    machine, or for any other device, nothing is changed.
    """
    if device != "cuda":
        yield
        return
    import sglang.srt.arg_groups.mamba_hook as mamba_hook
    from sglang.srt.runtime_context import get_platform

    if get_platform().is_cuda:
        yield
        return
    original = mamba_hook._platform_supports_mamba_cache_extra_buffer
    mamba_hook._platform_supports_mamba_cache_extra_buffer = lambda: True
    try:
        yield
    finally:
        mamba_hook._platform_supports_mamba_cache_extra_buffer = original


@contextlib.contextmanager
def quiet_sglang(verbose: bool = False) -> Iterator[None]:
    """Keep stdout clean for ``--json`` (anything sglang prints goes to stderr) and, unless
    ``verbose``, drop sglang's INFO logs about resolution defaults."""
    loggers = [logging.getLogger(name) for name in ("sglang", "sglang_dflash_pp")]
    levels = [lg.level for lg in loggers]
    if not verbose:
        for lg in loggers:
            lg.setLevel(logging.WARNING)
    try:
        with contextlib.redirect_stdout(sys.stderr), warnings.catch_warnings():
            if not verbose:
                warnings.simplefilter("ignore")  # import-time platform warnings of sglang
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


@dataclass
class Resolution:
    """The outcome of resolving one server's arguments."""

    argv: List[str]
    server_args: Any = None  # the ServerArgs record (raw fields readable even after a refusal)
    error: Optional[str] = None
    resolved: Optional[Dict[str, Any]] = None  # resolved_dict() on success

    @property
    def ok(self) -> bool:
        return self.error is None

    def value(self, name: str, default: Any = None) -> Any:
        """The resolved value of ``name`` when resolution succeeded, else the raw input."""
        if self.resolved is not None and name in self.resolved:
            return self.resolved[name]
        if self.server_args is None:
            return default
        value = getattr(self.server_args, name, default)
        return default if value is None else value


def parse_only(argv: List[str]):
    """``prepare_server_args(argv)`` (parse, no resolution); (record, None) or (None, error)."""
    from sglang.srt.server_args import prepare_server_args

    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            return prepare_server_args(list(argv)), None
    except SystemExit:
        lines = [ln for ln in captured.getvalue().splitlines() if ln.strip()]
        return None, "the arguments do not parse: " + (lines[-1] if lines else "argparse error")


def resolve(argv: List[str]) -> Resolution:
    """Parse and resolve like ``launch_server`` (``resolve_once`` then ``check_server_args``)."""
    import json

    record, error = parse_only(argv)
    if record is None:
        return Resolution(argv=list(argv), error=error)
    device = getattr(record, "device", None)
    try:
        with resolving_for_gpu(device):
            record.resolve_once()
            record.check_server_args()
    except Exception as e:  # every startup refusal, sglang's or the plugin's
        return Resolution(argv=list(argv), server_args=record, error=f"{type(e).__name__}: {e}")
    resolved = json.loads(json.dumps(record.resolved_dict(), default=str))
    return Resolution(argv=list(argv), server_args=record, resolved=resolved)


@dataclass
class ConfigDirs:
    """Directories made for bare ``config.json`` paths; removed by :meth:`cleanup`."""

    made: List[str] = field(default_factory=list)

    def as_model_dir(self, path: Optional[str]) -> Optional[str]:
        """``path`` itself, or for a file a temporary directory holding it as ``config.json``
        (sglang loads a model directory or a hub id, never a bare file)."""
        if path is None or not os.path.isfile(path):
            return path
        d = tempfile.mkdtemp(prefix="sglang-dflash-pp-config-")
        shutil.copyfile(path, os.path.join(d, "config.json"))
        self.made.append(d)
        return d

    def cleanup(self) -> None:
        for d in self.made:
            shutil.rmtree(d, ignore_errors=True)
        self.made.clear()


def prepare_argv(argv: List[str], dirs: ConfigDirs) -> List[str]:
    """``argv`` with model and draft paths that name a file replaced by a directory holding it
    (appended, so argparse's last-wins rule applies to any alias the caller used), and with
    ``--device cuda`` when no device is given: the server being planned runs on CUDA."""
    record, _ = parse_only(argv)
    if record is None:
        return list(argv)
    out = list(argv)
    for flag, name in (
        (MODEL_PATH_FLAG, "model_path"),
        (DRAFT_PATH_FLAG, "speculative_draft_model_path"),
    ):
        path = getattr(record, name, None)
        new = dirs.as_model_dir(path)
        if new != path:
            out += [flag, new]
    if getattr(record, "device", None) is None:
        out += ["--device", "cuda"]  # no CUDA call during resolution (see resolving_for_gpu)
    return out
