"""Human-readable rendering of a ``check`` report (the JSON form is the report itself)."""

from __future__ import annotations

import shlex
from typing import List

from sglang_dflash_pp.srt.disaggregation.draft_kv_geometry import format_heads
from sglang_dflash_pp.tools.draft_kv_report import writer_lines


def _heads(hs) -> str:
    return format_heads(range(hs[0], hs[-1] + 1))


def _n(x) -> str:
    return f"{x:,}" if isinstance(x, int) else str(x)


def render(rep: dict) -> str:
    out: List[str] = [f"sglang-dflash-pp check: {rep['label']}", ""]
    out += _servers(rep)
    if "stages" in rep:
        out += _stages(rep)
    if "carry" in rep:
        out += _carry(rep["carry"])
    if "draft_kv" in rep:
        out += _draft_kv(rep["draft_kv"])
    if "kv_checksum" in rep:
        out += _kv_checksum(rep["kv_checksum"])
    if "last_stage_draft_weights" in rep:
        out += _last_stage_draft_weights(rep["last_stage_draft_weights"])
    if "startup_assertions" in rep:
        out += _startup_assertions(rep["startup_assertions"])
    for note in rep.get("notes", []):
        out.append(f"note: {note}")
    classes = rep.get("accepted_target_classes") or {}
    if classes:
        out.append("")
        out.append("Target classes accepted for DFLASH with --pp-size > 1 (capture points):")
        for arch, rule in classes.items():
            out.append(f"  {arch}: {rule}")
    out.append("")
    if rep["accepted"]:
        out.append("Refusals: none. Startup would accept this deployment.")
    else:
        out.append(f"Refusals ({len(rep['refusals'])}): startup would refuse this deployment.")
        for r in rep["refusals"]:
            out.append(f"  - [{r['source']}] {r['message']}")
    return "\n".join(out)


def _servers(rep: dict) -> List[str]:
    lines = []
    p, d = rep["prefill"], rep["decode"]
    lines.append("Prefill (P): python -m sglang.launch_server " + shlex.join(p["argv"]))
    v = p.get("values")
    if p["resolved"] and v:
        lines.append(
            f"  resolves: TP{v['tp_size']} x PP{v['pp_size']} (EP{v['ep_size']}), "
            f"{v['speculative_algorithm']} ({v['speculative_num_draft_tokens']} draft tokens), "
            f"{v['disaggregation_mode']} over {v['disaggregation_transfer_backend']}, page size "
            f"{v['page_size']}, KV cache {v['kv_cache_dtype']}, attention {v['attention_backend']}"
        )
    elif not p["resolved"]:
        lines.append("  refused at startup (see Refusals)")
    if "argv" in d:
        verdict = "resolves" if d["resolved"] else "refused at startup (see Refusals)"
        lines.append(
            f"Decode (D): TP{d['tp_size']}, PP1, stock DFLASH decode with P's model, draft, "
            f"page size and KV dtype: {verdict}"
        )
    lines.append("")
    return lines


def _stages(rep: dict) -> List[str]:
    t, dr = rep["target"], rep["draft"]
    lines = [
        f"PP partition of {t['num_layers']} target layers (sglang get_pp_indices"
        + (
            f", SGLANG_PP_LAYER_PARTITION={rep['partition']['env']}"
            if rep["partition"]["env"]
            else ""
        )
        + f"): {rep['partition']['layers_per_stage']}",
        f"DFlash context features: target_layer_ids {dr['target_layer_ids']}",
    ]
    conv = rep.get("capture_convention")
    if conv:
        lines.append(f"Capture points ({conv['target_class']}): {conv['rule']}")
    lines += [
        "  stage  layers      features (captured layer)  carry in  carry out",
    ]
    for s in rep["stages"]:
        feats = ", ".join(f"{j} ({l})" for j, l in zip(s["features"], s["captured_layers"])) or "-"
        if s["hosts_draft"]:
            feats += "; norm + draft KV"
        layers = f"[{s['layers'][0]}, {s['layers'][1]})"
        lines.append(
            f"  {s['stage']:<6} {layers:<11} {feats:<26} "
            f"{'partial' if s['receives_partial'] else '-':<10}"
            f"{'partial' if s['sends_partial'] else '-'}"
        )
    lines.append("")
    return lines


def _last_stage_draft_weights(w: dict) -> List[str]:
    gb = lambda b: f"{b / 1e9:.2f} GB"  # noqa: E731
    return [
        f"Draft weights per GPU on the last P stage (draft TP{w['draft_tp']}): stock "
        f"{gb(w['stock_bytes'])} ({w['stock_bytes']:,} B), KV-write-only "
        f"{gb(w['kv_write_only_bytes'])} ({w['kv_write_only_bytes']:,} B: K/V projections, "
        f"norms, fc block of features {w['fc_features']}); saved {gb(w['saved_bytes'])}",
        "",
    ]


def _carry(c: dict) -> List[str]:
    lines = [
        f"Carry per token per PP hop (hidden {c['hidden']:,}): partial in {c['dtype']} "
        f"({c['dtype_source']}) vs the concat carry (stock DSpark relay, model dtype)",
        "  hop    partial   concat",
    ]
    for h in c["hops"]:
        lines.append(
            f"  {h['hop']:<6} {h['partial_bytes_per_token']:>8,}  {h['concat_bytes_per_token']:>8,}"
        )
    lines.append(
        f"  all    {c['partial_bytes_per_token_all_hops']:>8,}  "
        f"{c['concat_bytes_per_token_all_hops']:>8,}   (worst hop: "
        f"{c['partial_bytes_per_token_per_hop']:,} vs {c['concat_bytes_per_token_max']:,})"
    )
    lines.append("")
    return lines


