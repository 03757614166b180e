"""PRs 8 to 15 of the stack: DFLASH with ``--pp-size > 1`` on a PD prefill server, inert until
the gate (PR 14) opens it.

Only our code and the anchors it hooks onto are written here (see :mod:`.stack`)."""

from __future__ import annotations

from typing import Dict, Tuple

from sglang_dflash_pp.tools.export_patches.cst_edits import (
    AddImport,
    GuardStatement,
    IfTest,
    InsertStatements,
    ReplaceExpression,
    Stmt,
    WidenCondition,
)
from sglang_dflash_pp.tools.export_patches.new_modules import NewModule
from sglang_dflash_pp.tools.export_patches.new_tests import NewTest
from sglang_dflash_pp.tools.export_patches.pr import PR

# -- PR 8 ------------------------------------------------------------------------------------

PR_8 = PR(
    "8",
    edits=(
        ReplaceExpression(
            "srt/disaggregation/prefill.py",
            "PrefillBootstrapQueue._init_kv_manager",
            old="transfer_draft_cache and (not _is_npu or get_parallel().pp_group.is_last_rank)",
            new="transfer_draft_cache and get_parallel().pp_group.is_last_rank",
        ),
    ),
    note=(
        "The last-rank condition that only NPU applied now applies on every device: a PP "
        "stage before the last appends no draft entries, so it registers exactly what a stage "
        "without a draft registers and never pairs draft entries with the decode's draft band. "
        "EAGLE and DSPARK hold no draft pool on those stages, and PP1 is the last stage, so "
        "nothing stock serves changes; the PP-aware DFLASH worker (PR 12) holds none either."
    ),
)

# -- PR 9 ------------------------------------------------------------------------------------

PP_PREFILL_ROLE_DOC = """\
Whether this server process is one PP stage of a DFLASH PD prefill server (``--pp-size > 1``,
``--disaggregation-mode prefill``): the one configuration in which the PP capture of the target
models, the layer ids of plain-MHA transfer entries and the PP-aware DFLASH worker act. Read from
the published runtime context, so any layer can ask without the server args. The argument check
admits that configuration only where it is served (``arg_groups/speculative_hook.py``)."""

MHA_LAYER_IDS_DOC = """\
Layer ids for plain-MHA transfer entries on a DFLASH PP prefill.

A plain ``MHATokenToKVPool`` target (Llama, Qwen3, Qwen3-MoE, gpt-oss) publishes no layer ids,
and the Mooncake send paths then pair prefill and decode entries by position
(``get_mha_kv_ptrs_with_pp``: this stage's K block against ``dst[start:end]``, its V block against
``dst[N + start : N + end]`` with ``N`` half the decode's entries). That is right only while
neither side appends draft entries: a DFLASH decode lists ``K_0..K_{N-1}, V_0..V_{N-1}`` and then
the draft's K and V, so a PP prefill stage's V block would land on the wrong decode layers and
the last stage's draft entries would be taken for V. With ids on both sides the same send paths
pair entries by id, as they do for the hybrid pools. So, only on a DFLASH PP prefill:

* ``build_kv_layer_ids`` publishes this stage's ``model_layer_ids`` twice (its K, then its V
  entries) and, on the last stage, the draft band as it numbers any draft band
  (:func:`mha_layer_ids`);
* a decode that published no ids (a PP1 decode with a plain-MHA target) is given, at
  registration, the ids of the layout it registered, ``0..N-1`` twice and then the same draft
  band, after its entry count and item lengths are checked against that layout
  (:func:`fill_decode_layer_ids`); a layout that does not fit refuses the decode.

Every other configuration, and any pool that already reports ids, is unchanged."""

MHA_LAYER_IDS_TEST_DOC = """\
Plain-MHA targets (Llama, Qwen3, ...) with a DFLASH draft on a PP prefill: how a stage's transfer
entries pair with the decode's (``disaggregation/mha_layer_ids.py``).

The oracle for pairing is by name: every entry is labelled with what it holds (``K2``, ``V2``,
``dK0``, ...) on each side, from the order the pools are registered in (target pool K per layer
then V per layer, then the draft pool's K then V); a correct pairing maps every prefill entry to
the decode entry with the same label."""

