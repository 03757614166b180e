"""Argument gate for DFLASH with ``--pp-size > 1`` (the patch to ``arg_groups/speculative_hook.py``
and ``arg_groups/validation_hook.py`` of sglang 0.5.23).

Upstream refuses the combination in two places:

* ``speculative_hook._handle_dflash`` raises ``only supports pp_size == 1`` (resolution time).
  AROUND hook: for ``pp_size > 1`` we check what this plugin supports, then run the stock
  handler with ``pp_size`` reading 1 (a temporary declaration on the resolving view, removed by
  identity afterwards), so every other DFLASH decision (draft-token count from the draft's block
  size, steps, topk, draft attention backend, running-request cap) is made exactly as for PP1.
  Then the draft and the target are checked: a plain, unquantised ``fc`` with ascending unique
  ``target_layer_ids``; a target whose every PP stage captures its own features (the
  allow-list ``capture_ownership.PP_CAPTURE_TARGETS``: Kimi-K3 natively, Llama / Qwen3 /
  Qwen3-MoE / gpt-oss through ``models/pp_capture``, ``stage_capture``); and a PP partition (sglang's own, honouring
  ``SGLANG_PP_LAYER_PARTITION``) under which the last stage owns a feature.
* ``validation_hook.check_pipeline_parallel_compat`` asserts EAGLE/DSPARK only (launch time).
  AROUND hook: for DFLASH we apply our refusals, then run the stock checks through a view on which
  the algorithm reads ``DSPARK``, whose PP branch (PD prefill, no ``SGLANG_ENABLE_PP_SPEC``) is the
  contract we share; the common PP assertions (overlap off, ``--min-free-slots-delay``) still run.

Both hooks also refuse ``SGLANG_PP_SKIP_PURE_CHUNKED_OUTPUT_COMM``: stock skips the PP output
relay of a lone middle chunk, and DFLASH's draft state would never reach the last stage.

Everything is decided before serving, because under PP an exception on one stage leaves the other
stages blocked in their receive forever. With ``pp_size == 1`` or another algorithm both hooks call
the original untouched.
"""

from __future__ import annotations

import json
import logging
from contextlib import contextmanager
from typing import Any, Iterator, List, Optional, Tuple

from sglang_dflash_pp.hooks import PluginHook, require_hooks_applied
from sglang_dflash_pp.srt.models.capture_ownership import (
    PP_CAPTURE_TARGETS,
    capture_convention,
    compute_feature_ownership,
)
from sglang_dflash_pp.srt.speculative.draft_config_checks import (
    target_layer_ids_refusal,
)

logger = logging.getLogger(__name__)

CONFIGURATION = "DFLASH with --pp-size > 1"
_MASK_SOURCE = "sglang_dflash_pp.dflash_pp_gate.pp_size_mask"


def _is_dflash(algorithm: Any) -> bool:
    return algorithm is not None and str(algorithm).upper() == "DFLASH"


def pp_env_switch_refusal(pp: int) -> Optional[str]:
    """The environment switches of the stock PP path that DFLASH with ``--pp-size pp`` cannot
    run under (``sglang-dflash-pp check`` lists them too), or None."""
    from sglang.srt.environ import envs

    if envs.SGLANG_ENABLE_PP_SPEC.get():
        return (
            "SGLANG_ENABLE_PP_SPEC replaces the PP relay with an EAGLE-shaped one that does not "
            f"carry the DFLASH context partial; unset it to run DFLASH with --pp-size {pp} "
            "on a PD prefill server."
        )
    # Read as envs.SGLANG_PP_SKIP_PURE_CHUNKED_OUTPUT_COMM.get() (managers/scheduler_pp_mixin.py
    # :48-57 _pp_can_skip_output_comm). A middle chunk alone in its micro-batch then gets the
    # synthesized result of _pp_make_skip_output_result (:946-968, no next_draft_input): our
    # relay never runs, and `assert batch.spec_info is result.next_draft_input`
    # (disaggregation/prefill.py:939) fails on one stage while the others wait forever.
    if envs.SGLANG_PP_SKIP_PURE_CHUNKED_OUTPUT_COMM.get():
        return (
            "SGLANG_PP_SKIP_PURE_CHUNKED_OUTPUT_COMM skips the PP output relay of middle prefill "
            "chunks, so the last stage's DFLASH draft state is never handed over and the first "
            "such chunk crashes that stage while the others wait. Unset "
            f"SGLANG_PP_SKIP_PURE_CHUNKED_OUTPUT_COMM (or set it to 0) to run DFLASH with "
            f"--pp-size {pp} on a PD prefill server."
        )
    return None


