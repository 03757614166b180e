from sglang_dflash_pp.patch_series.cst_anchors import Stmt
from sglang_dflash_pp.patch_series.cst_declaration_edits import AddMethod
from sglang_dflash_pp.patch_series.cst_edits import InsertStatements

WORKER = "srt/speculative/dflash_worker_v2.py"

PR = dict(
    title="[Spec] DFLASH PP prefill: prune the last stage's draft to its KV write",
    description="""\
Motivation. The last PP stage of a DFLASH PD prefill holds the draft only to write the draft
KV of the prompt from the target's context; the draft blocks, which need the MLPs and
`o_proj`, run on the decode. For Kimi-K3's draft (6 layers, hidden 7168, intermediate 18432)
at prefill TP4 those modules are 1.37 GB per GPU of the last stage, memory the KV cache does
not get.

Change. As DSPARK does on its PD prefill (`DSparkDraftModel.prune_to_ctx_kv_injection`),
`DFlashDraftModel.prune_to_ctx_kv_injection` drops each layer's MLP and `o_proj` after the
draft is loaded, before the memory pools are sized, and the last stage of a DFLASH PP prefill
calls it. That stage also captures no draft decode graph (it would run the pruned modules; a
prefill runs no draft block). The K/V projection, the K norm, RoPE, `fc` and `hidden_norm`
stay. `--pp-size 1` is unchanged.

Tests: `test/registered/unit/models/test_dflash_prune.py`: the pruned draft writes the same
context K/V as the full one, and its parameters shrink by the MLP and `o_proj` bytes. The
end-to-end PP deployments run with the pruned last stage.
""",
    edits=[
        AddMethod(
            "srt/models/dflash.py",
            "DFlashDraftModel",
            after="project_target_hidden",
            code='''
            def prune_to_ctx_kv_injection(self) -> None:
                """Keep only what writes the context KV: a PD prefill never runs a draft
                block, whose MLPs and o_proj are most of the draft."""
                for layer in self.layers:
                    layer.mlp = None
                    layer.self_attn.o_proj = None
                torch.cuda.empty_cache()
            ''',
        ),
        InsertStatements(
            WORKER,
            "DFlashWorkerV2.__init__",
            after=Stmt(
                "self._target_logits_processor = self._defer_target_verify_gather()"
            ),
            code="""
            if self._pp_stage is not None:
                # The last PP stage of a prefill only writes the prompt's draft KV.
                self.draft_model.prune_to_ctx_kv_injection()
            """,
        ),
        InsertStatements(
            WORKER,
            "DFlashWorkerV2.init_cuda_graphs",
            before=Stmt("target_dp_enabled = get_parallel().attn_dp_enabled"),
            code="""
            if self._pp_stage is not None:
                # No draft decode graph: a prefill runs no draft block, and the
                # pruned draft could not capture one.
                with draft_pp_context(), draft_tp_context(self.draft_parallel_layout):
                    self._draft_worker.init_cuda_graphs(capture_decode_cuda_graph=False)
                return
            """,
        ),
    ],
    files=["test/registered/unit/models/test_dflash_prune.py"],
)
