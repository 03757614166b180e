"""What ``test_llama_pd_dflash`` served, kept for the session: the patched-tree module
(``test_patched_tree_pd_dflash``) compares against it instead of starting the same reference
servers again. Filled by the Llama module's ``outputs`` fixture; empty when that module did not
run in this session."""

from __future__ import annotations

from typing import Dict

RECORDED: Dict[str, object] = {}


def record(llama: dict, outputs: dict) -> None:
    """The Llama module's model directories, its draft KV dump directory and its responses:
    ``outputs["a"]`` is the non-PD server's, ``outputs["c"]`` the plugin's PP2 prefill into the
    TP1 decode (dumped under the rid prefix ``c``)."""
    RECORDED.update(
        target=llama["target"], draft=llama["draft"], dump=llama["dump"],
        a=outputs["a"]["sequential"], c=outputs["c"]["sequential"],
    )  # fmt: skip
