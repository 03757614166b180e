"""``@triton.jit`` wrappers of ``tl`` math for fla's module-level aliases under the interpreter
(see ``interpreter``). Module level on purpose: the interpreter needs ``triton.language`` among
a jit function's module globals. Imported only with ``TRITON_INTERPRET=1``."""

import triton
import triton.language as tl


@triton.jit
def exp(x):
    return tl.exp(x)


@triton.jit
def exp2(x):
    return tl.math.exp2(x)


@triton.jit
def log(x):
    return tl.log(x)


@triton.jit
def log2(x):
    return tl.log2(x)


MATH = {"exp": exp, "exp2": exp2, "log": log, "log2": log2}
