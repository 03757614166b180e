"""The ``check`` report as text (``--json`` prints the report itself)."""

from __future__ import annotations

import shlex
from typing import List


def _heads(hs: List[int]) -> str:
    return f"head {hs[0]}" if len(hs) == 1 else f"heads {hs[0]}-{hs[-1]}"


def render(rep: dict) -> str:
    out = [f"sglang-dflash-pp check: {rep['label']}",
           "Prefill (P): python -m sglang.launch_server " + shlex.join(rep["argv"])]  # fmt: skip
    v = rep.get("prefill")
    if v:
        out.append(
            f"  resolves: TP{v['tp_size']} x PP{v['pp_size']} (EP{v['ep_size']}), "
            f"{v['speculative_algorithm']} ({v['speculative_num_draft_tokens']} draft tokens), "
            f"{v['disaggregation_mode']} over {v['disaggregation_transfer_backend']}, page size "
            f"{v['page_size']}, KV cache {v['kv_cache_dtype']}"
        )
    if "stages" in rep:
        t, d = rep["target"], rep["draft"]
        env = rep["partition_env"]
        out += [
            "",
            f"Target {t.get('model_class') or t['architectures'][0]}: {t['num_layers']} layers; "
            f"draft features at target_layer_ids {d['target_layer_ids']}",
            "PP partition (get_pp_indices" + (f", SGLANG_PP_LAYER_PARTITION={env}" if env else "")
            + "), features per stage (DFlashPPStage.build):",
        ]  # fmt: skip
        for s in rep["stages"]:
            feats = ", ".join(f"{j} (layer {l})" for j, l in zip(s["features"], s["captured_layers"]))
            role = "holds the draft: norm + draft KV" if s["holds_draft"] else ""
            recv = "partial in" if s["receives_partial"] else ""
            out.append(f"  stage {s['stage']}  layers [{s['layers'][0]}, {s['layers'][1]})  "
                       f"features: {feats or '-'}  " + "; ".join(x for x in (recv, role) if x))  # fmt: skip
        if rep["carry"]:
            out.append(f"Carry per token per hop (hidden {d['hidden_size']:,}): fp32 partial vs "
                       "the raw captures so far")  # fmt: skip
            out += [f"  {c['hop']}: {c['partial_fp32']:>7,} B vs {c['raw_captures']:>7,} B "
                    f"({c['captured_features']} features)" for c in rep["carry"]]  # fmt: skip
    k = rep.get("draft_kv")
    if k:
        d = rep["draft"]
        out += [
            "",
            f"Draft KV: {d['num_layers']} layers ({k['entries']} entries), {d['kv_heads']} KV "
            f"heads x {d['head_dim']} {k['dtype']}, page size {k['page_size']}",
            f"  P attention TP{k['prefill_tp']}: {len(k['prefill_heads'][0])} head(s) per rank; "
            f"D attention TP{k['decode_tp']}: {len(k['decode_heads'][0])} head(s) per rank",
            f"  P rank {k['prefill_rank']} (last stage) writes "
            + ("head by head (TPs differ):" if k["head_by_head"] else "page runs (equal TP):"),
        ]
        out += [f"    D rank {w['decode_rank']}: {_heads(w['heads'])}, {w['bytes']:,} B, "
                f"{w['descriptors']:,} descriptors" for w in k["writes"]]  # fmt: skip
        out.append(f"  per {k['prompt_tokens']:,}-token request ({k['pages']} pages, contiguous)")
    out.append("")
    if rep["accepted"]:
        out.append("Refusals: none. Startup would accept this deployment.")
    else:
        out.append(f"Refusals ({len(rep['refusals'])}): startup would refuse this deployment.")
        out += [f"  - [{r['source']}] {r['message']}" for r in rep["refusals"]]
    return "\n".join(out)
