"""The last PP stage's KV-write-only draft (``kv_write_draft``) and dummy draft weights on every
stage (``dummy_draft_weights``).

Real parts: the draft is built and loaded by sglang's own model loaders (``DefaultModelLoader``
from a safetensors checkpoint written here under the HF names, ``DummyModelLoader`` for
``--load-format dummy``), the draft KV is written by the stock ``DFlashWorkerV2`` forward into a
CPU ``MHATokenToKVPool`` (``pp_worker_harness``), and non-last stages are the real
``PPDFlashWorkerV2.__init__``. The oracles are the checkpoint tensors themselves and the full
(stock-built) draft.
"""

from __future__ import annotations

import os

import pytest
import torch

import pp_worker_harness as H
import tiny_models
from sglang_dflash_pp.srt.models.draft_weight_bytes import last_stage_draft_weight_bytes
from sglang_dflash_pp.srt.models.kv_write_draft import (
    kv_write_only,
    kv_write_only_build,
    stage_fc_block,
)
from sglang_dflash_pp.srt.speculative.pp_stage_carry import PARTIAL_KEY, StageCarry

HID, HEADS, KV, HD, INTER, LAYERS, K = H.HIDDEN, 4, H.KV_HEADS, H.HEAD_DIM, 2 * H.HIDDEN, 2, 4
# PP2 over 8 target layers: stage 0 captures feature 0, the last stage features 1, 2, 3.
LAST = (1, 2, 3)


def _cols(features):
    return slice(features[0] * HID, (features[-1] + 1) * HID)


def write_checkpoint(path, dtype, seed=0, fused_qkv=False):
    """A DFlash draft checkpoint under the names the HF export uses (separate q/k/v, gate/up)."""
    from safetensors.torch import save_file

    tiny_models.write_model_dir(path, H.draft_config())
    g = torch.Generator().manual_seed(seed)

    def r(*shape, offset=0.0):
        return (torch.randn(*shape, generator=g) * 0.2 + offset).to(dtype)

    t = {"fc.weight": r(HID, K * HID), "hidden_norm.weight": r(HID, offset=1), "norm.weight": r(HID, offset=1)}
    for i in range(LAYERS):
        p = f"layers.{i}."
        t[p + "input_layernorm.weight"] = r(HID, offset=1)
        t[p + "post_attention_layernorm.weight"] = r(HID, offset=1)
        q, k, v = r(HEADS * HD, HID), r(KV * HD, HID), r(KV * HD, HID)
        if fused_qkv:
            t[p + "self_attn.qkv_proj.weight"] = torch.cat([q, k, v])
        else:
            t[p + "self_attn.q_proj.weight"], t[p + "self_attn.k_proj.weight"] = q, k
            t[p + "self_attn.v_proj.weight"] = v
        t[p + "self_attn.o_proj.weight"] = r(HID, HEADS * HD)
        t[p + "self_attn.q_norm.weight"] = r(HD, offset=1)
        t[p + "self_attn.k_norm.weight"] = r(HD, offset=1)
        t[p + "mlp.gate_proj.weight"], t[p + "mlp.up_proj.weight"] = r(INTER, HID), r(INTER, HID)
        t[p + "mlp.down_proj.weight"] = r(HID, INTER)
    save_file(t, os.path.join(path, "model.safetensors"))
    return t


def load_draft(path, load_format="auto", features=None, dtype="auto"):
    """The draft as a server's draft runner loads it: sglang's loader for ``load_format``, inside
    the last stage's KV-write-only build when ``features`` is given."""
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import get_model_loader

    model_config = ModelConfig(path, trust_remote_code=True, is_draft_model=True, dtype=dtype)
    loader = get_model_loader(LoadConfig(load_format=load_format))
    load = lambda: loader.load_model(model_config=model_config, device_config=DeviceConfig("cpu"))  # noqa: E731
    if features is None:
        return load()
    with kv_write_only_build(features):
        return load()


def param_bytes(model):
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.fixture(scope="module")
def checkpoint(single_process_dist, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("kvw_draft"))
    return path, write_checkpoint(path, torch.bfloat16)


# -- what the pruned draft holds ---------------------------------------------------------------