def serving_refusal(cfg: Any) -> Optional[str]:
    """The first reason the serving topology in ``cfg`` cannot run DFLASH with PP, or None."""
    from sglang.srt.model_executor.cuda_graph_config import Backend

    pp = int(cfg.pp_size)
    if cfg.disaggregation_mode != "prefill":
        where = (
            "a PD decode server"
            if cfg.disaggregation_mode == "decode"
            else "a server without PD disaggregation"
        )
        return (
            f"DFLASH with --pp-size {pp} is not supported on {where}. Pipeline parallelism "
            "with DFLASH is only supported on the PD prefill server "
            "(--disaggregation-mode prefill); run the decode server and non-disaggregated "
            "DFLASH with --pp-size 1."
        )
    if cfg.disaggregation_transfer_backend != "mooncake":
        return (
            f"DFLASH with --pp-size {pp} requires --disaggregation-transfer-backend mooncake "
            f"(got {cfg.disaggregation_transfer_backend!r}): only the Mooncake path carries "
            "the draft KV head-aware from the last PP stage."
        )
    refusal = pp_env_switch_refusal(pp) or draft_quantization_refusal(cfg, pp)
    if refusal:
        return refusal
    if cfg.cuda_graph_config.prefill.backend != Backend.DISABLED:
        return (
            f"DFLASH with --pp-size {pp} does not support a PP prefill CUDA graph (requested "
            f"backend {cfg.cuda_graph_config.prefill.backend!r}): the captured graph would hold "
            "the raw target-hidden relay instead of the context partial. Drop "
            "--cuda-graph-backend-prefill or pass --cuda-graph-backend-prefill disabled."
        )
    return None


def draft_quantization(cfg: Any) -> Optional[str]:
    """The quantization the draft is built with: ``--speculative-draft-model-quantization``, or
    ``--quantization`` inherited when it is unset (0.5.23 ``serving_hook.py:676-709``; ``unquant``
    turns either off). Before that resolution has run the inheritance is applied here."""
    method = cfg.speculative_draft_model_quantization
    resolved = getattr(cfg, "_speculative_draft_quantization_explicitly_set", None) is not None
    if method is None and not resolved:
        method = cfg.quantization
    return None if method == "unquant" else method


def draft_quantization_refusal(cfg: Any, pp: int) -> Optional[str]:
    """Every PP stage handles the draft's weights unquantised: the earlier stages project with
    ``fc`` column blocks read as stored, the last stage slices ``qkv_proj`` and ``fc`` for its
    KV-write-only draft. A draft quantised online (often inherited from the target's
    ``--quantization``) would do neither the way a PP1 server does."""
    method = draft_quantization(cfg)
    if method is None:
        return None
    return (
        f"DFLASH with --pp-size {pp} builds the draft unquantised on every PP stage, but it "
        f"would be quantised with {method!r} (--speculative-draft-model-quantization, "
        "inherited from --quantization when unset). Pass --speculative-draft-model-quantization "
        "unquant, or --pp-size 1."
    )


def _hf_config(cfg: Any, path: str, revision: Optional[str]):
    from sglang.srt.utils.hf_transformers_utils import get_config

    return get_config(
        path,
        trust_remote_code=cfg.trust_remote_code,
        revision=revision,
        model_override_args=json.loads(cfg.json_model_override_args),
    )


