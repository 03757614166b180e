"""DFlash feature capture on a non-last PP stage of a standard decoder stack (Llama, Qwen3,
Qwen3-MoE, gpt-oss), relayed to the next stage in the PP proxy.

``set_dflash_layers_to_capture`` of these models arms capture on the last PP stage only, so under
PP the earlier stages' layers would be lost. Kimi-K3 instead captures on every stage and relays
the captures in the PP proxy as ``dspark_hidden_states`` (:data:`CAPTURE_KEY`), which the PP
worker turns into the context partial. :func:`arm_stage_capture` gives a non-last stage of a
DFLASH PP prefill the same behaviour: it arms the stage's own capture points (the input of layer
``L + 1`` for every draft layer ``L``, as the setter arms them on the last stage) and puts the
stage's captures into the outbound proxy under that key.

How, without another forward: the decoder layers already take a capture argument
(``capture_output`` for Llama, Qwen3 and gpt-oss; the accumulator ``captured_last_layer_outputs``
for Qwen3-MoE) that the forward passes only where ``layers_to_capture`` says. Torch module hooks,
installed on this stage's inner model and its capture layers only: a forward pre-hook on the
model opens a per-forward accumulator, a pre-hook on each capture layer hands it in through the
layer's own capture argument (so the capture path of the layer boundary does the work), and a
forward hook on the model moves the packed ``[T, k_s * H]`` captures into the returned
``PPProxyTensors``. Arming twice (a weight reload) replaces the hooks, never stacks them.
"""

from __future__ import annotations

import logging
from typing import List, Sequence

logger = logging.getLogger(__name__)

CAPTURE_KEY = "dspark_hidden_states"  # the PP proxy key a stage's raw captures travel under

_STATE_ATTR = "_dflash_pp_stage_capture"


def stage_capture_layers(layer_ids: Sequence[int], start: int, end: int) -> List[int]:
    """The layers of ``[start, end)`` whose input is a draft feature (``L + 1`` for each id)."""
    return sorted({int(i) + 1 for i in layer_ids if start <= int(i) + 1 < end})


class StageCapture:
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


def arm_stage_capture(
    causal_lm, layer_ids: Sequence[int], keyword: str, takes_accumulator: bool = False
) -> None:
    """Arm the capture of this (non-last) stage's draft features on ``causal_lm.model``.

    ``keyword`` is the decoder layer's capture argument; ``takes_accumulator`` says whether it
    takes the accumulator itself (Qwen3-MoE) or its ``capture`` callback."""
    model = causal_lm.model
    layers = stage_capture_layers(layer_ids, int(model.start_layer), int(model.end_layer))
    previous = model.__dict__.get(_STATE_ATTR)
    if previous is not None:  # armed twice (weight reload): replace, never stack
        for handle in previous.handles:
            handle.remove()
        model.__dict__.pop(_STATE_ATTR, None)
    if layers:
        model.__dict__[_STATE_ATTR] = StageCapture(model, layers, keyword, takes_accumulator)
    logger.info(
        "DFLASH PP stage %d: %s captures the input of layers %s for the draft's context.",
        causal_lm.pp_group.rank_in_group,
        type(causal_lm).__name__,
        layers,
    )