PR_9 = PR(
    "9",
    new_modules=(
        NewModule("sglang_dflash_pp.srt.pp_prefill_role", docstring=PP_PREFILL_ROLE_DOC),
        NewModule(
            "sglang_dflash_pp.srt.disaggregation.mha_layer_ids",
            drop=("build_kv_layer_ids_around", "HOOKS"),
            docstring=MHA_LAYER_IDS_DOC,
        ),
    ),
    edits=(
        AddImport(
            "srt/disaggregation/utils.py",
            module="sglang.srt.disaggregation.mha_layer_ids",
            names=("mha_layer_ids", "pairs_mha_by_layer_id"),
        ),
        InsertStatements(
            "srt/disaggregation/utils.py",
            "build_kv_layer_ids",
            before=IfTest(
                "not isinstance(token_to_kv_pool, (HybridLinearKVPool, MiniMaxM3Nvfp4KVPool))"
            ),
            code="""
            if pairs_mha_by_layer_id(token_to_kv_pool):
                # A DFLASH PP prefill stage: plain-MHA entries pair with the decode's by id.
                return mha_layer_ids(
                    token_to_kv_pool, draft_token_to_kv_pool, num_draft_entries, num_hidden_layers
                )
            """,
        ),
        AddImport(
            "srt/disaggregation/mooncake/conn.py",
            module="sglang.srt.disaggregation.mha_layer_ids",
            names=("fill_decode_layer_ids",),
        ),
        InsertStatements(
            "srt/disaggregation/mooncake/conn.py",
            "MooncakeKVManager._validate_peer_state_layout",
            at="start",
            code="""
            # A decode that published no layer ids gets those of the layout it registered
            # when this DFLASH PP prefill stage pairs plain-MHA entries by id.
            mismatch = fill_decode_layer_ids(self.kv_args, registration_info)
            if mismatch is not None:
                return False, mismatch
            """,
        ),
    ),
    tests=(
        # the pairing itself; the registration verdicts and the send hooks of the same file
        # exercise the plugin's hooks and stay in this repository
        NewTest(
            "test/srt/test_mha_transfer_entries.py",
            "test/registered/unit/disaggregation/test_mha_layer_ids.py",
            est_time=5,
            drop=(
                "_mha_pool", "_sides",
                "test_build_kv_layer_ids_is_stock_outside_a_dflash_pp_prefill",
                "test_head_sliced_path_sends_the_draft_by_our_plan",
                "test_target_path_follows_sglangs_dispatch_and_refuses_staging",
                "test_send_kvcache_slice_hook_is_stock_without_a_draft_verdict",
            ),
            docstring=MHA_LAYER_IDS_TEST_DOC,
        ),
    ),
    note=(
        "Layer ids are published for a plain-MHA target only on a DFLASH PP prefill stage, so "
        "the stock send paths pair its entries with the decode's by id (as for the hybrid "
        "pools) instead of by a position the decode's draft band shifts. The decode stays as "
        "it is: when such a prefill stage registers a decode that published no ids, it gives "
        "the registration the ids of the PP1 layout the decode registered, after checking its "
        "entry count and item lengths, and refuses the decode naming what does not fit. The "
        "role is read from the runtime context (pp_prefill_role, which PRs 11 and 12 use too); "
        "until PR 14 admits DFLASH with --pp-size > 1 it is never true. Tested by "
        "test_mha_transfer_entries.py."
    ),
)

# -- PR 10 -----------------------------------------------------------------------------------

CONTEXT_PARTIAL_DOC = """\
The DFlash context as a sum of per-stage partial projections, for DFLASH on a PP prefill.

``fc(concat(h_0..h_{K-1})) = sum_j h_j W_j^T`` with ``W_j`` the j-th ``[H, H]`` column block of
``fc.weight``. Stage s sends ``P_s = P_{s-1} + sum_{j in J_s} h_j W_j^T`` (one ``[T, H]`` tensor,
whatever the number of features), and only the last stage applies the non-linear ``hidden_norm``.

Numerics. The single GEMM of ``project_target_hidden`` accumulates in fp32 and rounds once to the
model dtype before the norm. Here every partial is produced in fp32 directly (no rounding of a
stage's contribution), the carry between stages is ``SGLANG_DFLASH_PP_CARRY_DTYPE`` (``float32`` by
default: a bf16 carry rounds the running sum once per hop), and the last stage adds its own
partial in fp32 and normalises the fp32 sum before handing the model dtype to the KV writer.

Torch only."""

