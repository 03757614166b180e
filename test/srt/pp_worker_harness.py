"""Drive ``PPDFlashWorkerV2`` on CPU with the real draft model, the real stock forward path and a
real CPU ``MHATokenToKVPool``.

Two stand-ins, each because nothing real can run here:

* ``CapturingTarget`` stands in for the target ``TpModelWorker.forward_batch_generation``: Kimi-K3's
  forward needs Triton (KDA) and CUDA MLA kernels. It returns exactly what the real one returns to
  the DFLASH worker: on a non-last stage a ``GenerationBatchResult`` whose proxy holds
  ``hidden_states`` and the stage's raw captures under ``dspark_hidden_states`` (the K3 relay
  key), on the last stage ``logits_output.hidden_states`` = its own captures, the sampled token and
  a real ``KVLocPlan`` over the draft pool's translator. Captured features are a deterministic
  function of (feature, request, absolute position), so any stage or chunk can reproduce them.
* The last-stage worker is assembled with ``object.__new__`` plus the attributes the stock
  ``DFlashWorkerV2.forward_batch_generation`` reads: its real ``__init__`` builds a draft
  ``TpModelWorker`` with a model runner and CUDA memory pools. Non-last stages use the real
  ``__init__``.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Dict, List, Optional, Sequence

import torch

import tiny_models

TARGET_LAYERS = 8
TARGET_LAYER_IDS = (1, 3, 5, 7)
HIDDEN = tiny_models.HIDDEN
KV_HEADS = tiny_models.DRAFT_KV_HEADS
HEAD_DIM = tiny_models.DRAFT_HEAD_DIM
POOL_SIZE = 512


def draft_config() -> dict:
    return tiny_models.dflash_draft_config(TARGET_LAYER_IDS, num_target_layers=TARGET_LAYERS)


def target_text_config() -> SimpleNamespace:
    return SimpleNamespace(num_hidden_layers=TARGET_LAYERS)


def build_draft_model(path: str, dtype: torch.dtype, seed: int = 0):
    """The real ``DFlashDraftModel`` with seeded weights, saved as a safetensors checkpoint."""
    from safetensors.torch import save_file
    from sglang.srt.models.dflash import DFlashDraftModel
    from sglang.srt.utils.hf_transformers_utils import get_config

    tiny_models.write_model_dir(path, draft_config())
    torch.manual_seed(seed)
    model = DFlashDraftModel(get_config(path, trust_remote_code=True)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.ndim == 1 else 0.0))
    model = model.to(dtype)
    save_file({"fc.weight": model.fc.weight.detach().contiguous()}, os.path.join(path, "model.safetensors"))
    return model


def feature(j: int, request: int, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Captured output of target layer ``TARGET_LAYER_IDS[j]`` for ``positions`` of a request."""
    rows = []
    for pos in positions.tolist():
        g = torch.Generator().manual_seed(1_000_003 * (j + 1) + 7919 * request + pos)
        rows.append(torch.randn(HIDDEN, generator=g) * (1 + j))
    return torch.stack(rows).to(dtype) if rows else torch.zeros(0, HIDDEN, dtype=dtype)


class Chunk:
    """One forward batch: ``[(request, start, end), ...]`` extend spans, plus trailing padding rows
    (the TP/EP alignment rows the stock writer trims)."""

    def __init__(self, spans, out_cache_loc: torch.Tensor, padding_rows: int = 0):
        self.spans = list(spans)
        self.out_cache_loc = out_cache_loc
        self.padding_rows = padding_rows

    @property
    def num_tokens(self) -> int:
        return sum(end - start for _, start, end in self.spans)

    def captures(self, features: Sequence[int], dtype) -> Optional[torch.Tensor]:
        if not features:
            return None
        cols = []
        for j in features:
            parts = [feature(j, r, torch.arange(a, b), dtype) for r, a, b in self.spans]
            parts.append(torch.full((self.padding_rows, HIDDEN), 1e4, dtype=dtype))
            cols.append(torch.cat(parts))
        return torch.cat(cols, dim=-1)

    def schedule_batch(self):
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        return SimpleNamespace(
            forward_mode=ForwardMode.EXTEND,
            is_extend_in_batch=False,
            sampling_info=None,
            extend_lens=[b - a for _, a, b in self.spans],
            prefix_lens=[a for _, a, _ in self.spans],
            out_cache_loc=self.out_cache_loc,
            seq_lens=torch.tensor([b for _, _, b in self.spans]),
            hicache_consumer_index=-1,
        )


class CapturingTarget:
    """Stand-in for the target worker's forward on one PP stage (see module docstring)."""

    def __init__(self, features: Sequence[int], is_last: bool, dtype, translator=None):
        self.features = tuple(features)
        self.is_last = is_last
        self.dtype = dtype
        self.translator = translator
        self.chunk: Optional[Chunk] = None
        self.device = "cpu"
        self.calls: List[dict] = []

    def forward_batch_generation(self, batch, pp_proxy_tensors=None, capture_hidden_mode=None, return_kv_loc_plan=False):
        from sglang.srt.layers.logits_processor import LogitsProcessorOutput
        from sglang.srt.managers.scheduler import GenerationBatchResult
        from sglang.srt.mem_cache.kv_loc_plan import KVLocPlan
        from sglang.srt.model_executor.forward_batch_info import PPProxyTensors

        self.calls.append(dict(capture_hidden_mode=capture_hidden_mode, inbound=pp_proxy_tensors))
        chunk = self.chunk
        rows = chunk.num_tokens + chunk.padding_rows
        local = chunk.captures(self.features, self.dtype)
        if not self.is_last:
            tensors = {"hidden_states": torch.zeros(rows, HIDDEN, dtype=self.dtype)}
            if local is not None:
                tensors["dspark_hidden_states"] = local
            return GenerationBatchResult(pp_hidden_states_proxy_tensors=PPProxyTensors(tensors))
        plan = KVLocPlan(
            source=self.translator,
            req_pool_indices=torch.arange(len(chunk.spans)),
            seq_lens=batch.seq_lens,
            seq_lens_cpu=batch.seq_lens,
            write_virtual=chunk.out_cache_loc,
        )
        return GenerationBatchResult(
            logits_output=LogitsProcessorOutput(next_token_logits=None, hidden_states=local),
            next_token_ids=torch.arange(len(chunk.spans)) + 100,
            kv_loc_plan=plan,
        )


