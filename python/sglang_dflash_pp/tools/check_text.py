"""The ``check`` report as text (``--json`` prints the report itself)."""

from __future__ import annotations

import shlex


def render(rep: dict) -> str:
    out = [f"sglang-dflash-pp check: {rep['label']}",
           "Prefill (P): python -m sglang.launch_server " + shlex.join(rep["argv"])]
    v = rep.get("prefill")
    if v:
        out.append(f"  resolves: TP{v['tp_size']} x PP{v['pp_size']} (EP{v['ep_size']}), "
                   f"{v['speculative_algorithm']} ({v['speculative_num_draft_tokens']} draft "
                   f"tokens), {v['disaggregation_mode']} over "
                   f"{v['disaggregation_transfer_backend']}, page size {v['page_size']}, "
                   f"KV cache {v['kv_cache_dtype']}")
    if rep.get("decode_argv"):
        out.append("Decode (D), as check takes it: python -m sglang.launch_server "
                   + shlex.join(rep["decode_argv"]))
    if "stages" in rep:
        out += _stages(rep)
    if "draft_kv" in rep:
        out += _draft_kv(rep["draft_kv"], rep["draft"])
    if "transfer" in rep:
        out += _transfer(rep["transfer"])
    if "draft_target" in rep:
        from sglang_dflash_pp.tools.draft_target import Finding, render as findings

        out += ["", "Draft against target (configs and tokenizers):"]
        out += findings([Finding(**f) for f in rep["draft_target"]])
    out.append("")
    if rep["accepted"]:
        out.append("Refusals: none. Startup would accept this deployment.")
    else:
        out.append(f"Refusals ({len(rep['refusals'])}): startup would refuse this deployment.")
        out += [f"  - [{r['source']}] {r['message']}" for r in rep["refusals"]]
    if not rep.get("draft_matches_target", True):
        out.append("The draft does not match its target (REFUSED above): fix it before serving.")
    return "\n".join(out)


def _stages(rep: dict) -> list:
    t, d, env = rep["target"], rep["draft"], rep["partition_env"]
    env = f", SGLANG_PP_LAYER_PARTITION={env}" if env else ""
    out = ["", f"Target {t['model_class']}: {t['num_layers']} layers; draft features at "
           f"target_layer_ids {d['target_layer_ids']}",
           f"PP partition (get_pp_indices{env}), features per stage (DFlashPPStage.build):"]
    for s in rep["stages"]:
        feats = ", ".join(f"{j} (layer {i})" for j, i in zip(s["features"], s["captured_layers"]))
        notes = ["partial in"] * s["receives_partial"] + ["holds the draft"] * s["holds_draft"]
        out.append(f"  stage {s['stage']}  layers [{s['layers'][0]}, {s['layers'][1]})  "
                   f"features: {feats or '-'}  {'; '.join(notes)}".rstrip())
    if rep["carry"]:
        out.append(f"Carry per token per hop (hidden {d['hidden_size']:,}): the fp32 partial vs "
                   "the raw captures so far")
    out += [f"  {c['hop']}: {c['partial_fp32']:>7,} B vs {c['raw_captures']:>7,} B "
            f"({c['captured_features']} feature(s))" for c in rep["carry"]]
    return out


def _draft_kv(k: dict, d: dict) -> list:
    out = ["", f"Draft KV: {d['num_layers']} layers ({k['entries']} entries), {d['kv_heads']} KV "
           f"heads x {d['head_dim']} {k['dtype']}, page size {k['page_size']}"]
    for side in ("prefill", "decode"):
        per_rank = len(k[f"{side}_heads"][0])
        out.append(f"  {side} attention TP{k[f'{side}_tp']}: {per_rank} head(s) per rank, each "
                   f"head on {k[f'{side}_tp'] * per_rank // d['kv_heads']} rank(s)")
    out.append(f"  one {k['prompt_tokens']:,}-token request ({k['pages']} pages, contiguous, "
               f"{k['chunks']} chunk(s)): P rank {k['prefill_rank']} of the last stage writes")
    w = k["writes"]
    out += [f"    D rank {x['decode_rank']}: heads {x['heads']}, {x['bytes']:,} B, "
            f"{x['descriptors']:,} descriptors ({x['send']})" for x in w]
    out.append(f"    in all: {sum(x['bytes'] for x in w):,} B, "
               f"{sum(x['descriptors'] for x in w):,} descriptors")
    if k["gathers"]:
        out.append(f"    packed by {k['gathers']} gather(s) on the GPU (one per chunk serves every "
                   "D rank when the pack buffer holds the chunk's rows)")
    return out


def _transfer(t: dict) -> list:
    ranks = t["decode_ranks"]
    out = ["", f"Transfer per request ({t['prompt_tokens']:,}-token prompt): P rank "
           f"{t['prefill_rank']} of each stage to D ranks {ranks[0]}..{ranks[-1]}, at "
           f"{t['link_gbps']:g} GB/s"]
    for s in t["stages"]:
        slowest = "  <- slowest" if s["stage"] == t["slowest_stage"] else ""
        out.append(f"  stage {s['stage']}: target {s['target_bytes']:>14,} B  state "
                   f"{s['state_bytes']:>11,} B  draft {s['draft_bytes']:>14,} B  = "
                   f"{s['link_ms']:8.2f} ms{slowest}")
    w = t["draft_window"]
    if w:
        out.append(f"  The draft attends to a sliding window of {w['window']:,} tokens: of the "
                   f"draft KV sent, the decode's draft can read {w['pages']} page(s), "
                   f"{w['draft_bytes_in_window']:,} B; every position is sent.")
    return out