PR_10 = PR(
    "10",
    new_modules=(
        NewModule(
            "sglang_dflash_pp.srt.models.context_partial",
            target="sglang.srt.models.dflash_context_partial",
            docstring=CONTEXT_PARTIAL_DOC,
        ),
        NewModule(
            "sglang_dflash_pp.srt.models.last_stage_context",
            target="sglang.srt.models.dflash_last_stage_context",
        ),
    ),
    edits=(
        AddImport(
            "srt/models/dflash.py",
            module="sglang.srt.models.dflash_last_stage_context",
            names=("project_last_stage", "stashed"),
        ),
        InsertStatements(
            "srt/models/dflash.py",
            "DFlashDraftModel.project_target_hidden",
            at="start",
            code="""
            context = stashed(self)
            if context is not None:
                # The last PP stage: the earlier stages' partial plus its own features.
                return project_last_stage(self, context, target_hidden)
            """,
        ),
    ),
    note=(
        "The PP worker (PR 12) stashes the inbound partial and the stage's own fc column block "
        "on the draft model around the forward that writes the draft KV, and "
        "project_target_hidden finishes the context from them: hidden_norm(P_in + x W_last^T), "
        "sum and norm in fp32. The stash (set and cleared in a finally by the worker) keeps the "
        "method's signature and its callers as they are; with nothing stashed, which is every "
        "configuration before PR 14, the method is unchanged. Tested by "
        "test_context_partial.py."
    ),
)

# -- PR 11 -----------------------------------------------------------------------------------

# model file -> (the class whose setter arms capture, its decoder layers' capture argument,
# whether that argument takes the accumulator itself rather than its ``capture`` callback)
PP_CAPTURE_MODELS = (
    ("srt/models/llama.py", "LlamaForCausalLM", "capture_output", False),
    ("srt/models/qwen3.py", "Qwen3ForCausalLM", "capture_output", False),
    ("srt/models/qwen3_moe.py", "Qwen3MoeForCausalLM", "captured_last_layer_outputs", True),
    ("srt/models/gpt_oss.py", "GptOssForCausalLM", "capture_output", False),
)


def _pp_capture_edits(file: str, cls: str, keyword: str, takes_accumulator: bool):
    arm = f'arm_stage_capture(self, layer_ids, "{keyword}")'
    if takes_accumulator:
        arm = f'arm_stage_capture(\n    self, layer_ids, "{keyword}", takes_accumulator=True\n)'
    arm = arm.replace("\n", "\n" + " " * 16)
    return (
        AddImport(file, module="sglang.srt.models.dflash_stage_capture",
                  names=("arm_stage_capture",)),
        AddImport(file, module="sglang.srt.pp_prefill_role",
                  names=("serving_dflash_pp_prefill",)),
        InsertStatements(
            file,
            f"{cls}.set_dflash_layers_to_capture",
            before=Stmt("return"),
            code=f"""
            if serving_dflash_pp_prefill():
                # A DFLASH PP prefill: every stage captures its own features and relays them.
                {arm}
            """,
        ),
    )


PR_11 = PR(
    "11",
    new_modules=(
        NewModule(
            "sglang_dflash_pp.srt.models.stage_capture",
            target="sglang.srt.models.dflash_stage_capture",
        ),
    ),
    edits=tuple(e for m in PP_CAPTURE_MODELS for e in _pp_capture_edits(*m)),
    note=(
        "On a stage before the last of a DFLASH PP prefill, set_dflash_layers_to_capture arms "
        "that stage's own capture points instead of returning with none: the input of layer "
        "L + 1 for every draft layer L it holds, handed to the decoder layers through the "
        "capture argument they already take, and the packed captures put into the outbound "
        "PP proxy under dspark_hidden_states, the key Kimi-K3 relays its captures under. Torch "
        "module hooks on the stage's own model do that, so the models' forwards are "
        "unchanged. The last stage, PP1, the decode and every other algorithm keep the "
        "setter's behaviour; before PR 14 no server is a DFLASH PP prefill. Tested by "
        "test_pp_capture.py (each class, split at every stage boundary, against the unsplit "
        "model) and test_capture_ownership.py."
    ),
)

# -- PR 12 -----------------------------------------------------------------------------------

