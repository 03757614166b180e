"""An empty prompt is refused at a DFLASH PP prefill's door (the patch to
``managers/scheduler.py``, 0.5.23).

Stock admits a generate request with 0 prompt tokens: neither the tokenizer manager's length check
(``TokenizerManager._validate_one_request``) nor the scheduler's (``validate_input_length``) has a
lower bound, so the request is scheduled as a 0-token extend and the target's first attention
layer raises in the forward (on CPU ``RotaryEmbedding.forward_native`` cannot view 0 elements;
``docs/upstream/bugs/empty-prompt/``). Under PP every stage runs that forward; a stage that
raises takes the prefill server down (or leaves the other stages waiting on it), and every request
in flight with it.

Hook (inert unless this process is a stage of a DFLASH PP prefill, and for every non-empty
prompt):

* AFTER ``sglang.srt.managers.scheduler.validate_dflash_request`` (the DFLASH request check
  ``Scheduler._handle_generate_request`` runs on every rank for every new request): name the
  empty prompt as the request's error. Stock then refuses it exactly as it refuses any request
  this check rejects: ``set_finish_with_abort`` and ``_add_request_to_queue``, where the PD
  prefill's bootstrap queue retires an intake reject (``is_unadmitted_reject`` ->
  ``retire_unadmitted_request``) before it has a KV sender, a metadata buffer or a batch. Every
  PP stage decides from the request alone, so all stages refuse it and none runs a forward.

The check runs after stock's own verdict and keeps it when stock already refused the request.
It cannot help the decode: a stock decode that gets the same request from the router cannot
release a 0-token request (the report's decode half), so that needs the upstream fix.
"""

from __future__ import annotations

from sglang_dflash_pp.hooks import PluginHook
from sglang_dflash_pp.srt.pp_prefill_role import serving_dflash_pp_prefill

EMPTY_PROMPT_ERROR = (
    "The prompt is empty (0 input tokens). A DFLASH pipeline-parallel prefill server needs at "
    "least one prompt token to prefill; send a non-empty prompt."
)


def refuse_empty_prompt(error, req, *args, **kwargs):
    if error is None and len(req.origin_input_ids) == 0 and serving_dflash_pp_prefill():
        return EMPTY_PROMPT_ERROR
    return error


HOOKS = (
    PluginHook(
        "sglang.srt.managers.scheduler.validate_dflash_request",
        refuse_empty_prompt,
        "after",
        "DFLASH PP prefill: a 0-token prompt is refused at admission, before any PP stage's forward",
    ),
)
