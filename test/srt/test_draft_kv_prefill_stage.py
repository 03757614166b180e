"""``PrefillBootstrapQueue._init_kv_manager`` with our hook: draft entries on the last PP stage only,
and the DFLASH draft geometry recorded for the transfer layer before the KV manager starts.

The PP tests run sglang's real ``_init_kv_manager`` (real pools on CPU, the FAKE transfer
backend's manager) on a queue shell, so the transfer entries are the ones sglang itself lists.
"""

from __future__ import annotations

import types

import pytest
import torch

from sglang_dflash_pp.srt.disaggregation import draft_kv_source, prefill_draft_kv


def mha_pool(heads: int, layers: int, head_dim: int = 32):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return MHATokenToKVPool(
        size=256,
        page_size=64,
        dtype=torch.bfloat16,
        head_num=heads,
        head_dim=head_dim,
        layer_num=layers,
        device="cpu",
        enable_memory_saver=False,
    )


def queue_shell(
    *, pp_rank: int, pp_size: int, draft_pool, backend="FAKE", algorithm="DFLASH", draft_heads=4
):
    """A PrefillBootstrapQueue with what ``_init_kv_manager`` reads, and no server around it."""
    from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue
    from sglang.srt.disaggregation.utils import TransferBackend
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    q = object.__new__(PrefillBootstrapQueue)
    q.token_to_kv_pool = mha_pool(2, 4)
    q.draft_token_to_kv_pool = draft_pool
    q.pp_rank, q.pp_size, q.tp_rank = pp_rank, pp_size, 0
    q.is_mla_backend = False
    q.transfer_backend = TransferBackend[backend]
    q.metadata_buffers = types.SimpleNamespace(get_buf_infos=lambda: ([], [], []))
    runner = types.SimpleNamespace(
        token_to_kv_pool=draft_pool,
        model_config=types.SimpleNamespace(get_total_num_kv_heads=lambda: draft_heads),
    )
    q.scheduler = types.SimpleNamespace(
        rust_server=None,
        server_args=None,
        spec_algorithm=SpeculativeAlgorithm.from_string(algorithm),
        draft_worker=types.SimpleNamespace(weight_update_runners=lambda: [("draft", runner)]),
        tp_worker=types.SimpleNamespace(
            model_runner=types.SimpleNamespace(kv_cache_dtype_str="auto")
        ),
        model_config=types.SimpleNamespace(
            num_hidden_layers=4,
            hf_text_config=types.SimpleNamespace(),
            get_total_num_kv_heads=lambda: 2,
        ),
    )
    return q


@pytest.fixture
def init_kv_manager(dflash_runtime_config):
    from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue
    from sglang.srt.runtime_context import get_parallel

    def run(q):
        with get_parallel().override(dp_rank=None):
            return PrefillBootstrapQueue._init_kv_manager(q)

    return run


@pytest.mark.parametrize(
    "pp_rank, pp_size, draft_entries", [(0, 1, 4), (0, 4, 0), (2, 4, 0), (3, 4, 4)]
)
def test_only_the_last_pp_stage_registers_draft_entries(
    init_kv_manager, pp_rank, pp_size, draft_entries
):
    draft = mha_pool(2, 2)
    q = queue_shell(pp_rank=pp_rank, pp_size=pp_size, draft_pool=draft)
    kv_args = init_kv_manager(q).kv_args
    target_ptrs = q.token_to_kv_pool.get_contiguous_buf_infos()[0]
    draft_ptrs = draft.get_contiguous_buf_infos()[0]
    assert kv_args.num_draft_entries == draft_entries
    assert kv_args.kv_data_ptrs == target_ptrs + (draft_ptrs if draft_entries else [])
    assert q.draft_token_to_kv_pool is draft  # the queue keeps its pool; only the listing changed


@pytest.fixture
def attention_tp(dflash_runtime_config, monkeypatch):
    """This process as attention-TP rank ``rank`` of ``size`` (what the prefill's startup reads
    through ``prefill_draft_kv.attention_tp``), with a published ``--chunked-prefill-size``."""
    import contextlib

    from sglang.srt.runtime_context import get_context

    @contextlib.contextmanager
    def run(size: int, rank: int, chunked_prefill_size: int = 256):
        override = get_context().override_server_args(
            speculative_algorithm="DFLASH", chunked_prefill_size=chunked_prefill_size
        )
        override.install()
        monkeypatch.setattr(prefill_draft_kv, "attention_tp", lambda: (size, rank))
        try:
            yield
        finally:
            override.restore()

    return run