PP_WORKER_DOC = """\
``PPDFlashWorkerV2``: DFlash on one PP stage of a PD prefill server, a subclass of
``DFlashWorkerV2`` that ``SpeculativeAlgorithm.create_worker`` picks for DFLASH with
``--pp-size > 1`` on a PD prefill server.

Why a subclass: ``DFlashWorkerV2`` builds the full draft, its runner and its KV pool on every
stage, and on a non-last stage dereferences ``logits_output`` and ``next_token_ids``, which are
None there. This worker:

* holds no draft model, runner or KV pool on a non-last stage (so the stage exposes no draft pool
  to the PD layer and never sends draft KV), only the ``[H, H]`` ``fc`` blocks of the features it
  captures, read from the draft checkpoint; it runs the target with full capture and replaces
  the raw capture in the outbound proxy with the running partial (``dflash_pp_stage_carry``);
* records, on every stage, after its forward, the event the KV transfer of the batch's requests
  waits on (``kv_write_fence``);
* on the last stage is ``DFlashWorkerV2`` with the inbound partial stashed on the draft model
  around its forward (``project_target_hidden`` finishes it), minus the two target-embedding
  steps that cannot run where the embedding is not local, and minus the verify-sampling
  rehearsal (a prefill server never verifies); it builds its draft with the target's
  synchronised seed and the stage-local load group (``dflash_last_stage_draft_build``:
  otherwise the last stage would wait in a WORLD collective the other stages never enter).

Under dummy draft weights (``--speculative-draft-load-format dummy``, or ``--load-format dummy``
when that is unset, as the draft runner resolves it) a non-last stage reads nothing from the draft
directory: its blocks are the columns of the ``fc`` the full draft's dummy load produces
(``dflash_dummy_draft_weights``), the values the last stage's dummy draft and a PP1 server hold
too."""

LAST_STAGE_DRAFT_BUILD_DOC = """\
What the last PP stage of a DFLASH PP prefill passes to ``build_draft_tp_worker``.

``DFlashWorkerV2.__init__`` builds its draft with ``build_draft_tp_worker(...)`` and no
``random_seed`` or ``load_group``. A draft that exists on the last PP stage only cannot use those
defaults:

* ``random_seed=None`` makes the draft ``TpModelWorker`` broadcast the seed over the WORLD CPU
  group (managers/tp_worker.py). The other stages never enter that broadcast (they build no draft
  and go on to size their KV cache, an all-reduce over the same group), so the server would
  deadlock at startup. The seed the broadcast would return is the one the target worker of this
  very process already received from the same broadcast, with every stage taking part: it is
  passed instead.
* the default load group is the world group for loaders that synchronise (InstantTensor); the
  last stage alone would wait for the others forever. The stage-local group is passed, captured
  before ``draft_pp_context`` (inside it ``pp_size`` reads 1), as DSpark does.

``PPDFlashWorkerV2`` sets these, with the features the stage captures, around its
``super().__init__`` on the last stage (:func:`last_stage_draft_build`), and
``build_draft_tp_worker`` applies them to that one call. Pure, no sglang import."""