def draft_pool(dtype):
    from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    pool = MHATokenToKVPool(
        size=POOL_SIZE,
        page_size=1,
        dtype=dtype,
        head_num=KV_HEADS,
        head_dim=HEAD_DIM,
        layer_num=2,
        device="cpu",
        enable_memory_saver=False,
    )
    translator = KVIndexTranslator(
        req_to_token=torch.zeros(4, POOL_SIZE, dtype=torch.int32),
        token_to_kv_pool_allocator=None,
        token_to_kv_pool=pool,
        page_size=1,
        device="cpu",
    )
    return pool, translator


def pool_image(pool) -> torch.Tensor:
    return torch.stack([torch.stack([k, v]) for k, v in zip(pool.k_buffer, pool.v_buffer)]).float()


def last_stage_worker(draft_model, carry, target: CapturingTarget, pool, translator, carry_dtype=torch.float32):
    """See the module docstring: the attributes the stock forward path reads, real objects."""
    from sglang.srt.distributed.parallel_state import get_tp_group
    from sglang.srt.speculative.base_spec_worker import BaseSpecWorker
    from sglang.srt.speculative.draft_parallel import DraftParallelLayout
    from sglang.srt.speculative.spec_tp_sync import SpecTpSync

    from sglang_dflash_pp.srt.models.context_partial import fc_column_block
    from sglang_dflash_pp.srt.speculative.dflash_pp_worker import PPDFlashWorkerV2

    w = object.__new__(PPDFlashWorkerV2)
    BaseSpecWorker.__init__(w)
    w._target_worker = target
    w.model_runner = SimpleNamespace(device="cpu", prefill_attention_backend_str="torch_native")
    w.device = "cpu"
    w.draft_model = draft_model
    w.draft_model_runner = SimpleNamespace(token_to_kv_pool=pool, kv_index_translator=translator)
    w.draft_parallel_layout = DraftParallelLayout(tp_group=None, attn_tp_size=1)
    w._tp_sync = SpecTpSync(get_tp_group())
    w.lilicorr = None
    w.selector = None
    w._draft_sampler = None
    w._use_fused_kv_materialize = False  # CPU: the fused path is Triton
    w._fused_kv_helper = None
    w._carry = carry
    w._carry_dtype = carry_dtype
    w._hosts_draft = True
    w._w_stage = fc_column_block(draft_model.fc.weight, carry.features, HIDDEN)
    return w


@contextmanager
def pp_stage(pp_rank: int, pp_size: int, draft_dir: str):
    """This process's parallel context and spec config read as the given PP stage."""
    from sglang.srt.runtime_context import get_parallel, get_spec

    group = SimpleNamespace(
        is_first_rank=pp_rank == 0,
        is_last_rank=pp_rank == pp_size - 1,
        rank_in_group=pp_rank,
        world_size=pp_size,
    )
    with get_parallel().override(pp_rank=pp_rank, pp_size=pp_size, pp_group=group), get_spec().override(
        speculative_draft_model_path=draft_dir
    ):
        yield


def non_last_stage_worker(
    target: CapturingTarget, draft_dir: str, dtype=torch.bfloat16, draft_dtype: str = "auto"
):
    """The real ``PPDFlashWorkerV2.__init__`` on a non-last stage (call inside ``pp_stage``).
    ``draft_dtype`` is the draft's ``--dtype`` (``auto``: its config's ``torch_dtype``)."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from sglang_dflash_pp.srt.speculative.dflash_pp_worker import PPDFlashWorkerV2

    draft_model_config = ModelConfig(
        draft_dir, trust_remote_code=True, is_draft_model=True, dtype=draft_dtype
    )
    target.model_runner = SimpleNamespace(
        model_config=SimpleNamespace(
            hf_text_config=target_text_config(),
            # the stand-in captures like Kimi-K3 (capture_ownership.FINAL_LAYER_AT_NORM)
            hf_config=SimpleNamespace(architectures=["KimiK3LinearForCausalLM"]),
            dtype=dtype,
        ),
        model=SimpleNamespace(),
        spec_aux_config=SimpleNamespace(
            dflash_target_layer_ids=list(TARGET_LAYER_IDS),
            draft_model_config=draft_model_config,
        ),
        spec_algorithm=SpeculativeAlgorithm.DFLASH,
        prewarm_sampling=lambda: "target-prewarm",
    )
    return PPDFlashWorkerV2(server_args=None, gpu_id=0, nccl_port=0, target_worker=target)


def write_json(path: str, payload: Dict) -> None:
    with open(path, "w") as f:
        json.dump(payload, f)
