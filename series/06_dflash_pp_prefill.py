from sglang_dflash_pp.patch_series.cst_anchors import Stmt
from sglang_dflash_pp.patch_series.cst_declaration_edits import (
    AddClassAttribute,
    AddImport,
    AddMethod,
    AddParameter,
)
from sglang_dflash_pp.patch_series.cst_edits import (
    AddElif,
    AddKeywordArgument,
    GuardStatement,
    InsertStatements,
    ReplaceExpression,
    ReplaceStatement,
    WidenCondition,
)

WORKER = "srt/speculative/dflash_worker_v2.py"
MIXIN = "srt/managers/scheduler_pp_mixin.py"

PR = dict(
    title="[Spec] DFLASH with pipeline parallelism on a PD prefill server",
    description="""\
Motivation. A PD deployment whose prefill needs pipeline parallelism (Kimi-K3 prefills at
TP4 x PP8 against a TP32 decode) cannot use DFLASH: `--speculative-algorithm DFLASH
--pp-size N` is refused, although DSPARK runs on the same topology. The DFlash context of a
token is `hidden_norm(fc(concat(h_0 .. h_{K-1})))` over K captured target layers, and under PP
each stage holds only some of those layers.

Change. `fc` is linear: `fc(concat(h)) = sum_j h_j @ W_j.T` with `W_j` the j-th column block of
`fc.weight`. So, as for DSPARK, only the last PP stage holds the draft (its worker, runner and
KV pool); each stage before it projects the features it captures with its own column blocks
of `fc`, read from the draft checkpoint through the model loader, and hands on one
`[tokens, hidden]` fp32 partial in the PP tensors instead of the raw captures
(`speculative/dflash_pp.py`). The last stage adds its own features' projection and normalises
(`DFlashDraftModel.project_target_hidden(..., context_partial=)`); the draft KV write after it
is unchanged. The PP relay rebuilds the prefill's `DFlashDraftInputV2` on every stage as it
does for DSPARK, the last stage builds its draft with the target's seed and the stage-local
load group (as `DSparkWorkerV2` does: a WORLD broadcast there deadlocked against the stages
that build no draft), and it skips the two steps that need the target's embedding, which is
not on that stage: caching the full embedding (DP attention's draft blocks) and merging a
trained mask embedding into the target's mask-token row. That row is read only where a
prompt contains the draft's mask token, which then embeds with the checkpoint's own row. Under
PP the draft keeps the weights it was loaded with: draft weight updates are not applied
(`weight_update_runners`), since the earlier stages' `fc` columns could not follow them.

The target must capture its features on every stage: Kimi-K3 already relays its captures
between stages as `dspark_hidden_states`; Llama now does the same (about five lines in
`LlamaModel.forward`). Both declare `supports_pp_dflash_capture`. Llama reads layer L at
layer L + 1's input, so it never captured a draft feature of its last layer: a PP1 server
failed on such a draft at its first request; every server now refuses it at startup.

Only the last stage appends draft KV entries, so with the previous PR the draft KV reaches a
decode of any attention TP head by head, from the last stage alone.

Accepted only on a PD prefill over Mooncake, without a PP prefill CUDA graph or
`SGLANG_ENABLE_PP_SPEC`. Everything else is refused at startup, on every stage alike, with
what to change: another target class, a draft whose `fc` is quantized or overridden,
unsorted `target_layer_ids`, or a partition under which the last stage captures no feature
(the message names the `SGLANG_PP_LAYER_PARTITION` to use). `--pp-size 1` is unchanged.

Accuracy. Each stage's projection is accumulated in fp32 and the carry stays fp32 (a PP1
server rounds the fc output once; a bf16 carry would round once per stage). On real CPU
servers (tiny fp32 Llama and bf16 Kimi-K3, Mooncake over TCP, the PD router), a PP2 prefill,
a TP2 x PP2 prefill and a PP2 prefill into a TP2 decode give the non-PD server's greedy
tokens, and the decode's draft KV equals what a PP1 prefill sends (fp32 bound; bytes equal
into the TP2 decode).

Carry. From the first stage that captures a feature on, every hop carries 4 x hidden bytes
per token, whatever the number of features; the raw captures grow by 2 x hidden per feature.
Kimi-K3 at PP8 (default partition, features at layers 19..90): 28,672 B on each of the six
hops after stage 1, against 14,336 to 71,680 B of raw captures (172 KB against 229 KB per
token over the pipeline).

Tests: `test/registered/unit/speculative/test_dflash_pp.py` (feature ownership over PP
partitions, the partial sum equal to the single fc, refusals).
""",
    edits=[
        # -- the last stage finishes the context -----------------------------------------
        AddImport(
            "srt/models/dflash.py",
            module="sglang.srt.speculative.dflash_pp",
            names=("fc_projection",),
        ),
        AddParameter(
            "srt/models/dflash.py",
            "DFlashDraftModel.project_target_hidden",
            name="context_partial",
            default="None",
            annotation="Optional[torch.Tensor]",
        ),
        InsertStatements(
            "srt/models/dflash.py",
            "DFlashDraftModel.project_target_hidden",
            at="start",
            code="""
            if context_partial is not None:
                # Under PP this stage captured only the trailing features; the
                # stages before it sent the sum of their projections (dflash_pp).
                fc_columns = self.fc.weight[:, -target_hidden.shape[-1] :]
                context = fc_projection(
                    target_hidden, fc_columns, context_partial[: target_hidden.shape[0]]
                )
                return self.hidden_norm.forward_native(context).to(target_hidden.dtype)
            """,
        ),
        # -- the PP-aware worker ----------------------------------------------------------
        AddImport(
            WORKER,
            module="sglang.srt.speculative.dflash_pp",
            names=("DFlashPPStage",),
        ),
        AddImport(
            WORKER,
            module="sglang.srt.model_loader.weight_utils",
            names=("get_pp_stage_load_group",),
        ),
        InsertStatements(
            WORKER,
            "DFlashWorkerV2.__init__",
            after=Stmt("self._target_tp_rank = get_parallel().tp_rank"),
            code="""
            # Under PP only the last stage holds the draft, as for DSPARK; the stages
            # before it project their own features onto the context partial.
            self._hosts_draft = get_parallel().pp_group.is_last_rank
            self._pp_stage = None
            if get_parallel().pp_size > 1:
                self._pp_stage = DFlashPPStage.for_target(
                    target_worker.model_runner, self.device
                )
            if not self._hosts_draft:
                self._draft_worker = None
                return
            load_group = get_pp_stage_load_group()
            """,
        ),
        AddKeywordArgument(
            WORKER,
            "DFlashWorkerV2.__init__",
            call="build_draft_tp_worker",
            keyword="random_seed",
            value="target_worker.random_seed",
        ),
        AddKeywordArgument(
            WORKER,
            "DFlashWorkerV2.__init__",
            call="build_draft_tp_worker",
            keyword="load_group",
            value="load_group",
        ),
        GuardStatement(
            WORKER,
            "DFlashWorkerV2.__init__",
            statement="self._maybe_merge_trained_mask_embedding()",
            through="self._cache_full_embed_weight()",
            condition="self._pp_stage is None",
            comment="Both need the target's embedding, which is not on the last PP stage.",
        ),
        InsertStatements(
            WORKER,
            "DFlashWorkerV2.weight_update_runners",
            at="start",
            code="""
            if self._pp_stage is not None:
                # The stages before the last hold fc columns read at startup, which a
                # draft update could not reach: under PP the draft keeps its weights.
                return []
            """,
        ),
        InsertStatements(
            WORKER,
            "DFlashWorkerV2.spec_v2_attn_backends",
            at="start",
            code="""
            if not self._hosts_draft:
                return super().spec_v2_attn_backends
            """,
        ),
        *(
            InsertStatements(
                WORKER,
                f"DFlashWorkerV2.{method}",
                at="start",
                code="""
                if not self._hosts_draft:
                    return
                """,
            )
            for method in ("alloc_memory_pool", "init_attention_backends", "init_cuda_graphs")
        ),
        InsertStatements(
            WORKER,
            "DFlashWorkerV2.prewarm_sampling",
            at="start",
            code="""
            if not self._hosts_draft:
                return self.model_runner.prewarm_sampling()
            """,
        ),
        InsertStatements(
            WORKER,
            "DFlashWorkerV2.forward_batch_generation",
            at="start",
            code="""
            if not self._hosts_draft:
                return self._forward_pp_prefill_stage(batch, on_publish, pp_proxy_tensors)
            """,
        ),
        AddKeywordArgument(
            WORKER,
            "DFlashWorkerV2.forward_batch_generation",
            call="self._append_target_hidden_to_draft_kv_by_loc",
            keyword="context_partial",
            having="extend_lens",
            value=(
                "None if self._pp_stage is None "
                "else self._pp_stage.inbound_partial(pp_proxy_tensors)"
            ),
        ),
        AddParameter(
            WORKER,
            "DFlashWorkerV2._append_target_hidden_to_draft_kv_by_loc",
            name="context_partial",
            default="None",
            annotation="Optional[torch.Tensor]",
        ),
        ReplaceStatement(
            WORKER,
            "DFlashWorkerV2._append_target_hidden_to_draft_kv_by_loc",
            statement="ctx_hidden = self.draft_model.project_target_hidden(target_hidden)",
            code="""
            if context_partial is None:
                ctx_hidden = self.draft_model.project_target_hidden(target_hidden)
            else:
                ctx_hidden = self.draft_model.project_target_hidden(
                    target_hidden, context_partial=context_partial
                )
            """,
        ),
        AddMethod(
            WORKER,
            "DFlashWorkerV2",
            after="forward_batch_generation",
            code='''
            def _forward_pp_prefill_stage(self, batch, on_publish, pp_proxy_tensors):
                """A PP stage before the last: run the target and hand on the context
                partial in place of the raw captures."""
                batch_output = self.target_worker.forward_batch_generation(
                    batch,
                    pp_proxy_tensors=pp_proxy_tensors,
                    capture_hidden_mode=CaptureHiddenMode.FULL,
                )
                self._pp_stage.hand_on(
                    batch_output.pp_hidden_states_proxy_tensors.tensors,
                    None if pp_proxy_tensors is None else pp_proxy_tensors.tensors,
                )
                batch_output.new_seq_lens = batch.seq_lens
                if on_publish is not None:
                    on_publish(batch_output.new_seq_lens)
                return batch_output
            ''',
        ),
        # -- every stage rebuilds the prefill's draft input from the PP relay --------------
        WidenCondition(
            MIXIN,
            "SchedulerPPMixin._pp_prepare_tensor_dict",
            condition="not batch.spec_algorithm.is_dspark()",
            extra="not batch.spec_algorithm.is_dflash()",
            op="and",
        ),
        AddElif(
            MIXIN,
            "SchedulerPPMixin._pp_prep_batch_result",
            after_test="batch.spec_algorithm.is_dspark()",
            test="batch.spec_algorithm.is_dflash()",
            code="""
            from sglang.srt.speculative.draft_worker_common import make_draft_input_v2

            next_draft_input = make_draft_input_v2(
                bonus_tokens=next_token_ids, new_seq_lens=batch.seq_lens
            )
            batch.spec_info = next_draft_input
            """,
        ),
        # -- targets that capture on every stage ------------------------------------------
        AddClassAttribute(
            "srt/models/kimi_k3.py",
            "KimiK3LinearForCausalLM",
            code="""
            # Every PP stage captures its DFLASH features and relays them.
            supports_pp_dflash_capture = True
            """,
        ),
        AddClassAttribute(
            "srt/models/kimi_k3.py",
            "KimiK3ForConditionalGeneration",
            code="supports_pp_dflash_capture = True",
        ),
        AddClassAttribute(
            "srt/models/llama.py",
            "LlamaForCausalLM",
            code="""
            # Every PP stage captures its DFLASH features and relays them.
            supports_pp_dflash_capture = True
            """,
        ),
        InsertStatements(
            "srt/models/llama.py",
            "LlamaForCausalLM.set_dflash_layers_to_capture",
            at="start",
            code="""
            if layer_ids and max(layer_ids) >= self.config.num_hidden_layers - 1:
                # Layer L is read at layer L + 1's input: the last layer's output never is.
                raise ValueError(
                    f"DFLASH target_layer_ids {list(layer_ids)} include the target's last "
                    f"layer, whose output {type(self).__name__} does not capture; use "
                    f"ids below {self.config.num_hidden_layers - 1}."
                )
            """,
        ),
        InsertStatements(
            "srt/models/llama.py",
            "LlamaForCausalLM.set_dflash_layers_to_capture",
            before=Stmt("return"),
            code="""
            # Captured here too, and handed on in the PP tensors (LlamaModel.forward).
            self.model.layers_to_capture = [val + 1 for val in layer_ids or ()]
            """,
        ),
        ReplaceStatement(
            "srt/models/llama.py",
            "LlamaModel.forward",
            statement="return residual_batch.to_pp(hidden_states, forward_batch)",
            code="""
            proxy_tensors = residual_batch.to_pp(hidden_states, forward_batch)
            if len(aux_hidden_states) > 0:
                # A DFLASH PP prefill stage hands on what it captured, as Kimi-K3 does.
                proxy_tensors.tensors["dspark_hidden_states"] = torch.cat(
                    aux_hidden_states, dim=-1
                )
            return proxy_tensors
            """,
        ),
        # -- the gate ----------------------------------------------------------------------
        WidenCondition(
            "srt/arg_groups/speculative_hook.py",
            "_handle_dflash",
            condition="cfg.pp_size != 1",
            extra='cfg.disaggregation_mode != "prefill"',
            op="and",
        ),
        ReplaceExpression(
            "srt/arg_groups/speculative_hook.py",
            "_handle_dflash",
            old='"Currently DFLASH speculative decoding only supports pp_size == 1."',
            new=(
                '"DFLASH with pp_size > 1 is only supported on a PD prefill server "'
                '"(--disaggregation-mode prefill); run the decode with --pp-size 1."'
            ),
        ),
        ReplaceExpression(
            "srt/arg_groups/validation_hook.py",
            "check_pipeline_parallel_compat",
            old='cfg.speculative_algorithm == "DSPARK"',
            new='cfg.speculative_algorithm in ("DSPARK", "DFLASH")',
        ),
        ReplaceExpression(
            "srt/arg_groups/validation_hook.py",
            "check_pipeline_parallel_compat",
            old='"Pipeline parallel DSPARK requires disaggregation-mode=prefill"',
            new=(
                'f"Pipeline parallel {cfg.speculative_algorithm} requires "'
                '"disaggregation-mode=prefill"'
            ),
        ),
        ReplaceExpression(
            "srt/arg_groups/validation_hook.py",
            "check_pipeline_parallel_compat",
            old='"SGLANG_ENABLE_PP_SPEC does not support DSPARK PD prefill"',
            new=(
                'f"SGLANG_ENABLE_PP_SPEC does not support {cfg.speculative_algorithm} "'
                '"PD prefill"'
            ),
        ),
        AddImport(
            "srt/arg_groups/validation_hook.py",
            module="sglang.srt.model_executor.cuda_graph_config",
            names=("Backend",),
        ),
        InsertStatements(
            "srt/arg_groups/validation_hook.py",
            "check_pipeline_parallel_compat",
            after=Stmt(
                'assert not envs.SGLANG_ENABLE_PP_SPEC.get(), ('
                'f"SGLANG_ENABLE_PP_SPEC does not support {cfg.speculative_algorithm} "'
                '"PD prefill")'
            ),
            code="""
            if cfg.speculative_algorithm == "DFLASH":
                # Only Mooncake sends the draft KV head-aware from the last stage,
                # and a captured prefill graph would hold the raw captures.
                assert cfg.disaggregation_transfer_backend == "mooncake", (
                    "Pipeline parallel DFLASH requires "
                    "--disaggregation-transfer-backend mooncake"
                )
                assert cfg.cuda_graph_config.prefill.backend == Backend.DISABLED, (
                    "Pipeline parallel DFLASH requires --cuda-graph-backend-prefill "
                    "disabled"
                )
            """,
        ),
    ],
    files=[
        "python/sglang/srt/speculative/dflash_pp.py",
        "test/registered/unit/speculative/test_dflash_pp.py",
    ],
)