def _draft_kv(k: dict) -> List[str]:
    s = k["shape"]
    dims = (
        f"{s['k_head_dim']}"
        if s["k_head_dim"] == s["v_head_dim"]
        else f"K {s['k_head_dim']} / V {s['v_head_dim']}"
    )
    lines = [
        f"Draft KV: {k['entries']} entries (K, V per draft layer), {s['total_heads']} KV heads "
        f"x {dims}, "
        f"{k['dtype']} ({s['dtype_bytes']} B), page size {k['page_size']}"
    ]
    for side, tag in (("prefill", "P"), ("decode", "D")):
        g = k[side]
        rep_txt = f", each head on {g['replication']} ranks" if g["replication"] > 1 else ""
        shown = _rank_heads(tag, g["ranks"])
        lines.append(
            f"  {tag} TP{g['tp_size']}: {g['heads_per_rank']} head(s) per rank{rep_txt}; "
            f"page item_len "
            f"K {g['k_item_len']:,} B, V {g['v_item_len']:,} B; {shown}"
        )
    st = k.get("pack_staging")
    if st:
        lines.append(
            f"  P pack staging (allocated and registered at startup, per last-stage GPU): "
            f"{st['bytes_per_gpu'] / (1 << 20):,.1f} MiB = {st['slots']} slot(s) x "
            f"{st['slot_bytes'] / (1 << 20):,.1f} MiB (a {st['chunk_tokens']:,}-token chunk's "
            f"head slices in one pack: {st['chunk_slot_bytes'] / (1 << 20):,.1f} MiB)"
        )
    lines.append("Writer map (last P stage's ranks; which heads each writes to which D ranks):")
    lines += [f"  {ln}" for ln in writer_lines(k)]
    dr = k["decode_ranks"]
    desc, byts = sorted({r["descriptors"] for r in dr}), sorted({r["bytes"] for r in dr})
    mins = sorted({r["physical_minimum_bytes"] for r in dr})
    per_token = sorted({r["per_token_descriptors"] for r in dr})
    lines.append(
        f"One {k['prompt_tokens']:,}-token request ({k['pages']} pages, contiguous): per D rank "
        f"{'/'.join(_n(x) for x in desc)} descriptors, {'/'.join(_n(x) for x in byts)} bytes "
        f"(physical minimum {'/'.join(_n(x) for x in mins)}; one descriptor per token row would be "
        f"{'/'.join(_n(x) for x in per_token)})"
    )
    pr = k["prefill_ranks"]
    lines.append(
        "  per P rank: "
        + "; ".join(
            f"P{p['prefill_rank']} {p['descriptors']:,} descriptors, {p['bytes']:,} B"
            for p in pr[:4]
        )
        + (" ..." if len(pr) > 4 else "")
    )
    lines.append("")
    return lines


VERDICT = {True: "ok", False: "REFUSED", None: "unknown"}


def _startup_assertions(rows) -> List[str]:
    lines = [
        "Startup assertions past argument resolution (model, pool and transfer setup; each "
        "mirrors a stock sglang 0.5.23 assertion or a plugin refusal):"
    ]
    for r in rows:
        lines.append(
            f"  {VERDICT[r['ok']]:<8} {r['side']:<4} {r['check']}: {r['value']}  [{r['source']}]"
        )
    lines.append("")
    return lines


def _rank_heads(tag: str, ranks) -> str:
    """``D0-3: head 0; D4-7: head 1; ...``: consecutive ranks holding the same heads grouped."""
    groups = []
    for q, h in enumerate(ranks):
        if groups and groups[-1][2] == h:
            groups[-1][1] = q
        else:
            groups.append([q, q, h])
    parts = [f"{tag}{a}{f'-{b}' if b > a else ''}: {_heads(h)}" for a, b, h in groups]
    return "; ".join(parts if len(parts) <= 8 else parts[:4] + ["..."] + parts[-2:])


def _kv_checksum(c: dict) -> List[str]:
    n, d = c["prefill_ranks"], c["decode_tp"]
    why = ("stock's --disaggregation-enable-kv-checksum alone would admit them unverified: the "
           "PP stages / TP widths differ" if c["stock_would_skip"] else
           "stock's digest would also compare them (same layout)")  # fmt: skip
    if not c["enabled"]:
        return ["", "KV checksum: off. Transfers are not verified (" + why + "). Add "
                "--disaggregation-enable-kv-checksum to the prefill and every decode to verify "
                "every transferred byte (the composed digest)."]  # fmt: skip
    if c.get("refused"):
        return ["", f"KV checksum: on, but {c['refused']}."]
    return [
        "",
        "KV checksum: on; every transfer is verified on the decode by the composed digest "
        f"({why}).",
        f"  each of the {n} prefill ranks sends each decode rank it writes one message of "
        "per-buffer sums (target KV entries, KDA/Mamba state, draft KV entries) before its "
        "status;",
        f"  each of the {d} decode ranks digests its own bytes of the request when it enters a "
        "batch and drops it on a mismatch, naming the room, buffer and prefill ranks; "
        "--disaggregation-enable-kv-checksum goes on the decode servers too.",
    ]
