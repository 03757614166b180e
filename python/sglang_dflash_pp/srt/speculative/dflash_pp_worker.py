"""``PPDFlashWorkerV2``: DFlash on one PP stage of a PD prefill server (a subclass of 0.5.23's
``DFlashWorkerV2``; selected by the ``create_worker`` hook in ``worker_selection``, which first
refuses to start it without every hook of ours applied).

Why a subclass and not the stock worker: stock ``DFlashWorkerV2`` builds the full draft, its runner
and its KV pool on every stage, and on a non-last stage dereferences ``logits_output`` and
``next_token_ids``, which are None there. Ours:

* non-last stages hold no draft model, runner or KV pool (so they expose no draft pool to the PD
  layer and never send draft KV), only the ``[H, H]`` ``fc`` blocks of the features they capture,
  read from the draft checkpoint; they run the target with full capture and replace the raw capture
  in the outbound proxy with the running partial (``pp_stage_carry``);
* every stage records, after its forward, the event the KV transfer of the batch's requests
  waits on (``kv_write_fence``: sglang's own ordering of a middle chunk's send after its
  forward is lost under ``--pp-async-batch-depth`` and ``SGLANG_PP_COMM_OVERLAP``);
* the last stage is the stock worker with the inbound partial stashed on the draft model around the
  stock forward (the ``models/dflash.py`` hook finishes it), minus the two target-embedding steps
  that cannot run where the embedding is not local, and minus the verify-sampling rehearsal (a
  prefill server never verifies); it builds its draft with the target's synchronised seed and
  the stage-local load group (``last_stage_draft_build``: stock would deadlock here), and the
  draft build reads the stage's features from the same context to build it KV-write-only
  (``kv_write_draft``: no query rows, ``o_proj`` or MLPs, and only its own ``fc`` column
  block), since a prefill server never runs the draft forward.

Under dummy draft weights (``--speculative-draft-load-format dummy``, or ``--load-format dummy``
when that is unset, as the draft runner resolves it) a non-last stage reads nothing from the draft
directory: its blocks are the columns of the ``fc`` the full draft's dummy load produces
(``dummy_draft_weights``), the values the last stage's dummy draft and a PP1 server hold too.

Importing this module imports sglang's scheduler stack; the hooks import it only when a DFLASH PP
prefill worker is actually created.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

import torch
from sglang.srt.distributed.utils import get_pp_indices
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
from sglang.srt.model_loader.weight_utils import get_pp_stage_load_group
from sglang.srt.runtime_context import get_model, get_parallel, get_spec
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker
from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2
from sglang.srt.speculative.draft_parallel import (
    model_draft_parallel_spec,
    resolve_draft_parallel_layout,
)
from sglang.srt.speculative.spec_utils import draft_pp_context, draft_tp_context

from sglang_dflash_pp.srt.disaggregation.kv_write_fence import record_kv_written
from sglang_dflash_pp.srt.models.capture_ownership import (
    FeatureOwnership,
    capture_convention,
    compute_feature_ownership,
)
from sglang_dflash_pp.srt.models.context_partial import carry_dtype_from_env
from sglang_dflash_pp.srt.models.last_stage_context import LastStageContext, stashed_context
from sglang_dflash_pp.srt.models.dflash_fc_columns import load_fc_column_blocks, stage_fc_block
from sglang_dflash_pp.srt.models.dummy_draft_weights import dummy_fc_column_blocks, is_dummy
from sglang_dflash_pp.srt.speculative.pp_stage_carry import (
    StageCarry,
    inbound_partial,
    replace_capture_with_partial,
)
from sglang_dflash_pp.srt.speculative.last_stage_draft_build import last_stage_draft_build

logger = logging.getLogger(__name__)


def stage_ownership(target_worker) -> FeatureOwnership:
    """Ownership from what this process's target really captures and sglang's own partition."""
    runner = target_worker.model_runner
    text_config = runner.model_config.hf_text_config
    num_layers = int(text_config.num_hidden_layers) * int(getattr(text_config, "num_loops", 1))
    pp_size, pp_rank = get_parallel().pp_size, get_parallel().pp_rank
    stage_layers = [get_pp_indices(num_layers, rank, pp_size) for rank in range(pp_size)]
    model = runner.model
    actual = (getattr(model, "start_layer", None), getattr(model, "end_layer", None))
    if None not in actual and tuple(actual) != tuple(stage_layers[pp_rank]):
        raise RuntimeError(
            f"PP stage {pp_rank} holds target layers [{actual[0]}, {actual[1]}) but the "
            f"partition says {stage_layers[pp_rank]}; cannot assign DFlash features."
        )
    ids = runner.spec_aux_config.dflash_target_layer_ids
    architectures = getattr(runner.model_config.hf_config, "architectures", None) or []
    convention = capture_convention(architectures)
    if convention is None:
        raise RuntimeError(
            f"DFLASH PP stage {pp_rank}: target {architectures} does not capture on every PP "
            "stage; startup resolution should have refused it."
        )
    return compute_feature_ownership(stage_layers, ids, num_layers, convention)


def draft_load_format():
    """The draft's load format as its model runner resolves it: its own flag, else the target's."""
    own = get_spec().speculative_draft_load_format
    return own if own is not None else get_model().load_format


def _local_draft_dir(path: str, revision: Optional[str]) -> str:
    if os.path.isdir(path):
        return path
    from huggingface_hub import snapshot_download

    return snapshot_download(path, revision=revision, allow_patterns=["*.json", "*.safetensors"])


class PPDFlashWorkerV2(DFlashWorkerV2):
    """DFLASH worker of one PP stage of a PD prefill server; see the module docstring."""

    def __init__(self, server_args, gpu_id, nccl_port, target_worker):
        ownership = stage_ownership(target_worker)
        draft_model_config = target_worker.model_runner.spec_aux_config.draft_model_config
        hidden = int(draft_model_config.hf_config.hidden_size)
        self._carry = StageCarry.of(ownership, get_parallel().pp_rank, hidden)
        self._carry_dtype = carry_dtype_from_env()
        self._hosts_draft = self._carry.is_last
        if self._hosts_draft:
            with last_stage_draft_build(
                get_pp_stage_load_group(), target_worker.random_seed, self._carry.features
            ):
                super().__init__(server_args, gpu_id, nccl_port, target_worker)
            self._w_stage = stage_fc_block(self.draft_model, self._carry.features, hidden)
        else:
            BaseSpecWorker.__init__(self)
            self.server_args = server_args
            self.gpu_id = gpu_id
            self.nccl_port = nccl_port
            self._target_worker = target_worker
            self.model_runner = target_worker.model_runner
            self.device = target_worker.device
            self._draft_worker = None
            # The same layout the stock worker resolves, so every stage sizes its target
            # KV cells identically (they budget the draft share per token).
            self.draft_parallel_layout = resolve_draft_parallel_layout(
                model_draft_parallel_spec(
                    draft_model_config,
                    spec_algorithm=target_worker.model_runner.spec_algorithm,
                ),
                collapse_cp=True,
            )
            self._w_stage = self._load_stage_columns(ownership, hidden, draft_model_config)
        if get_parallel().tp_rank == 0:
            logger.info(
                "DFLASH PP stage %d/%d: features %s; carry in: %s; carry out: %s; %s.",
                self._carry.stage,
                self._carry.pp_size,
                list(self._carry.features),
                "yes" if self._carry.receives else "none",
                str(self._carry_dtype).replace("torch.", "") if self._carry.sends else "none",
                "hosts the KV-write-only draft" if self._hosts_draft else "no draft",
            )

    def _load_stage_columns(self, ownership, hidden, draft_model_config) -> Optional[torch.Tensor]:
        if not self._carry.features:
            return None
        dtype = self.model_runner.model_config.dtype
        if is_dummy(draft_load_format()):
            block = dummy_fc_column_blocks(
                self._carry.features,
                hidden,
                ownership.num_features,
                dtype=draft_model_config.dtype,  # the dtype the last stage's fc is filled in
                device=self.device,
            )
            return block.to(dtype)
        spec = get_spec()
        draft_dir = _local_draft_dir(
            spec.speculative_draft_model_path, spec.speculative_draft_model_revision
        )
        block = load_fc_column_blocks(
            draft_dir, self._carry.features, hidden, ownership.num_features, dtype=dtype
        )
        return block.to(self.device)

    # -- what a non-last stage does not have ---------------------------------------------

    def weight_update_runners(self):
        return super().weight_update_runners() if self._hosts_draft else []

    @property
    def spec_v2_attn_backends(self) -> tuple:
        if self._hosts_draft:
            return super().spec_v2_attn_backends
        return BaseSpecWorker.spec_v2_attn_backends.fget(self)

    def alloc_memory_pool(self, *args, **kwargs):
        if self._hosts_draft:
            return super().alloc_memory_pool(*args, **kwargs)
        return BaseSpecWorker.alloc_memory_pool(self, *args, **kwargs)

    def init_attention_backends(self):
        if self._hosts_draft:
            super().init_attention_backends()

    def init_cuda_graphs(self):
        # Stock captures a draft decode graph whenever the decode graph backend is on (an
        # explicit --cuda-graph-backend-decode keeps it on for a prefill server). A prefill
        # server never runs a draft decode step, and the KV-write-only draft has no o_proj or
        # MLP to capture: the capture would raise on the last stage while the others wait.
        if self._hosts_draft:
            with draft_pp_context(), draft_tp_context(self.draft_parallel_layout):
                self._draft_worker.init_cuda_graphs(capture_decode_cuda_graph=False)

    def prewarm_sampling(self):
        # A prefill server samples one token per request and never verifies.
        return self.model_runner.prewarm_sampling()

    # -- last stage: steps that need the target embedding, which is not local ------------

    def _maybe_merge_trained_mask_embedding(self) -> None:
        # The mask embedding only feeds draft blocks, which run on the decode server.
        return None

    def _cache_full_embed_weight(self) -> None:
        return None

    # -- forward ---------------------------------------------------------------------------

    def forward_batch_generation(
        self, batch, on_publish=None, grammar_barrier=None, pp_proxy_tensors=None
    ):
        inbound = None if pp_proxy_tensors is None else pp_proxy_tensors.tensors
        if self._hosts_draft:
            context = LastStageContext(self._w_stage, inbound_partial(self._carry, inbound))
            with stashed_context(self.draft_model, context):
                result = super().forward_batch_generation(
                    batch,
                    on_publish=on_publish,
                    grammar_barrier=grammar_barrier,
                    pp_proxy_tensors=pp_proxy_tensors,
                )
            # The target and the draft KV of this forward are written: every later transfer of
            # these requests waits on this event (kv_write_fence).
            record_kv_written(getattr(batch, "reqs", ()), self.device)
            return result
        result = self.target_worker.forward_batch_generation(
            batch,
            pp_proxy_tensors=pp_proxy_tensors,
            capture_hidden_mode=CaptureHiddenMode.FULL,
        )
        replace_capture_with_partial(
            self._carry,
            result.pp_hidden_states_proxy_tensors.tensors,
            inbound,
            self._w_stage,
            self._carry_dtype,
        )
        result.new_seq_lens = batch.seq_lens
        record_kv_written(getattr(batch, "reqs", ()), self.device)
        if on_publish is not None:
            on_publish(result.new_seq_lens)
        return result