PR_12 = PR(
    "12",
    new_modules=(
        NewModule(
            "sglang_dflash_pp.srt.speculative.draft_config_checks",
            target="sglang.srt.speculative.dflash_draft_config_checks",
        ),
        NewModule(
            "sglang_dflash_pp.srt.models.capture_ownership",
            target="sglang.srt.models.dflash_capture_ownership",
        ),
        NewModule(
            "sglang_dflash_pp.srt.speculative.pp_stage_carry",
            target="sglang.srt.speculative.dflash_pp_stage_carry",
        ),
        NewModule(
            "sglang_dflash_pp.srt.models.dflash_fc_columns",
            target="sglang.srt.models.dflash_fc_columns",
        ),
        NewModule(
            "sglang_dflash_pp.srt.models.dummy_draft_weights",
            target="sglang.srt.models.dflash_dummy_draft_weights",
        ),
        NewModule(
            "sglang_dflash_pp.srt.speculative.last_stage_draft_build",
            target="sglang.srt.speculative.dflash_last_stage_draft_build",
            docstring=LAST_STAGE_DRAFT_BUILD_DOC,
        ),
        NewModule(
            "sglang_dflash_pp.srt.speculative.dflash_pp_worker",
            target="sglang.srt.speculative.dflash_pp_worker_v2",
            docstring=PP_WORKER_DOC,
        ),
    ),
    edits=(
        InsertStatements(
            "srt/speculative/spec_info.py",
            "SpeculativeAlgorithm.create_worker",
            before=Stmt("return DFlashWorkerV2"),
            code="""
            if int(cfg.pp_size) > 1 and cfg.disaggregation_mode == "prefill":
                # A PP stage of a PD prefill server: the draft lives on the last stage only.
                from sglang.srt.speculative.dflash_pp_worker_v2 import PPDFlashWorkerV2

                return PPDFlashWorkerV2
            """,
        ),
        AddImport(
            "srt/speculative/draft_worker_common.py",
            module="sglang.srt.speculative.dflash_last_stage_draft_build",
            names=("current_draft_build",),
        ),
        InsertStatements(
            "srt/speculative/draft_worker_common.py",
            "build_draft_tp_worker",
            at="start",
            code="""
            build = current_draft_build()
            if build is not None:
                # The last PP stage builds the only draft: no WORLD collective of its own.
                if random_seed is None:
                    random_seed = build.random_seed
                if load_group is _DEFAULT_LOAD_GROUP and build.load_group is not None:
                    load_group = build.load_group
            """,
        ),
    ),
    tests=(
        NewTest(
            "test/srt/test_capture_ownership.py",
            "test/registered/unit/models/test_dflash_capture_ownership.py",
            est_time=10,
        ),
    ),
    note=(
        "The PP-aware worker is a subclass of DFlashWorkerV2 in its own module, which "
        "create_worker returns for DFLASH with --pp-size > 1 on a PD prefill server (a branch; "
        "DFLASH PP1 and the decode keep DFlashWorkerV2). Its non-last stages hold no draft, only "
        "the fc column blocks of the features they capture (a safetensors slice, or the columns "
        "of the full draft's dummy load), and carry one running [T, H] partial in the PP proxy; "
        "its last stage is the stock worker with that partial stashed for project_target_hidden "
        "(PR 10). The last stage builds its draft with the target's synchronised seed and the "
        "stage load group, which build_draft_tp_worker takes from the build context the worker "
        "sets (otherwise the draft's seed broadcast over the WORLD group, which no other stage "
        "enters, deadlocks startup). The feature ownership refuses a draft layer no stage can "
        "capture. Before PR 14 no server reaches the branch. Tested by test_dflash_pp_worker.py, "
        "test_pp_carry_gloo.py (two real gloo PP stages) and test_dflash_fc_columns.py."
    ),
)

# -- PR 13 -----------------------------------------------------------------------------------

PR_13 = PR(
    "13",
    edits=(
        WidenCondition(
            "srt/managers/scheduler_pp_mixin.py",
            "SchedulerPPMixin._pp_prepare_tensor_dict",
            condition=(
                "draft_input is not None and not batch.spec_algorithm.is_dspark() "
                "and draft_input.topk_p is not None"
            ),
            extra="not batch.spec_algorithm.is_dflash()",
            op="and",
        ),
        WidenCondition(
            "srt/managers/scheduler_pp_mixin.py",
            "SchedulerPPMixin._pp_prep_batch_result",
            condition="batch.spec_algorithm.is_dspark()",
            extra="batch.spec_algorithm.is_dflash()",
        ),
    ),
    note=(
        "DFLASH is relayed like DSPARK, whose draft input type it shares: no EAGLE draft relay "
        "keys around the output ring (its DFlashDraftInputV2 holds empty (bs, 0) top-k and "
        "hidden placeholders), and every rank rebuilds the DFlashDraftInputV2 from the relayed "
        "next tokens (the DSPARK branch's make_next_draft_input is make_draft_input_v2) and "
        "binds it to batch.spec_info and the result, so the PD prefill's "
        "`batch.spec_info is result.next_draft_input` holds on every rank. Without this DFLASH "
        "would fall into the EAGLE relay and rebuild an EagleDraftInput. Only DFLASH with "
        "--pp-size > 1 reaches these methods, which PR 14 admits. Tested by "
        "test_dflash_pp_worker.py (the relay on real scheduler methods)."
    ),
)

# -- PR 14 -----------------------------------------------------------------------------------

