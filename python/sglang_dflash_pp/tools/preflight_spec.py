"""What every ``preflight`` process agrees on: the scaled geometry, the request's pages, the
synthetic target captures, and the files in the work directory.

The captures stand in for the target's hidden states at the draft's capture layers (the target
itself cannot run on CPU: Kimi-K3's KDA and MLA kernels need a GPU). They are a deterministic
function of (seed, feature), so any process can produce exactly the features it captures, and
the last stage can build the single-process reference from all of them.

Imports torch lazily: the parent process never needs it.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import List

SPEC_FILE = "spec.json"
OWNERSHIP_FILE = "ownership.json"
KV_FILE = "draft_kv.pt"
CARRY_STORE = "carry_store"
SGLANG_INIT = "sglang_init"


@dataclass
class PreflightSpec:
    workdir: str
    pp: int
    p_tp: int
    d_tp: int
    draft_heads: int
    head_dim: int
    hidden: int
    draft_layers: int
    tokens: int
    page_size: int
    num_layers: int  # target layers (sets the partition and the ownership)
    target_layer_ids: List[int]
    dtype: str  # model dtype: the captures, the draft and its KV
    carry_dtype: str
    seed: int
    pack_buffer_mb: int
    timeout_s: float
    src_pages: List[int] = field(default_factory=list)
    dst_pages: List[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.src_pages:
            self.src_pages, self.dst_pages = request_pages(self.n_pages)

    @property
    def n_pages(self) -> int:
        return -(-self.tokens // self.page_size)

    @property
    def p_pool_pages(self) -> int:
        return max(self.src_pages) + 2

    @property
    def d_pool_pages(self) -> int:
        return max(self.dst_pages) + 2

    @property
    def num_features(self) -> int:
        return len(self.target_layer_ids)

    @property
    def draft_dir(self) -> str:
        return os.path.join(self.workdir, "draft")

    def path(self, name: str) -> str:
        return os.path.join(self.workdir, name)

    def save(self) -> str:
        path = self.path(SPEC_FILE)
        with open(path, "w") as f:
            json.dump(asdict(self), f, indent=1)
        return path

    @classmethod
    def load(cls, path: str) -> "PreflightSpec":
        with open(path) as f:
            return cls(**json.load(f))

    # -- tensors (torch imported here only) ------------------------------------------------

    def torch_dtype(self, name: str):
        import torch

        return {"bfloat16": torch.bfloat16, "float32": torch.float32}[name]

    def capture(self, feature: int):
        """The target's output at layer ``target_layer_ids[feature]``: ``[tokens, hidden]``."""
        import torch

        g = torch.Generator().manual_seed(1_000_003 * (self.seed + 1) + 7919 * feature)
        x = torch.randn(self.tokens, self.hidden, generator=g) * (1.0 + 0.5 * feature)
        return x.to(self.torch_dtype(self.dtype))

    def captures(self, features) -> "object":
        """The features' captures side by side, as a stage's capture relay holds them."""
        import torch

        return torch.cat([self.capture(j) for j in features], dim=-1)

    def cache_locs(self):
        """Pool slot of every token: row ``t % S`` of page ``src_pages[t // S]``."""
        import torch

        t = torch.arange(self.tokens)
        pages = torch.tensor(self.src_pages, dtype=torch.int64)
        return pages[t // self.page_size] * self.page_size + t % self.page_size


def request_pages(n: int):
    """Source and destination pages of the request: each side has one break at a different
    place, so page runs on both sides and destination-only runs are exercised."""
    if n == 1:
        return [1], [2]
    a, b = max(1, n // 2), max(1, n // 3)
    src = list(range(1, 1 + a)) + list(range(a + 4, a + 4 + n - a))
    dst = list(range(2, 2 + b)) + list(range(b + 7, b + 7 + n - b))
    return src, dst


def scaled_draft_config(example_draft: dict, spec: PreflightSpec) -> dict:
    """The example draft's config with the scaled shapes: same architecture, model type, layer
    types and ``dflash_config``, the preflight's hidden size, heads, head_dim and layers."""
    cfg = json.loads(json.dumps(example_draft))
    cfg.update(
        vocab_size=512,
        hidden_size=spec.hidden,
        intermediate_size=2 * spec.hidden,
        num_hidden_layers=spec.draft_layers,
        num_attention_heads=2 * spec.draft_heads,
        num_key_value_heads=spec.draft_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=max(4096, spec.tokens),
        num_target_layers=spec.num_layers,
        torch_dtype=spec.dtype,
    )
    if isinstance(cfg.get("layer_types"), list) and cfg["layer_types"]:
        cfg["layer_types"] = [cfg["layer_types"][0]] * spec.draft_layers
    dflash = dict(cfg.get("dflash_config") or {})
    dflash["target_layer_ids"] = list(spec.target_layer_ids)
    if "mask_token_id" in dflash:
        dflash["mask_token_id"] = cfg["vocab_size"] - 1
    cfg["dflash_config"] = dflash
    return cfg