def test_pruned_draft_holds_only_what_the_kv_write_needs(checkpoint):
    path, ckpt = checkpoint
    pruned = load_draft(path, features=LAST)
    assert kv_write_only(pruned).features == LAST
    names = {n for n, _ in pruned.named_parameters()}
    per_layer = ["input_layernorm", "post_attention_layernorm", "self_attn.qkv_proj", "self_attn.q_norm", "self_attn.k_norm"]
    assert names == {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
        f"layers.{i}.{m}.weight" for i in range(LAYERS) for m in per_layer
    }
    for i, layer in enumerate(pruned.layers):
        assert layer.mlp is None and layer.self_attn.o_proj is None and layer.self_attn.q_size == 0
        kv = torch.cat([ckpt[f"layers.{i}.self_attn.k_proj.weight"], ckpt[f"layers.{i}.self_attn.v_proj.weight"]])
        assert torch.equal(layer.self_attn.qkv_proj.weight, kv)
        assert torch.equal(layer.self_attn.k_norm.weight, ckpt[f"layers.{i}.self_attn.k_norm.weight"])
    assert torch.equal(pruned.fc.weight, ckpt["fc.weight"][:, _cols(LAST)])
    assert torch.equal(stage_fc_block(pruned, LAST, HID), pruned.fc.weight)
    with pytest.raises(RuntimeError, match=r"holds fc blocks \[1, 2, 3\], but the stage projects features \[3\]"):
        stage_fc_block(pruned, (3,), HID)
    with pytest.raises(RuntimeError, match="projects through the PP context stash"):
        pruned.project_target_hidden(torch.zeros(2, 3 * HID, dtype=torch.bfloat16))

    # The memory figure check reports, against the real parameter bytes of both builds.
    full = load_draft(path)
    figure = last_stage_draft_weight_bytes(H.draft_config(), tp_size=1, num_features=K, last_stage_features=3)
    assert figure.stock == param_bytes(full)
    assert figure.kv_write_only == param_bytes(pruned)


def test_a_fused_qkv_checkpoint_loads_its_kv_rows(single_process_dist, checkpoint, tmp_path):
    path, _ = checkpoint
    fused = str(tmp_path / "fused")
    write_checkpoint(fused, torch.bfloat16, fused_qkv=True)
    a, b = load_draft(path, features=LAST), load_draft(fused, features=LAST)
    for la, lb in zip(a.layers, b.layers):
        assert torch.equal(la.self_attn.qkv_proj.weight, lb.self_attn.qkv_proj.weight)


def test_the_memory_figure_at_kimi_k3_size():
    """K2.5-DFlash shapes under TP4, one fc block on the last stage: the issue's ~2.2 GB stock
    against ~0.15 GB, by its own arithmetic (q/o/kv/MLP/fc terms written out here)."""
    cfg = dict(hidden_size=7168, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
               intermediate_size=18432, num_hidden_layers=6, torch_dtype="bfloat16")
    b = last_stage_draft_weight_bytes(cfg, tp_size=4, num_features=6, last_stage_features=1)
    h = 7168
    layer_q_o = 2 * 16 * 128 * h
    layer_kv = 2 * 2 * 128 * h
    layer_mlp = 3 * 4608 * h
    norms = 6 * (2 * h + 2 * 128) + 2 * h
    assert b.stock == 2 * (6 * h * h + norms + 6 * (layer_q_o + layer_kv + layer_mlp))
    assert b.kv_write_only == 2 * (h * h + norms + 6 * layer_kv)
    assert 2.1e9 < b.stock < 2.3e9 and 0.14e9 < b.kv_write_only < 0.16e9
    # Fewer K/V heads than TP ranks: each rank holds one replicated head.
    b8 = last_stage_draft_weight_bytes({**cfg, "num_key_value_heads": 2}, tp_size=4, num_features=6, last_stage_features=1)
    assert b8.kv_write_only == 2 * (h * h + norms + 6 * 2 * 1 * 128 * h)


def test_the_memory_figure_is_the_parameter_bytes_of_a_tp2_draft(tmp_path):
    """Two gloo processes, one TP2 group: each rank's stock and KV-write-only draft, built by
    sglang's loader, holds the bytes the figure says, with K/V heads sharded (2 over 2 ranks) and
    replicated (1 head on both); and each rank's pruned K/V rows are its stock draft's."""
    import json

    from gloo_pair import run_pair

    run_pair("tp2_gloo_draft_bytes.py", tmp_path)
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for kv_heads in (2, 1):
            cfg = {**H.draft_config(), "num_key_value_heads": kv_heads}
            figure = last_stage_draft_weight_bytes(cfg, tp_size=2, num_features=K, last_stage_features=3)
            row = got[str(kv_heads)]
            assert (row["stock"], row["kv_write_only"]) == (figure.stock, figure.kv_write_only)
            assert row["kv_rows_match"], (rank, kv_heads)


# -- the draft KV it writes --------------------------------------------------------------------