def _startup_source(q, draft):
    """Run the hook; return the draft source the bootstrap thread would see inside the
    original (a decode can register as soon as the KV manager exists)."""
    seen = {}

    def original(self):
        ptrs = draft.get_contiguous_buf_infos()[0]
        kv_args = types.SimpleNamespace(kv_data_ptrs=[1, 2] + ptrs, num_draft_entries=len(ptrs))
        seen["source"] = draft_kv_source.draft_kv_source_for(kv_args)
        return "manager"

    assert prefill_draft_kv.init_kv_manager_around(original, q) == "manager"
    return seen["source"]


def test_dflash_mooncake_prefill_records_the_draft_geometry(attention_tp):
    draft = mha_pool(heads=1, layers=3, head_dim=64)
    q = queue_shell(pp_rank=0, pp_size=1, draft_pool=draft, backend="MOONCAKE", draft_heads=8)
    with attention_tp(8, 3):
        source = _startup_source(q, draft)
    assert source.staging is None  # one head per rank: no decode holds fewer, nothing to pack
    assert source is not None and source.shape_unknown_reason is None
    assert (
        source.shape.total_heads,
        source.shape.k_head_dim,
        source.shape.v_head_dim,
        source.shape.dtype_bytes,
    ) == (8, 64, 64, 2)
    rows = source.entry_rows(4)  # V of layer 1
    assert rows.dtype == torch.uint8 and rows.shape == (320, 64 * 2)
    assert rows.data_ptr() == draft.v_buffer[1].data_ptr()


@pytest.mark.parametrize("algorithm, backend", [("EAGLE", "MOONCAKE"), ("DFLASH", "NIXL")])
def test_other_algorithms_and_backends_record_nothing(sglang_with_plugin, algorithm, backend):
    draft = mha_pool(heads=1, layers=2)
    q = queue_shell(pp_rank=0, pp_size=1, draft_pool=draft, backend=backend, algorithm=algorithm)
    calls = []
    prefill_draft_kv.init_kv_manager_around(
        lambda self: calls.append(self.draft_token_to_kv_pool), q
    )
    assert calls == [draft]
    kv_args = types.SimpleNamespace(
        kv_data_ptrs=draft.get_contiguous_buf_infos()[0], num_draft_entries=4
    )
    assert draft_kv_source.draft_kv_source_for(kv_args) is None


def test_refuses_to_start_without_the_transfer_hooks(sglang_with_plugin, monkeypatch):
    q = queue_shell(pp_rank=0, pp_size=1, draft_pool=mha_pool(1, 2), backend="MOONCAKE")
    from sglang_dflash_pp import hooks

    monkeypatch.setattr(
        hooks, "is_applied", lambda hook: not hook.target.endswith(".send_kvcache")
    )
    with pytest.raises(RuntimeError) as info:
        prefill_draft_kv.init_kv_manager_around(lambda self: pytest.fail("started anyway"), q)
    message = str(info.value)
    assert (
        "AROUND sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager.send_kvcache" in message
    )
    assert "_validate_peer_state_layout" not in message


def test_refuses_to_start_with_a_bad_environment(sglang_with_plugin, monkeypatch):
    q = queue_shell(pp_rank=0, pp_size=1, draft_pool=mha_pool(1, 2), backend="MOONCAKE")
    monkeypatch.setenv("SGLANG_DFLASH_DRAFT_KV_PACK_BUFFER_MB", "0")
    with pytest.raises(
        ValueError, match="SGLANG_DFLASH_DRAFT_KV_PACK_BUFFER_MB=0 must be at least 1"
    ):
        prefill_draft_kv.init_kv_manager_around(lambda self: pytest.fail("started anyway"), q)


def test_a_pool_it_cannot_read_is_described_with_the_reason(sglang_with_plugin):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    class OtherLayoutPool(MHATokenToKVPool):
        pass

    pool = OtherLayoutPool(
        size=128,
        page_size=64,
        dtype=torch.bfloat16,
        head_num=1,
        head_dim=32,
        layer_num=1,
        device="cpu",
        enable_memory_saver=False,
    )
    source = draft_kv_source.describe_draft_pool(pool, 8)
    assert source.shape is None
    assert (
        source.shape_unknown_reason
        == "the draft KV pool is a OtherLayoutPool, not a plain MHATokenToKVPool"
    )


