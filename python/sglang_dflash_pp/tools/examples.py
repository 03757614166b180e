"""The packaged example deployments (``sglang_dflash_pp/examples/<name>/``).

Each is a target ``config.json``, a draft ``config.json`` (shape stand-ins, no weights; see the
README next to them) and ``topology.json``: the prefill's launch arguments without the model
paths, the page size, the decode TP size and a prompt length. ``check --example`` reads them,
so the examples run on a fresh machine.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import List, Optional

EXAMPLES_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
NAMES = {"kimi-k3": "kimi_k3"}


@dataclass(frozen=True)
class Example:
    name: str
    root: str
    description: str
    prefill_args: List[str]
    page_size: int
    decode_tp_size: int
    prompt_tokens: int

    @property
    def target_dir(self) -> str:
        return os.path.join(self.root, "target")

    @property
    def draft_dir(self) -> str:
        return os.path.join(self.root, "draft")

    def config(self, which: str) -> dict:
        with open(os.path.join(self.root, which, "config.json")) as f:
            return json.load(f)

    def prefill_argv(self, page_size: Optional[int] = None) -> List[str]:
        return [
            "--model-path", self.target_dir,
            "--speculative-draft-model-path", self.draft_dir,
            *self.prefill_args,
            "--page-size", str(page_size or self.page_size),
        ]  # fmt: skip

    def prefill_arg(self, flag: str) -> str:
        return self.prefill_args[self.prefill_args.index(flag) + 1]


def load(name: str) -> Example:
    if name not in NAMES:
        raise ValueError(f"unknown example {name!r}; available: {sorted(NAMES)}")
    root = os.path.join(EXAMPLES_DIR, NAMES[name])
    with open(os.path.join(root, "topology.json")) as f:
        topo = json.load(f)
    return Example(
        name=name,
        root=root,
        description=topo["description"].split(":")[0],
        prefill_args=list(topo["prefill_args"]),
        page_size=int(topo["page_size"]),
        decode_tp_size=int(topo["decode_tp_size"]),
        prompt_tokens=int(topo["prompt_tokens"]),
    )
