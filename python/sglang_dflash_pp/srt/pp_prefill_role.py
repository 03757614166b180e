"""Whether this server process is one PP stage of a DFLASH PD prefill server: the one
configuration in which the model-capture and transfer-id hooks act (the argument gate has
already accepted it, ``arg_groups/dflash_pp_gate``). Read from sglang's published runtime
context, so any hook can ask without the server args.
"""

from __future__ import annotations


def serving_dflash_pp_prefill() -> bool:
    from sglang.srt.runtime_context import get_disagg, get_parallel, get_spec

    return (
        str(get_spec().speculative_algorithm).upper() == "DFLASH"
        and int(get_parallel().pp_size) > 1
        and get_disagg().disaggregation_mode == "prefill"
    )
