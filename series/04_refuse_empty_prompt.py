from sglang_dflash_pp.patch_series.cst_anchors import Stmt
from sglang_dflash_pp.patch_series.cst_edits import InsertStatements

PR = dict(
    title="[Bugfix] Refuse a prompt that tokenizes to zero tokens",
    description="""\
`POST /generate {"text": ""}` through a tokenizer that adds no BOS (Qwen's, for one) reaches the
scheduler as a 0-token prefill: admission bounds the tokenized prompt only from above. The first
attention layer then raises (RoPE cannot view 0 rows) and the server exits; under PP the other
stages are left waiting. In PD the decode, which received the same request from the router,
allocates a request-pool row and no KV token for it, cannot release it
(`release_kv_cache`'s `holds_kv` assertion) and exits on its idle leak check.

`TokenizerManager._validate_one_request`, the first check that sees the tokenized prompt,
refuses it with a 400 as an empty `input_ids` field is refused today, on every server and
before any queue. Requests given as `input_embeds` carry no ids, and a session turn is
prefixed with the session's history later; neither is affected.

Tests: `test/registered/unit/managers/test_empty_prompt.py` (0 tokens refused; a session turn,
1 token and an over-long prompt behave as before).
""",
    edits=[
        InsertStatements(
            "srt/managers/tokenizer_manager.py",
            "TokenizerManager._validate_one_request",
            before=Stmt("_max_req_len = self.context_len"),
            code="""
            if (
                input_ids is not None
                and len(input_ids) == 0
                and getattr(obj, "session_params", None) is None
            ):
                # No token to prefill, and no position whose logits give a first token.
                # (A session turn is prefixed with the session's history later.)
                raise ValueError("The input prompt is empty (0 tokens after tokenization).")
            """,
        ),
    ],
    files=["test/registered/unit/managers/test_empty_prompt.py"],
)
