"""Where a benchmark result came from, recorded in the result file itself.

Every committed result file carries: UTC date, project commit (and whether the tree had
uncommitted changes), the exact command, the device, the torch / triton / sglang / NCCL /
Mooncake versions present, repetitions, warm-up count and the raw samples. README figures quote
the median and the min-max of those samples (:func:`summary`).

On the GPU machine the tree travels without ``.git``; the caller then passes the commit in
``PROJECT_COMMIT`` (and ``PROJECT_TREE=dirty`` when the working tree had changes), read here.
``source_sha256`` hashes the files whose code was timed, so a result can be matched to a tree
even before it is committed.
"""

from __future__ import annotations

import datetime
import hashlib
import importlib.metadata
import os
import platform
import shlex
import statistics
import subprocess
import sys
from typing import Dict, Iterable, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _git(*args: str) -> Optional[str]:
    try:
        out = subprocess.run(
            ["git", "-C", ROOT, *args], capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def project_commit() -> Dict[str, Optional[str]]:
    commit = os.environ.get("PROJECT_COMMIT") or _git("rev-parse", "HEAD")
    tree = os.environ.get("PROJECT_TREE")
    if tree is None:
        status = _git("status", "--porcelain", "--untracked-files=no")
        tree = None if status is None else ("dirty" if status else "clean")
    return {"commit": commit, "tree": tree}


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def versions() -> Dict[str, str]:
    out = {"python": platform.python_version()}
    try:
        import torch

        out["torch"] = torch.__version__
        out["cuda"] = str(torch.version.cuda)
        try:
            out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as e:  # no CUDA build or no NCCL
            out["nccl"] = f"unavailable ({type(e).__name__})"
    except ImportError:
        out["torch"] = "not installed"
    out["triton"] = _version("triton")
    out["sglang"] = _version("sglang")
    out["mooncake"] = next(
        (
            f"{d} {v}"
            for d in ("mooncake-transfer-engine", "mooncake-transfer-engine-non-cuda")
            if (v := _version(d)) != "not installed"
        ),
        "not installed",
    )
    return out


def device() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.get_device_name()} x{torch.cuda.device_count()}"
    except ImportError:
        pass
    return f"CPU only: {os.cpu_count()} CPUs, {platform.platform()}"


def source_sha256(paths: Iterable[str]) -> Dict[str, str]:
    out = {}
    for p in paths:
        full = p if os.path.isabs(p) else os.path.join(ROOT, p)
        with open(full, "rb") as f:
            out[os.path.relpath(full, ROOT)] = hashlib.sha256(f.read()).hexdigest()
    return out


def record(*, repetitions: int, warmup: int, timed_sources: Iterable[str] = (), **extra) -> dict:
    """The provenance block of a result file (the raw samples go next to it, per measurement)."""
    return dict(
        date_utc=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        project=project_commit(),
        command=" ".join(shlex.quote(a) for a in [os.path.basename(sys.executable), *sys.argv]),
        cwd_relative_to_repo=os.path.relpath(os.getcwd(), ROOT),
        device=device(),
        load_average_1_5_15_min=list(os.getloadavg()),  # a shared machine's other work shows here
        versions=versions(),
        repetitions=repetitions,
        warmup=warmup,
        source_sha256=source_sha256(timed_sources),
        **extra,
    )


def summary(samples: List[float]) -> dict:
    """Median and range of raw samples, the form README quotes."""
    return dict(
        median=statistics.median(samples), min=min(samples), max=max(samples), n=len(samples)
    )