def _write_kv(model, features, chunk, inbound, dtype):
    pool, translator = H.draft_pool(dtype)
    target = H.CapturingTarget(features, is_last=True, dtype=dtype, translator=translator)
    carry = StageCarry(1, 2, tuple(features), HID, receives=True, sends=False)
    worker = H.last_stage_worker(model, carry, target, pool, translator)
    worker._w_stage = stage_fc_block(model, features, HID)  # what PPDFlashWorkerV2.__init__ sets
    target.chunk = chunk
    rows = chunk.num_tokens + chunk.padding_rows
    worker.forward_batch_generation(
        chunk.schedule_batch(),
        pp_proxy_tensors=_proxy({"hidden_states": torch.zeros(rows, HID, dtype=dtype), PARTIAL_KEY: inbound}),
    )
    return H.pool_image(pool)


def _proxy(tensors):
    from sglang.srt.model_executor.forward_batch_info import PPProxyTensors

    return PPProxyTensors(tensors)


CHUNK = H.Chunk([(0, 0, 9), (1, 3, 10)], torch.arange(40, 56), padding_rows=2)


def test_pruned_draft_writes_the_full_drafts_draft_kv_bit_for_bit(checkpoint):
    path, ckpt = checkpoint
    full, pruned = load_draft(path), load_draft(path, features=LAST)
    inbound = torch.nn.functional.linear(
        CHUNK.captures((0,), torch.bfloat16).float(), ckpt["fc.weight"][:, _cols((0,))].float()
    )
    written = _write_kv(pruned, LAST, CHUNK, inbound, torch.bfloat16)
    reference = _write_kv(full, LAST, CHUNK, inbound, torch.bfloat16)
    assert written[..., CHUNK.out_cache_loc, :, :].abs().sum(dim=(0, 1, 3, 4)).gt(0).all()
    assert torch.equal(written, reference)


# -- inert everywhere else ---------------------------------------------------------------------


def test_hooks_are_inert_outside_the_last_stage_build(checkpoint):
    from sglang.srt.model_loader import loader, weight_utils

    path, ckpt = checkpoint
    full = load_draft(path)
    assert kv_write_only(full) is None
    shapes = {n: tuple(p.shape) for n, p in full.named_parameters()}
    assert shapes["fc.weight"] == (HID, K * HID)
    assert shapes["layers.0.self_attn.qkv_proj.weight"] == ((HEADS + 2 * KV) * HD, HID)
    assert shapes["layers.0.self_attn.o_proj.weight"] == (HID, HEADS * HD)
    assert shapes["layers.0.mlp.gate_up_proj.weight"] == (2 * INTER, HID)
    assert shapes["layers.0.mlp.down_proj.weight"] == (HID, INTER)
    assert full.layers[0].self_attn.q_size == HEADS * HD
    qkv = full.layers[1].self_attn.qkv_proj.weight
    assert torch.equal(qkv, torch.cat([ckpt[f"layers.1.self_attn.{x}_proj.weight"] for x in "qkv"]))
    assert torch.equal(full.fc.weight, ckpt["fc.weight"])
    # The hooked dummy initialiser (the loader's binding too) leaves a stock model as stock.
    hooked = weight_utils.initialize_dummy_weights
    assert loader.initialize_dummy_weights is hooked and hooked.__wrapped__ is not hooked
    a, b = load_draft(path), load_draft(path)
    hooked(a)
    hooked.__wrapped__(b)
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb and torch.equal(pa, pb), na


def test_only_the_last_stage_of_a_pp_prefill_builds_it_pruned(checkpoint, monkeypatch):
    """PPDFlashWorkerV2 on the last stage enters the build around the stock ``__init__`` with its
    own features. Test-side stand-in: the stock ``DFlashWorkerV2.__init__`` (it builds a draft
    runner with GPU pools) is replaced by one that loads the draft with sglang's loader, as the
    stock draft runner would inside it. Decode servers and PP1 get the stock worker class
    (``test_dflash_pp_worker.test_create_worker_picks_ours_only_for_dflash_pp_prefill``), which
    never enters the build."""
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    from sglang_dflash_pp.srt.speculative import dflash_pp_worker

    path, _ = checkpoint

    def stock_init(self, server_args, gpu_id, nccl_port, target_worker):
        self.draft_model = load_draft(path)

    monkeypatch.setattr(DFlashWorkerV2, "__init__", stock_init)
    monkeypatch.setattr(dflash_pp_worker, "get_pp_stage_load_group", lambda: None)
    target = H.CapturingTarget(LAST, is_last=True, dtype=torch.bfloat16)
    with H.pp_stage(0, 2, path):
        H.non_last_stage_worker(target, path)  # the target stand-in's model_runner
    target.random_seed = 7
    with H.pp_stage(1, 2, path):
        worker = dflash_pp_worker.PPDFlashWorkerV2(None, 0, 0, target)
    assert kv_write_only(worker.draft_model).features == LAST
    assert worker._w_stage is worker.draft_model.fc.weight
    assert kv_write_only(load_draft(path)) is None  # the build ended with the worker's __init__