def draft_projection_refusal(draft_hf_config: Any, where: str) -> Optional[str]:
    """Refuse drafts whose ``fc`` cannot be split into per-feature column blocks."""
    from sglang.srt.models.dflash import DFlashDraftModel
    from sglang.srt.models.registry import ModelRegistry
    from sglang.srt.speculative.dflash_utils import (
        is_nemotron_35_draft_config,
        parse_dflash_draft_config,
    )

    architectures = list(getattr(draft_hf_config, "architectures", None) or [])
    model_cls, arch = ModelRegistry.resolve_model_cls(architectures)
    if not issubclass(model_cls, DFlashDraftModel):
        return (
            f"The draft at {where} resolves to {arch} ({model_cls.__name__}), which is not a "
            "DFlashDraftModel; DFLASH with --pp-size > 1 needs a DFlash draft."
        )
    if (
        model_cls.supports_quantization
        or is_nemotron_35_draft_config(draft_hf_config)
        or getattr(draft_hf_config, "quantization_config", None)
    ):
        return (
            f"The draft at {where} ({arch}) has a quantised fc (ReplicatedLinear with a quant "
            "config); its per-feature column blocks cannot be sliced for the PP partial "
            "projection. Use an unquantised bf16/fp16 DFlash draft, or --pp-size 1."
        )
    if model_cls.project_target_hidden is not DFlashDraftModel.project_target_hidden:
        return (
            f"The draft at {where} ({arch}) overrides project_target_hidden, so its context "
            "projection is not a plain linear fc over the concatenated features and cannot be "
            "computed as per-stage partial sums. Use a plain DFlashDraftModel draft, or "
            "--pp-size 1."
        )
    draft_config = parse_dflash_draft_config(draft_hf_config=draft_hf_config)
    return target_layer_ids_refusal(draft_config.target_layer_ids, where=where)


def target_capture_layout(target_hf_config: Any, draft_hf_config: Any) -> Tuple[int, List[int]]:
    """The target's layer count and the draft's resolved ``target_layer_ids``, as the gate and
    ``sglang-dflash-pp check`` derive them from the two configs."""
    from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config
    from sglang.srt.utils.hf_transformers.common import get_hf_text_config

    text_config = get_hf_text_config(target_hf_config)
    num_layers = int(text_config.num_hidden_layers) * int(getattr(text_config, "num_loops", 1))
    draft_config = parse_dflash_draft_config(draft_hf_config=draft_hf_config)
    target_layer_ids = draft_config.resolve_target_layer_ids(
        target_num_layers=num_layers, draft_num_layers=draft_config.require_num_layers()
    )
    return num_layers, list(target_layer_ids)


def target_class_refusal(architectures: List[str], where: str, pp_size: int) -> Optional[str]:
    """Refuse target classes whose non-last PP stages do not capture the draft's features."""
    if capture_convention(architectures) is not None:
        return None
    return (
        f"DFLASH with --pp-size {pp_size} supports the target classes "
        f"{sorted(PP_CAPTURE_TARGETS)}, whose every PP stage captures the draft's context "
        f"features; {where} is {architectures}, which sglang 0.5.23 captures on the last PP "
        "stage only. Serve it with --pp-size 1."
    )


def target_layout_refusal(cfg: Any, draft_hf_config: Any) -> Optional[str]:
    """Refuse targets that do not capture on every stage, and PP layouts the ownership rule
    cannot serve (computed from sglang's own partition, as every stage will compute it)."""
    from sglang.srt.distributed.utils import get_pp_indices

    target_hf_config = _hf_config(cfg, cfg.model_path, cfg.revision)
    architectures = list(getattr(target_hf_config, "architectures", None) or [])
    refusal = target_class_refusal(architectures, cfg.model_path, int(cfg.pp_size))
    if refusal:
        return refusal
    num_layers, target_layer_ids = target_capture_layout(target_hf_config, draft_hf_config)
    pp_size = int(cfg.pp_size)
    try:
        stage_layers = [get_pp_indices(num_layers, rank, pp_size) for rank in range(pp_size)]
        compute_feature_ownership(
            stage_layers, target_layer_ids, num_layers, capture_convention(architectures)
        )
    except ValueError as e:  # OwnershipError, or a malformed SGLANG_PP_LAYER_PARTITION
        return f"DFLASH with --pp-size {pp_size}: {e}"
    return None