GATE_DOC = """\
What DFLASH with ``--pp-size > 1`` serves, decided at startup.

It is served on a PD prefill server only (``--disaggregation-mode prefill``), over Mooncake (only
the Mooncake path carries the draft KV head-aware from the last PP stage), with neither
``SGLANG_ENABLE_PP_SPEC`` (its EAGLE-shaped relay does not carry the context partial) nor
``SGLANG_PP_SKIP_PURE_CHUNKED_OUTPUT_COMM`` (the last stage's draft state would not be handed
over for a lone middle chunk), without a PP prefill CUDA graph (it would hold the raw target
relay instead of the partial), and with an unquantised draft (every stage slices ``fc``)
(:func:`serving_refusal`). The draft must be a plain ``DFlashDraftModel`` whose ``fc`` splits into
per-feature column blocks, with ascending unique ``target_layer_ids``; the target a class whose
every PP stage captures its own features (:data:`PP_CAPTURE_TARGETS`: Kimi-K3, Llama, Qwen3,
Qwen3-MoE, gpt-oss); and the PP partition (sglang's own, honouring ``SGLANG_PP_LAYER_PARTITION``)
one under which every feature has an owner (:func:`model_refusal`).

Each refusal names the fix. Everything is decided before serving, because under PP an exception
on one stage leaves the other stages blocked in their receive forever."""

PR_14 = PR(
    "14",
    new_modules=(
        NewModule(
            "sglang_dflash_pp.srt.arg_groups.dflash_pp_gate",
            drop=(
                "CONFIGURATION",
                "_MASK_SOURCE",
                "_pp_size_reads_one",
                "handle_dflash_around",
                "_AlgorithmReadsAs",
                "check_pipeline_parallel_compat_around",
                "_is_dflash",
                "HOOKS",
            ),
            docstring=GATE_DOC,
        ),
    ),
    edits=(
        AddImport(
            "srt/arg_groups/speculative_hook.py",
            module="sglang.srt.arg_groups.dflash_pp_gate",
            names=("model_refusal", "serving_refusal"),
        ),
        WidenCondition(
            "srt/arg_groups/speculative_hook.py",
            "_handle_dflash",
            condition="cfg.pp_size != 1",
            extra="(refusal := serving_refusal(cfg)) is not None",
            op="and",
        ),
        ReplaceExpression(
            "srt/arg_groups/speculative_hook.py",
            "_handle_dflash",
            old='ValueError("Currently DFLASH speculative decoding only supports pp_size == 1.")',
            new="ValueError(refusal)",
        ),
        InsertStatements(
            "srt/arg_groups/speculative_hook.py",
            "_handle_dflash",
            at="end",
            code="""
            if cfg.pp_size != 1:
                # The draft's fc splits into per-feature blocks; every PP stage captures its own.
                refusal = model_refusal(cfg)
                if refusal is not None:
                    raise ValueError(refusal)
            """,
        ),
        AddImport(
            "srt/arg_groups/validation_hook.py",
            module="sglang.srt.arg_groups.dflash_pp_gate",
            names=("serving_refusal",),
        ),
        InsertStatements(
            "srt/arg_groups/validation_hook.py",
            "check_pipeline_parallel_compat",
            before=IfTest('cfg.speculative_algorithm == "DSPARK"'),
            code="""
            if cfg.speculative_algorithm == "DFLASH":
                refusal = serving_refusal(cfg)
                if refusal is not None:
                    raise ValueError(refusal)
            """,
        ),
        WidenCondition(
            "srt/arg_groups/validation_hook.py",
            "check_pipeline_parallel_compat",
            condition='cfg.speculative_algorithm == "DSPARK"',
            extra='cfg.speculative_algorithm == "DFLASH"',
        ),
    ),
    note=(
        "The gate that opens PRs 8 to 13. _handle_dflash no longer refuses every --pp-size > 1: "
        "it refuses, naming the fix, what the stack does not serve (anything but a Mooncake PD "
        "prefill, SGLANG_ENABLE_PP_SPEC, SGLANG_PP_SKIP_PURE_CHUNKED_OUTPUT_COMM, a PP prefill "
        "CUDA graph, a draft quantised online), and after its other DFLASH decisions, which "
        "read nothing of pp_size, checks the draft and the target (a plain DFlashDraftModel "
        "whose fc splits into per-feature blocks; a target class whose every PP stage captures "
        "its own features; a partition under which every feature has an owner). The launch-time "
        "PP check applies the same serving refusals, then DSPARK's PD prefill contract, which "
        "DFLASH shares. DFLASH PP1 and every other algorithm are unchanged. Tested by "
        "test_dflash_pp_gate.py and test_cli_check.py; the end-to-end tests in test/e2e/ run "
        "the configurations it admits."
    ),
)

