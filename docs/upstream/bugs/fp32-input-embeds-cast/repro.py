"""Stock 0.5.23: ``ModelRunner._extend_forward_kwargs`` casts ``input_embeds`` to bf16 for every model.

``model_executor/model_runner.py:1772``: ``kwargs["input_embeds"] = forward_batch.input_embeds.bfloat16()``.
For a bf16 model that is a no-op; for an fp32 (or fp16) model the embeddings reach the model in
the wrong dtype: rounded to bf16, and an fp32 layer given them raises a dtype mismatch. Any
device; the eager extend path (``runner/eager_runner.py:281``) and the prefill CUDA-graph path
(``model_runner.py:2047``) both build their kwargs here. DFLASH feeds the target's embeddings
through ``input_embeds``, which is how a fp32 DFLASH run meets it.

What runs: the real ``ModelRunner._extend_forward_kwargs`` on a runner built with
``object.__new__`` carrying the three attributes the method and the fix read (``support_pp``,
``is_generation``, ``dtype``), and a minimal stand-in for ``ForwardBatch`` with the four fields
the method reads (a real ``ForwardBatch`` needs a scheduled batch and a runner).

Run: ``python repro.py`` (stock sglang 0.5.23; no plugin is loaded, see ../stock_sglang.py).
"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import stock_sglang  # noqa: E402

stock_sglang.stock_only()

import torch  # noqa: E402

TARGETS = ["sglang.srt.model_executor.model_runner.ModelRunner._extend_forward_kwargs"]
HIDDEN = 8


def fp32_runner():
    from sglang.srt.model_executor.model_runner import ModelRunner

    runner = object.__new__(ModelRunner)
    runner.support_pp = False
    runner.is_generation = True
    runner.dtype = torch.float32  # the model's dtype (--dtype float32)
    return runner


def main() -> None:
    mode = stock_sglang.begin(TARGETS)
    embeds = torch.linspace(-1, 1, 3 * HIDDEN, dtype=torch.float32).reshape(3, HIDDEN) / 3
    forward_batch = SimpleNamespace(
        input_embeds=embeds, replace_embeds=None, replace_positions=None, input_ids=None
    )
    kwargs = fp32_runner()._extend_forward_kwargs(forward_batch, None)
    given = kwargs["input_embeds"]
    layer = torch.nn.Linear(HIDDEN, HIDDEN, dtype=torch.float32)  # an fp32 model's first layer
    try:
        layer(given)
        first_layer = "ok"
    except RuntimeError as e:
        first_layer = f"RuntimeError: {str(e).splitlines()[0]}"

    observed = {
        "input_embeds_dtype": str(given.dtype),
        "max_abs_change": float((given.float() - embeds).abs().max()),
        "fp32_first_layer": first_layer,
    }
    expected = {"input_embeds_dtype": "torch.float32", "max_abs_change": 0.0, "fp32_first_layer": "ok"}
    stock_sglang.compare(
        mode, TARGETS, "fp32-input-embeds-cast", observed, expected,
    )


if __name__ == "__main__":
    main()
