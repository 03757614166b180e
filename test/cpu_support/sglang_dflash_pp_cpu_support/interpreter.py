"""Test-only: Kimi-K3 on a CPU under the Triton interpreter (``TRITON_INTERPRET=1``).

Kimi-K3's KDA layers and its MLA attention exist only as Triton kernels; the interpreter runs
them on CPU tensors (slowly). Its gaps, each bypassed here and only while ``TRITON_INTERPRET=1``
(``test/cpu_support/README.md`` section 3):

* ``models/kimi_k3.py`` builds three ``torch.cuda.Stream()`` unconditionally: with no CUDA
  driver, ``torch.cuda.Stream`` becomes a no-op class (nothing runs on alternate streams on CPU).
* ``triton.runtime.autotuner.Autotuner`` benchmarks its configs through the active driver, which
  the interpreter does not have: it keeps the first config (timings decide nothing on CPU).
* ``kernels/ops/attention/fla/op.py`` binds ``exp = tl.exp`` (and ``exp2``, ``log``, ``log2``) at
  import, and ``fla/kda.py`` calls ``libdevice.exp``: the interpreter only swaps ``tl`` calls
  made inside jit bodies, so module-level aliases reach the compiler stubs ("Did you forget to
  add @triton.jit?") and ``libdevice.exp`` returns None. They become ``@triton.jit`` wrappers of
  the same ``tl`` functions.
* ``triton.runtime.interpreter.InterpreterBuilder`` has no ``get_bf16`` (a bf16 constant); added,
  with the interpreter's own float32 -> bfloat16 conversion.

The kernels' math is untouched: every kernel still runs, in the interpreter.
"""

from __future__ import annotations

import os
import sys


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


class _NoStream:
    """``torch.cuda.Stream`` stand-in on a CUDA-less box."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        return None

    def synchronize(self):
        return None


class _LibdeviceView:
    """``libdevice`` as fla/kda.py uses it, with ``exp`` usable by the interpreter."""

    def __init__(self, real, math):
        self._real, self._math = real, math

    def __getattr__(self, name):
        if name in self._math:
            return self._math[name]
        return getattr(self._real, name)


def install() -> None:
    if not interpreting():
        return
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import autotuner
    from triton.runtime import interpreter as tri

    if not torch.cuda.is_available():
        torch.cuda.Stream = _NoStream

    prune = autotuner.Autotuner.prune_configs
    if not getattr(prune, "_cpu_support", False):

        def first_config(self, kwargs):
            return prune(self, kwargs)[:1]

        first_config._cpu_support = True
        autotuner.Autotuner.prune_configs = first_config

    if not hasattr(tri.InterpreterBuilder, "get_bf16"):

        def get_bf16(self, value):
            f32 = np.array([value], dtype=np.float32)
            data = tri._convert_float(f32, tl.float32, tl.bfloat16, None).view(np.uint16)
            return tri.TensorHandle(data, tl.bfloat16)

        tri.InterpreterBuilder.get_bf16 = get_bf16

    from sglang_dflash_pp_cpu_support.interpreter_math import MATH as math
    from sglang.kernels.ops.attention.fla import op

    originals = {name: getattr(op, name) for name in math}
    for name, fn in math.items():
        setattr(op, name, fn)
    # Modules that already bound the aliases by name.
    for module_name, module in list(sys.modules.items()):
        if not module_name.startswith("sglang.kernels.ops.attention.fla"):
            continue
        for name, fn in math.items():
            if getattr(module, name, None) is originals[name]:
                setattr(module, name, fn)
    from sglang.kernels.ops.attention.fla import kda

    if not isinstance(kda.libdevice, _LibdeviceView):
        kda.libdevice = _LibdeviceView(kda.libdevice, math)
