from sglang_dflash_pp.patch_series.cst_edits import ReplaceExpression

PR = dict(
    title="[Bugfix] Pass input_embeds to the model in the model's dtype",
    description="""\
`ModelRunner._extend_forward_kwargs` casts `forward_batch.input_embeds` to bf16 for every
model. A bf16 model sees no change; an fp32 (or fp16) model receives its embeddings rounded to
bf16, and its first fp32 layer raises a dtype mismatch. DFLASH feeds the target's embeddings
through `input_embeds`, so an fp32 DFLASH server meets it on its first prefill.

Cast to the runner's own dtype (`ModelRunner.dtype`, the `--dtype` the model was loaded in),
as the `replace_embeds` branch right below already does for the rows it scatters. Nothing
changes for bf16 models.

Tests: `test/registered/unit/model_executor/test_extend_forward_kwargs.py` calls the real
method on an fp32 and a bf16 runner.
""",
    edits=[
        ReplaceExpression(
            "srt/model_executor/model_runner.py",
            "ModelRunner._extend_forward_kwargs",
            old="forward_batch.input_embeds.bfloat16()",
            new="forward_batch.input_embeds.to(self.dtype)",
        ),
    ],
    files=["test/registered/unit/model_executor/test_extend_forward_kwargs.py"],
)