def test_hooks_are_registered_and_applied(sglang_with_plugin):
    from sglang_dflash_pp.hooks import is_applied, registered_hooks
    from sglang_dflash_pp.srt.disaggregation import mooncake_draft_kv

    ours = list(prefill_draft_kv.HOOKS) + list(mooncake_draft_kv.HOOKS)
    registered = {(h.target, h.hook) for h in registered_hooks()}
    for hook in ours:
        assert (hook.target, hook.hook) in registered and is_applied(hook), hook.name


def test_the_pack_staging_is_built_and_warmed_at_startup(attention_tp, monkeypatch):
    """A rank with 2 draft heads (8 over attention TP4): the staging exists before the KV
    manager does, sized from the chunk (256 tokens + one page, 4 pages of 64 -> 5 pages), one
    slot per transfer queue, every pack it can be asked for prepared and run once."""
    monkeypatch.setenv("SGLANG_DISAGGREGATION_QUEUE_SIZE", "3")
    draft = mha_pool(heads=2, layers=3, head_dim=64)
    q = queue_shell(pp_rank=0, pp_size=1, draft_pool=draft, backend="MOONCAKE", draft_heads=8)
    with attention_tp(4, 1, chunked_prefill_size=256):
        source = _startup_source(q, draft)
    staging = source.staging
    row_bytes = 2 * 3 * 2 * 64 * 2  # K and V, 3 layers, 2 heads, head dim 64, bf16
    assert staging.size.chunk_slot_bytes == 5 * 64 * row_bytes
    assert staging.buffer.slot_bytes == staging.size.chunk_slot_bytes and staging.size.num_slots == 3
    assert staging.buffer.free_slots() == 3 and staging.buffer.device == torch.device("cpu")
    (partition,) = set(staging.prepared.partitions.values())
    assert [s.heads for s in partition] == [range(2, 3), range(3, 4)]  # rank 1 holds heads 2-3
    assert staging.warmed == 3  # both heads at once, and each alone


def test_a_pack_staging_that_cannot_be_allocated_stops_the_server(attention_tp, monkeypatch):
    from sglang_dflash_pp.srt.disaggregation import draft_kv_staging

    def no_memory(*args, **kwargs):
        raise RuntimeError("CUDA out of memory. Tried to allocate 48.00 MiB")

    monkeypatch.setattr(draft_kv_staging, "PackStagingBuffer", no_memory)
    draft = mha_pool(heads=2, layers=3, head_dim=64)
    q = queue_shell(pp_rank=0, pp_size=1, draft_pool=draft, backend="MOONCAKE", draft_heads=8)
    with attention_tp(4, 1), pytest.raises(RuntimeError) as info:
        prefill_draft_kv.init_kv_manager_around(lambda self: pytest.fail("started anyway"), q)
    assert "pack staging could not be set up" in str(info.value)
    assert "SGLANG_DFLASH_DRAFT_KV_PACK_BUFFER_MB" in str(info.value)


def test_a_staging_too_small_for_a_chunk_is_warned_about_at_startup(attention_tp, monkeypatch,
                                                                     caplog):
    """SGLANG_DFLASH_DRAFT_KV_PACK_BUFFER_MB below one chunk's head slices still serves (slices
    packed one at a time, or per decode rank in page windows) but says so before serving."""
    import logging

    monkeypatch.setenv("SGLANG_DISAGGREGATION_QUEUE_SIZE", "2")
    monkeypatch.setenv("SGLANG_DFLASH_DRAFT_KV_PACK_BUFFER_MB", "1")
    draft = mha_pool(heads=2, layers=3, head_dim=64)
    q = queue_shell(pp_rank=0, pp_size=1, draft_pool=draft, backend="MOONCAKE", draft_heads=8)
    with attention_tp(4, 1, chunked_prefill_size=1024), caplog.at_level(logging.WARNING):
        source = _startup_source(q, draft)
    size = source.staging.size
    assert (size.slot_bytes, size.num_slots) == (1 << 19, 2)
    assert size.chunk_slot_bytes == 17 * 64 * 2 * 3 * 2 * 64 * 2 > size.slot_bytes
    (warning,) = [r.getMessage() for r in caplog.records if "PACK_BUFFER_MB" in r.getMessage()]
    assert "1024-token chunk" in warning and "packed in several steps" in warning