def model_refusal(cfg: Any) -> Optional[str]:
    """The first reason the draft or the target in ``cfg`` cannot run DFLASH with PP, or None:
    the draft's ``fc`` must split into per-feature column blocks, and the target must capture on
    every PP stage under a partition whose last stage owns a feature."""
    draft_path = cfg.speculative_draft_model_path
    draft_hf_config = _hf_config(cfg, draft_path, cfg.speculative_draft_model_revision)
    return draft_projection_refusal(draft_hf_config, draft_path) or target_layout_refusal(
        cfg, draft_hf_config
    )


@contextmanager
def _pp_size_reads_one(server_args: Any) -> Iterator[None]:
    """Make the resolving view read ``pp_size == 1`` while the stock handler runs."""
    from sglang.srt.arg_groups.overrides import declare_resolution

    declare_resolution(server_args, _MASK_SOURCE, pp_size=1)
    mask = server_args._resolved_overrides[-1]
    try:
        yield
    finally:
        stash = server_args._resolved_overrides
        for i, entry in enumerate(stash):
            if entry is mask:
                del stash[i]
                break


def handle_dflash_around(original, server_args, *args, **kwargs):
    from sglang.srt.arg_groups.overrides import resolving_view

    cfg = resolving_view(server_args)
    if int(cfg.pp_size) == 1:
        return original(server_args, *args, **kwargs)

    require_hooks_applied(CONFIGURATION)
    refusal = serving_refusal(cfg)
    if refusal:
        raise ValueError(refusal)
    with _pp_size_reads_one(server_args):
        result = original(server_args, *args, **kwargs)
    refusal = model_refusal(cfg)
    if refusal:
        raise ValueError(refusal)
    logger.info(
        "DFLASH with --pp-size %d on a PD prefill server: the draft runs on the last PP stage; "
        "earlier stages carry the partial context projection.",
        int(cfg.pp_size),
    )
    return result


class _AlgorithmReadsAs:
    """Read-through view of a resolving config whose ``speculative_algorithm`` is replaced."""

    __slots__ = ("_cfg", "_algorithm")

    def __init__(self, cfg: Any, algorithm: str):
        object.__setattr__(self, "_cfg", cfg)
        object.__setattr__(self, "_algorithm", algorithm)

    def __getattr__(self, name: str) -> Any:
        if name == "speculative_algorithm":
            return object.__getattribute__(self, "_algorithm")
        return getattr(object.__getattribute__(self, "_cfg"), name)


def check_pipeline_parallel_compat_around(original, cfg, *args, **kwargs):
    if not _is_dflash(cfg.speculative_algorithm):
        return original(cfg, *args, **kwargs)
    require_hooks_applied(CONFIGURATION)
    refusal = serving_refusal(cfg)
    if refusal:
        raise ValueError(refusal)
    return original(_AlgorithmReadsAs(cfg, "DSPARK"), *args, **kwargs)


HOOKS = (
    PluginHook(
        "sglang.srt.arg_groups.speculative_hook._handle_dflash",
        handle_dflash_around,
        "around",
        "resolve DFLASH with --pp-size > 1 on a PD prefill server",
    ),
    PluginHook(
        "sglang.srt.arg_groups.validation_hook.check_pipeline_parallel_compat",
        check_pipeline_parallel_compat_around,
        "around",
        "accept DFLASH in the launch-time pipeline-parallel checks",
    ),
)
