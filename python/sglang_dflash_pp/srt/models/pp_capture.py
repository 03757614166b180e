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
keep the stock setter's behaviour: the hook calls it and returns.
"""

from __future__ import annotations

import logging
from typing import Dict, List, Sequence

from sglang_dflash_pp.hooks import PluginHook
from sglang_dflash_pp.srt.pp_prefill_role import serving_dflash_pp_prefill
from sglang_dflash_pp.srt.speculative.pp_stage_carry import CAPTURE_KEY

logger = logging.getLogger(__name__)

# Hooked class (dotted) -> the decoder layer's capture keyword, and whether it takes the
# accumulator itself (True) or its ``capture`` callback (False). One test per class
# (test_pp_capture.py); the architecture names are ``capture_ownership.PP_CAPTURE_TARGETS``.
HOOKED_CLASSES: Dict[str, tuple] = {
    "sglang.srt.models.llama.LlamaForCausalLM": ("capture_output", False),
    "sglang.srt.models.qwen3.Qwen3ForCausalLM": ("capture_output", False),
    "sglang.srt.models.qwen3_moe.Qwen3MoeForCausalLM": ("captured_last_layer_outputs", True),
    "sglang.srt.models.gpt_oss.GptOssForCausalLM": ("capture_output", False),
}

_STATE_ATTR = "_dflash_pp_stage_capture"


def stage_capture_layers(layer_ids: Sequence[int], start: int, end: int) -> List[int]:
    """The layers of ``[start, end)`` whose input is a draft feature (``L + 1`` for each id)."""
    return sorted({int(i) + 1 for i in layer_ids if start <= int(i) + 1 < end})


class _StageCapture:
    """The torch hooks of one non-last stage's inner model; see the module docstring."""

    def __init__(self, model, capture_layers: Sequence[int], keyword: str, takes_accumulator: bool):
        from sglang.srt.layers.aux_hidden_states import AuxHiddenStateList

        self._new_accumulator = AuxHiddenStateList
        self.capture_layers = tuple(capture_layers)
        self.keyword = keyword
        self.takes_accumulator = takes_accumulator
        self.current = None
        self.handles = [
            model.register_forward_pre_hook(self._open),
            model.register_forward_hook(self._emit),
        ]
        for i in self.capture_layers:
            self.handles.append(
                model.layers[i].register_forward_pre_hook(self._hand_in, with_kwargs=True)
            )

    def _open(self, module, args):
        self.current = self._new_accumulator()

    def _hand_in(self, module, args, kwargs):
        if self.current is None or kwargs.get(self.keyword) is not None:
            return None
        value = self.current if self.takes_accumulator else self.current.capture
        return args, {**kwargs, self.keyword: value}

    def _emit(self, module, args, output):
        from sglang.srt.layers.aux_hidden_states import pack_aux_hidden_states
        from sglang.srt.model_executor.forward_batch_info import PPProxyTensors

        captured, self.current = self.current, None
        if not isinstance(output, PPProxyTensors):
            return None
        if captured is None or len(captured) != len(self.capture_layers):
            got = 0 if captured is None else len(captured)
            raise RuntimeError(
                f"DFLASH PP capture: this stage armed layers {list(self.capture_layers)} but "
                f"captured {got} feature(s) in one forward."
            )
        output.tensors[CAPTURE_KEY] = pack_aux_hidden_states(list(captured))
        return output


def set_dflash_layers_to_capture_around(original, self, layer_ids, *args, **kwargs):
    result = original(self, layer_ids, *args, **kwargs)
    if self.pp_group.is_last_rank or not serving_dflash_pp_prefill():
        return result
    keyword, takes_accumulator = HOOKED_CLASSES[_hooked_name(type(self))]
    model = self.model
    layers = stage_capture_layers(layer_ids, int(model.start_layer), int(model.end_layer))
    previous = model.__dict__.get(_STATE_ATTR)
    if previous is not None:  # armed twice (weight reload): replace, never stack
        for handle in previous.handles:
            handle.remove()
    if layers:
        model.__dict__[_STATE_ATTR] = _StageCapture(model, layers, keyword, takes_accumulator)
    logger.info(
        "DFLASH PP stage %d: %s captures the input of layers %s for the draft's context.",
        self.pp_group.rank_in_group,
        type(self).__name__,
        layers,
    )
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