# -- dummy weights -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def config_only_draft(single_process_dist, tmp_path_factory):
    """What an operator benchmarks with before the weights are there: config.json only."""
    path = str(tmp_path_factory.mktemp("config_only_draft"))
    tiny_models.write_model_dir(path, H.draft_config())
    return path


def test_dummy_pruned_draft_and_stage_blocks_are_slices_of_the_full_dummy_draft(config_only_draft):
    from sglang_dflash_pp.srt.models.dummy_draft_weights import dummy_fc_column_blocks

    full = load_draft(config_only_draft, "dummy")
    pruned = load_draft(config_only_draft, "dummy", features=LAST)
    assert torch.equal(pruned.fc.weight, full.fc.weight[:, _cols(LAST)])
    for lp, lf in zip(pruned.layers, full.layers):
        assert torch.equal(lp.self_attn.qkv_proj.weight, lf.self_attn.qkv_proj.weight[HEADS * HD :])
        assert torch.equal(lp.self_attn.k_norm.weight, lf.self_attn.k_norm.weight)
    block = dummy_fc_column_blocks((0,), HID, K, dtype=torch.bfloat16, device="cpu")
    assert torch.equal(block, full.fc.weight[:, _cols((0,))])
    # Each transient holds the full draft's parameter name (an initialiser may seed by name).
    from sglang_dflash_pp.srt.models.dummy_draft_weights import dummy_full_parameter

    seen = []
    record = lambda m: seen.extend(n for n, _ in m.named_parameters())  # noqa: E731
    dummy_full_parameter("layers.1.self_attn.qkv_proj.weight", (2, 3), torch.float32, "cpu", record)
    assert seen == ["layers.1.self_attn.qkv_proj.weight"]
    # Non-trivial: the values depend on the shape, so the block is not the block-shaped draw.
    assert not torch.equal(pruned.fc.weight, load_draft(config_only_draft, "dummy", features=(0, 1, 2)).fc.weight)


def _dummy_stage0_partial(path, chunk, overrides, dtype):
    from sglang.srt.runtime_context import get_model, get_spec

    target = H.CapturingTarget((0,), is_last=False, dtype=dtype)
    model_format, draft_format = overrides
    with H.pp_stage(0, 2, path), get_model().override(load_format=model_format), get_spec().override(
        speculative_draft_load_format=draft_format
    ):
        worker = H.non_last_stage_worker(target, path, dtype=dtype, draft_dtype="float32")
    target.chunk = chunk
    out = worker.forward_batch_generation(chunk.schedule_batch())
    return out.pp_hidden_states_proxy_tensors.tensors[PARTIAL_KEY]


@pytest.mark.parametrize(
    "overrides", [("dummy", None), ("auto", "dummy")], ids=["load-format", "draft-load-format"]
)
def test_dummy_weight_pp2_writes_the_pp1_draft_kv(config_only_draft, overrides):
    """PP2 with dummy weights: stage 0 (real ``__init__``, config-only draft directory) projects
    its feature with its dummy fc block, the last stage writes with its KV-write-only dummy draft;
    PP1 is the full dummy draft on the stock forward over all four features."""
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    dtype = torch.float32
    partial = _dummy_stage0_partial(config_only_draft, CHUNK, overrides, dtype)
    pruned = load_draft(config_only_draft, "dummy", features=LAST, dtype="float32")
    written = _write_kv(pruned, LAST, CHUNK, partial, dtype)

    full = load_draft(config_only_draft, "dummy", dtype="float32")
    pool, translator = H.draft_pool(dtype)
    target = H.CapturingTarget((0, 1, 2, 3), is_last=True, dtype=dtype, translator=translator)
    carry = StageCarry(0, 1, (0, 1, 2, 3), HID, receives=False, sends=False)
    ref = H.last_stage_worker(full, carry, target, pool, translator)
    target.chunk = CHUNK
    DFlashWorkerV2.forward_batch_generation(ref, CHUNK.schedule_batch())
    reference = H.pool_image(pool)

    touched = written[..., CHUNK.out_cache_loc, :, :]
    assert touched.abs().sum(dim=(0, 1, 3, 4)).gt(0).all()
    scale = written.abs().max()
    assert (written - reference).abs().max() <= 1e-5 * scale


def test_a_config_only_draft_without_dummy_is_refused_at_startup(config_only_draft):
    from sglang_dflash_pp.srt.models.dflash_fc_columns import DraftCheckpointError

    target = H.CapturingTarget((0,), is_last=False, dtype=torch.float32)
    with H.pp_stage(0, 2, config_only_draft), pytest.raises(DraftCheckpointError, match="has no fc weight"):
        H.non_last_stage_worker(target, config_only_draft)
