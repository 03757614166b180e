"""Carry bytes per token per PP hop: the DFlash context partial vs the concat carry stock DSpark
uses (``dspark_hidden_states``), for a target / PP / draft geometry (default: Kimi-K3 P = PP8).

Uses sglang's own partition (``get_pp_indices``, honouring SGLANG_PP_LAYER_PARTITION) and our
ownership rule. Prints a markdown table and writes it with a JSON twin under results/.

    .venv/bin/python benchmark/pp_carry/carry_bytes.py
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from sglang.srt.distributed.utils import get_pp_indices

from sglang_dflash_pp.tools import carry_table as carry_lib

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import provenance  # noqa: E402


def carry_table(num_layers, pp_size, target_layer_ids, hidden, model_dtype_bytes=2):
    """The table for sglang's own partition; the rows come from the library module that
    ``sglang-dflash-pp check`` uses too."""
    stages = [get_pp_indices(num_layers, r, pp_size) for r in range(pp_size)]
    return carry_lib.carry_table(stages, target_layer_ids, num_layers, hidden, model_dtype_bytes)


def markdown(table):
    lines = [
        f"Target {table['num_layers']} layers, PP{table['pp_size']}, hidden {table['hidden']}, "
        f"target_layer_ids {table['target_layer_ids']}. Bytes per token on each hop.",
        "",
        "| stage | layers | owned features (layer) | hop | partial fp32 | partial bf16 | concat (stock DSpark) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in table["stages"]:
        owned = ", ".join(f"{j} ({l})" for j, l in zip(r["features"], r["captured_layers"])) or "-"
        lines.append(
            f"| {r['stage']} | [{r['layers'][0]}, {r['layers'][1]}) | {owned} | {r['hop'] or '-'} | "
            f"{r['partial_fp32_bytes_per_token']:,} | {r['partial_bf16_bytes_per_token']:,} | "
            f"{r['concat_bytes_per_token']:,} |"
        )
    t, w = table["total_over_hops"], table["worst_hop"]
    lines.append(
        f"| all hops | | | | {t['partial_fp32_bytes_per_token']:,} | "
        f"{t['partial_bf16_bytes_per_token']:,} | {t['concat_bytes_per_token']:,} |"
    )
    lines.append(
        f"| worst hop | | | | {w['partial_fp32_bytes_per_token']:,} | "
        f"{w['partial_bf16_bytes_per_token']:,} | {w['concat_bytes_per_token']:,} |"
    )
    lines += [
        "",
        f"Concat / partial over all hops: {table['concat_over_partial_fp32_total']:.2f}x (fp32 "
        f"carry), {table['concat_over_partial_bf16_total']:.2f}x (bf16 carry); worst hop "
        f"{table['concat_over_partial_fp32_worst_hop']:.2f}x (fp32).",
    ]
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-layers", type=int, default=93)
    parser.add_argument("--pp-size", type=int, default=8)
    parser.add_argument("--target-layer-ids", default="19,37,54,66,78,90")
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--name", default="kimi_k3_pp8")
    args = parser.parse_args()
    ids = [int(x) for x in args.target_layer_ids.split(",")]
    table = carry_table(args.num_layers, args.pp_size, ids, args.hidden)
    table["provenance"] = provenance.record(
        repetitions=1,
        warmup=0,
        timed_sources=["python/sglang_dflash_pp/tools/carry_table.py"],
        measured="byte counts computed from sglang's partition and the ownership rule "
        "(deterministic: no timing, so no samples)",
    )
    p = table["provenance"]
    text = markdown(table) + (
        f"\n\nComputed {p['date_utc']} at commit {p['project']['commit'][:12]} (tree "
        f"{p['project']['tree']}) by `{p['command']}` with sglang {p['versions']['sglang']}; raw "
        f"values and provenance: [`{args.name}.json`]({args.name}.json)."
    )
    print(text)
    out = os.path.join(HERE, "results")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{args.name}.json"), "w") as f:
        json.dump(table, f, indent=1)
    with open(os.path.join(out, f"{args.name}.md"), "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
