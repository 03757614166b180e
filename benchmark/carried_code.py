"""The code a benchmark times on the GPU machine, which has no sglang: files copied from the
installed, patched wheel here (``carry``) and assembled there into an ``sglang`` package, with
named stand-ins for the few sglang imports they need besides each other (``assemble``)."""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Dict


def carry(directory: str, carried: Dict[str, str]) -> None:
    """Copy each wheel file (``name -> path under sglang/``) into ``directory`` as ``name``."""
    import importlib.util

    package = os.path.dirname(importlib.util.find_spec("sglang").origin)
    os.makedirs(directory, exist_ok=True)
    for name, rel in carried.items():
        shutil.copyfile(os.path.join(package, rel), os.path.join(directory, name))


def assemble(kernel_dir: str, carried: Dict[str, str], stand_ins: Dict[str, str]) -> str:
    """A directory holding an ``sglang`` package of the carried files at their wheel paths and
    the stand-ins (``path -> source``); put it first on ``sys.path``."""
    root = tempfile.mkdtemp(prefix="carried_sglang_")
    files = {f"sglang/{rel}": os.path.join(kernel_dir, name) for name, rel in carried.items()}
    for rel, src in files.items():
        os.makedirs(os.path.dirname(os.path.join(root, rel)), exist_ok=True)
        shutil.copyfile(src, os.path.join(root, rel))
    for rel, text in stand_ins.items():
        os.makedirs(os.path.dirname(os.path.join(root, rel)), exist_ok=True)
        with open(os.path.join(root, rel), "w") as f:
            f.write(text)
    for folder, _, names in os.walk(os.path.join(root, "sglang")):
        if "__init__.py" not in names:
            open(os.path.join(folder, "__init__.py"), "w").close()
    return root
