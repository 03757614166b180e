from sglang_dflash_pp.patch_series.cst_edits import AddKeywordArgument

PR = dict(
    title="[Bugfix] PP: a skipped output relay keeps the batch's draft input",
    description="""\
With `SGLANG_PP_SKIP_PURE_CHUNKED_OUTPUT_COMM=1`, a pipeline-parallel prefill skips the output
relay of a lone middle chunk and synthesises its result in `_pp_make_skip_output_result`. That
result carries no `next_draft_input`, so on a speculative PD prefill (DSPARK today)
`process_batch_result_disagg_prefill` fails its `batch.spec_info is result.next_draft_input`
assertion on the first such chunk, and the other PP stages wait forever.

The synthesised result now carries the batch's own draft input, as the relayed path does. A
middle chunk's draft input is read by nothing else before the next chunk replaces it, and a
non-speculative batch carries None as before, so the skip keeps its saving.

Tests: `test/registered/unit/managers/test_pp_skip_output_result.py` runs the real
`_pp_make_skip_output_result` and `process_batch_result_disagg_prefill` on a DSPARK middle
chunk.
""",
    edits=[
        AddKeywordArgument(
            "srt/managers/scheduler_pp_mixin.py",
            "SchedulerPPMixin._pp_make_skip_output_result",
            call="GenerationBatchResult",
            keyword="next_draft_input",
            value="batch.spec_info",
            comment="The PD prefill checks the result against the batch's draft input.",
        ),
    ],
    files=["test/registered/unit/managers/test_pp_skip_output_result.py"],
)
