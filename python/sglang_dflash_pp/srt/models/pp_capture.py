"""DFlash feature capture on every PP stage of a standard decoder stack (the patch to
``models/llama.py``, ``models/qwen3.py``, ``models/qwen3_moe.py`` and ``models/gpt_oss.py`` of
sglang 0.5.23).

Hook: AROUND ``set_dflash_layers_to_capture`` of ``LlamaForCausalLM``, ``Qwen3ForCausalLM``,
``Qwen3MoeForCausalLM`` and ``GptOssForCausalLM``.

Why: stock returns early from that setter on every PP rank but the last, so under PP only the
last stage captures the draft's context features and the earlier stages' layers are lost.
Kimi-K3 instead captures on every stage and relays the captures in the PP proxy as
``dspark_hidden_states``, which the PP worker turns into the context partial
(``speculative/pp_stage_carry``). On a non-last stage of a DFLASH PP prefill server this hook
gives these models the same behaviour: after the stock setter it arms the stage's own capture
points (the input of layer ``L + 1`` for every draft layer ``L``, as the stock setter arms them
on the last stage) and puts the stage's captures into the outbound proxy under the same key.

How, without copying the model's forward: the decoder layers already take a capture argument
(``capture_output`` for Llama, Qwen3 and gpt-oss; the accumulator ``captured_last_layer_outputs``
for Qwen3-MoE) that the forward passes only where ``layers_to_capture`` says. Torch module hooks,
installed on this stage's inner model and its capture layers only: a forward pre-hook on the
model opens a per-forward accumulator, a pre-hook on each capture layer hands it in through the
layer's own capture argument (so the stock capture path of the layer boundary does the work),
and a forward hook on the model moves the packed ``[T, k_s * H]`` captures into the returned
``PPProxyTensors``. The last stage and every other configuration (PP1, DSPARK, EAGLE3, decode)
keep the stock setter's behaviour: the hook calls it and returns. The capture itself is
``stage_capture`` (the module that moves in-tree).
"""

from __future__ import annotations

from typing import Dict

from sglang_dflash_pp.hooks import PluginHook
from sglang_dflash_pp.srt.models.stage_capture import (  # noqa: F401 (tests' names)
    StageCapture,
    arm_stage_capture,
    stage_capture_layers,
)
from sglang_dflash_pp.srt.pp_prefill_role import serving_dflash_pp_prefill

# Hooked class (dotted) -> the decoder layer's capture keyword, and whether it takes the
# accumulator itself (True) or its ``capture`` callback (False). One test per class
# (test_pp_capture.py); the architecture names are ``capture_ownership.PP_CAPTURE_TARGETS``.
HOOKED_CLASSES: Dict[str, tuple] = {
    "sglang.srt.models.llama.LlamaForCausalLM": ("capture_output", False),
    "sglang.srt.models.qwen3.Qwen3ForCausalLM": ("capture_output", False),
    "sglang.srt.models.qwen3_moe.Qwen3MoeForCausalLM": ("captured_last_layer_outputs", True),
    "sglang.srt.models.gpt_oss.GptOssForCausalLM": ("capture_output", False),
}


def set_dflash_layers_to_capture_around(original, self, layer_ids, *args, **kwargs):
    result = original(self, layer_ids, *args, **kwargs)
    if self.pp_group.is_last_rank or not serving_dflash_pp_prefill():
        return result
    arm_stage_capture(self, layer_ids, *HOOKED_CLASSES[_hooked_name(type(self))])
    return result


def _hooked_name(klass) -> str:
    for base in klass.__mro__:
        name = f"{base.__module__}.{base.__qualname__}"
        if name in HOOKED_CLASSES:
            return name
    raise KeyError(klass)


HOOKS = tuple(
    PluginHook(
        f"{cls}.set_dflash_layers_to_capture",
        set_dflash_layers_to_capture_around,
        "around",
        "DFLASH PP prefill: capture the draft's features on every PP stage, not only the last",
    )
    for cls in HOOKED_CLASSES
)