# -- PR 15 -----------------------------------------------------------------------------------

KV_WRITE_ONLY_NAMES = (
    "building_kv_write_only",
    "finish_kv_write_only",
    "kv_write_only",
    "kv_write_weights",
    "require_full_fc",
)

PR_15 = PR(
    "15",
    new_modules=(
        NewModule(
            "sglang_dflash_pp.srt.models.kv_write_only",
            target="sglang.srt.models.dflash_kv_write_only",
        ),
    ),
    edits=(
        AddImport(
            "srt/models/dflash.py",
            module="sglang.srt.models.dflash_kv_write_only",
            names=KV_WRITE_ONLY_NAMES,
        ),
        ReplaceExpression(
            "srt/models/dflash.py",
            "DFlashAttention._build_qkv_proj",
            old="self.total_num_heads",
            new="0 if building_kv_write_only() else self.total_num_heads",
        ),
        GuardStatement(
            "srt/models/dflash.py",
            "DFlashAttention.__init__",
            statement=(
                "self.o_proj = RowParallelLinear("
                "self.total_num_heads * head_dim, hidden_size, bias=attention_bias, "
                "quant_config=quant_config, "
                'prefix=f"{prefix}.o_proj" if prefix else "o_proj")'
            ),
            condition="not building_kv_write_only()",
            comment="A KV-write-only draft (the last PP stage's) has no o_proj.",
        ),
        GuardStatement(
            "srt/models/dflash.py",
            "DFlashDecoderLayer.__init__",
            statement="self.mlp = DFlashMLP(config=config, quant_config=quant_config, "
            "prefix=mlp_prefix)",
            condition="not building_kv_write_only()",
            comment="A KV-write-only draft (the last PP stage's) has no MLP.",
        ),
        InsertStatements(
            "srt/models/dflash.py",
            "DFlashDraftModel.__init__",
            at="end",
            code="""
            # The last PP stage of a DFLASH PP prefill keeps only what writes the draft KV.
            finish_kv_write_only(self, config)
            """,
        ),
        InsertStatements(
            "srt/models/dflash.py",
            "DFlashDraftModel.load_weights",
            at="start",
            code="""
            pruned = kv_write_only(self)
            if pruned is not None:
                weights = kv_write_weights(self, pruned, weights)  # only what it holds
            """,
        ),
        InsertStatements(
            "srt/models/dflash.py",
            "DFlashDraftModel.project_target_hidden",
            after=IfTest("context is not None"),
            code="""
            require_full_fc(self)  # a KV-write-only draft projects only through the PP context
            """,
        ),
        InsertStatements(
            "srt/model_loader/weight_utils.py",
            "initialize_dummy_weights",
            at="end",
            code="""
            from sglang.srt.models.dflash_kv_write_only import dummy_kv_write_only

            # A KV-write-only DFlash draft: its sliced parameters get the full ones' values.
            dummy_kv_write_only(model, lambda m: initialize_dummy_weights(m, low, high, seed))
            """,
        ),
    ),
    note=(
        "While the last PP stage of a DFLASH PP prefill builds its draft (the build context "
        "of PR 12, which names the features the stage captures), the draft is built "
        "KV-write-only: qkv_proj without query rows, no o_proj, no MLPs, and fc replaced by "
        "the column block of the stage's features before any weight is loaded; load_weights "
        "skips what it does not hold and slices fc and a fused qkv_proj; under dummy weights "
        "the sliced parameters get the slices of the full draft's dummy values, so a dummy PP "
        "prefill writes the draft KV a dummy PP1 prefill writes. project_target_hidden "
        "refuses such a draft outside the PP context. Kimi-K3 example: 2.20 GB -> 0.15 GB of "
        "draft weights per GPU. Decode servers, PP1 and every other model build the full "
        "draft. Tested by test_kv_write_draft.py (the pruned draft's KV equals the full "
        "draft's bit for bit; memory at TP1 and TP2) and test/e2e/test_dummy_weights_pd_dflash.py."
    ),
)

PRS: Tuple[PR, ...] = (PR_8, PR_9, PR_10, PR_11, PR_12, PR_13, PR_14, PR_15)

UNFINISHED: Dict[str, str] = {}  # every PR of the group is in PRS
