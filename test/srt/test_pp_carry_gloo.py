"""Two PP stages in two processes over gloo: the real proxy dict crosses sglang's
``send_tensor_dict``/``recv_tensor_dict``, and the draft KV the last stage writes equals the PP1
path's, for an unchunked batch and for a request prefilled in chunks with micro-batches in flight.
"""

from __future__ import annotations

import json

from gloo_pair import run_pair


def test_two_stage_pipeline_writes_the_pp1_draft_kv(tmp_path):
    run_pair("pp2_gloo_stage.py", tmp_path)
    stage0 = json.loads((tmp_path / "stage0.json").read_text())
    stage1 = json.loads((tmp_path / "stage1.json").read_text())

    # PP2 over 8 layers: stage 0 captures layer 1, stage 1 layers 3, 5, 7.
    assert stage0["features"] == [0] and stage1["features"] == [1, 2, 3]
    # What crossed the wire: hidden states and the fp32 partial, never the raw capture.
    assert stage0["sent"] == stage1["received"]
    rows = [22, 10, 12, 4]
    for sent, n in zip(stage0["sent"], rows):
        assert sent == {"hidden_states": [[n, 64], "torch.float32"], "dflash_ctx_partial": [[n, 64], "torch.float32"]}
    # The draft KV: every written slot is non-zero, nothing else is touched, and it equals PP1.
    assert stage1["min_row_abs_sum_touched"] > 0
    assert stage1["abs_sum_untouched"] == 0
    scale = stage1["max_abs_written"]
    assert stage1["max_abs_diff_vs_pp1_same_chunks"] <= 1e-5 * scale
    assert stage1["max_abs_diff_vs_pp1_unchunked"] <= 1e-5 * scale
