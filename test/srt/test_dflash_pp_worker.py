"""PPDFlashWorkerV2 per stage: proxy keys and shapes, idle and empty batches, the stash, the draft
KV it writes, worker selection and the scheduler relay. See ``pp_worker_harness`` for what is real
(draft model, stock forward path, CPU KV pool, PPProxyTensors, ownership, checkpoint columns) and
what stands in (the target forward, the last stage's draft-runner construction)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import pp_worker_harness as H
from sglang_dflash_pp.srt.models.dflash import stashed
from sglang_dflash_pp.srt.speculative.pp_stage_carry import (
    CAPTURE_KEY,
    PARTIAL_KEY,
    CarryProtocolError,
    StageCarry,
)


@pytest.fixture(scope="module")
def draft(single_process_dist, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("pp_draft"))
    return path, H.build_draft_model(path, torch.float32)


def _proxy(tensors):
    from sglang.srt.model_executor.forward_batch_info import PPProxyTensors

    return PPProxyTensors(tensors)


def _reference_partial(model, chunk, features):
    local = chunk.captures(features, torch.float32)
    w = model.fc.weight[:, features[0] * H.HIDDEN : (features[-1] + 1) * H.HIDDEN]
    return torch.nn.functional.linear(local.float(), w.float())


# -- non-last stages: the real __init__ and forward ------------------------------------------


@pytest.mark.parametrize("rows", [7, 0], ids=["batch", "empty"])
def test_first_stage_replaces_raw_capture_with_the_partial(draft, rows):
    path, model = draft
    target = H.CapturingTarget((0,), is_last=False, dtype=torch.float32)
    with H.pp_stage(0, 2, path):
        worker = H.non_last_stage_worker(target, path, dtype=torch.float32)
        # Stage 0 of PP2 over 8 layers ([0, 4)) captures layer 1 (read at layer 2).
        assert worker._carry == StageCarry(0, 2, (0,), H.HIDDEN, receives=False, sends=True)
        assert worker.draft_worker is None and worker.primary_draft_kv_pool is None
        assert worker.weight_update_runners() == []
        assert worker.prewarm_sampling() == "target-prewarm"
        target.chunk = H.Chunk([(0, 0, rows)], torch.arange(rows))
        published = []
        out = worker.forward_batch_generation(
            target.chunk.schedule_batch(), on_publish=published.append
        )
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

    assert target.calls[-1]["capture_hidden_mode"] == CaptureHiddenMode.FULL
    tensors = out.pp_hidden_states_proxy_tensors.tensors
    assert set(tensors) == {"hidden_states", PARTIAL_KEY}
    assert CAPTURE_KEY not in tensors
    assert tensors[PARTIAL_KEY].shape == (rows, H.HIDDEN)
    assert tensors[PARTIAL_KEY].dtype == torch.float32
    assert torch.allclose(tensors[PARTIAL_KEY], _reference_partial(model, target.chunk, [0]))
    assert len(published) == 1 and torch.equal(published[0], out.new_seq_lens)


def test_fc_columns_on_a_non_last_stage_come_from_the_checkpoint(draft):
    path, model = draft
    with H.pp_stage(1, 4, path):
        # PP4 over 8 layers: stage 1 holds [2, 4), where layer 1's output is read (at layer 2).
        worker = H.non_last_stage_worker(H.CapturingTarget((0,), False, torch.float32), path, torch.float32)
    assert worker._carry.features == (0,)
    assert torch.equal(worker._w_stage, model.fc.weight[:, : H.HIDDEN])


@pytest.mark.parametrize("carry_dtype", ["float32", "bfloat16"])
def test_middle_stage_adds_its_features_to_the_inbound_partial(draft, monkeypatch, carry_dtype):
    path, model = draft
    monkeypatch.setenv("SGLANG_DFLASH_PP_CARRY_DTYPE", carry_dtype)
    dtype = getattr(torch, carry_dtype)
    # PP4 over 8 layers: [0,2) [2,4) [4,6) [6,8); layers 1,3,5,7 are read at 2,4,6,7.
    target = H.CapturingTarget((1,), is_last=False, dtype=torch.float32)
    with H.pp_stage(2, 4, path):
        worker = H.non_last_stage_worker(target, path, dtype=torch.float32)
        assert worker._carry == StageCarry(2, 4, (1,), H.HIDDEN, receives=True, sends=True)
        target.chunk = H.Chunk([(0, 3, 9), (1, 0, 4)], torch.arange(10))
        inbound = _reference_partial(model, target.chunk, [0]).to(dtype)
        out = worker.forward_batch_generation(
            target.chunk.schedule_batch(),
            pp_proxy_tensors=_proxy({"hidden_states": torch.zeros(10, H.HIDDEN), PARTIAL_KEY: inbound}),
        )
    partial = out.pp_hidden_states_proxy_tensors.tensors[PARTIAL_KEY]
    assert partial.dtype == dtype
    expected = (inbound.float() + _reference_partial(model, target.chunk, [1])).to(dtype)
    assert torch.allclose(partial.float(), expected.float(), rtol=1e-6, atol=1e-6)


def test_stage_without_features_before_any_owner_sends_no_key(draft):
    path, _ = draft
    from sglang_dflash_pp.srt.speculative.dflash_pp_worker import stage_ownership

    target = H.CapturingTarget((), is_last=False, dtype=torch.float32)
    with H.pp_stage(0, 8, path):
        worker = H.non_last_stage_worker(target, path, dtype=torch.float32)
        assert stage_ownership(target).stages[0].features == ()
        assert worker._carry.sends is False and worker._w_stage is None
        target.chunk = H.Chunk([(0, 0, 5)], torch.arange(5))
        out = worker.forward_batch_generation(target.chunk.schedule_batch())
    assert set(out.pp_hidden_states_proxy_tensors.tensors) == {"hidden_states"}


def test_stage_without_features_after_an_owner_forwards_the_partial(draft):
    path, _ = draft
    # PP8 over 8 layers: layer 1 is read at layer 2 (stage 2); stage 3 owns nothing.
    target = H.CapturingTarget((), is_last=False, dtype=torch.float32)
    with H.pp_stage(3, 8, path):
        worker = H.non_last_stage_worker(target, path, dtype=torch.float32)
        target.chunk = H.Chunk([(0, 0, 5)], torch.arange(5))
        inbound = torch.randn(5, H.HIDDEN)
        out = worker.forward_batch_generation(
            target.chunk.schedule_batch(),
            pp_proxy_tensors=_proxy({"hidden_states": torch.zeros(5, H.HIDDEN), PARTIAL_KEY: inbound}),
        )
    assert torch.equal(out.pp_hidden_states_proxy_tensors.tensors[PARTIAL_KEY], inbound)


def test_protocol_violations_are_named(draft):
    path, _ = draft
    target = H.CapturingTarget((), is_last=False, dtype=torch.float32)  # emits no capture
    with H.pp_stage(0, 2, path):
        worker = H.non_last_stage_worker(H.CapturingTarget((0,), False, torch.float32), path)
        worker._target_worker = target
        target.chunk = H.Chunk([(0, 0, 3)], torch.arange(3))
        with pytest.raises(CarryProtocolError, match="expected 'dspark_hidden_states' of width 64"):
            worker.forward_batch_generation(target.chunk.schedule_batch())
    with H.pp_stage(2, 4, path):
        worker = H.non_last_stage_worker(H.CapturingTarget((1,), False, torch.float32), path)
        worker._target_worker.chunk = H.Chunk([(0, 0, 3)], torch.arange(3))
        with pytest.raises(CarryProtocolError, match="expected 'dflash_ctx_partial' from stage 1"):
            worker.forward_batch_generation(
                worker._target_worker.chunk.schedule_batch(),
                pp_proxy_tensors=_proxy({"hidden_states": torch.zeros(3, H.HIDDEN)}),
            )


def test_stage_layers_must_match_the_partition(draft):
    path, _ = draft
    target = H.CapturingTarget((0,), is_last=False, dtype=torch.float32)
    with H.pp_stage(0, 2, path):
        H.non_last_stage_worker(target, path)  # sets target.model_runner
        target.model_runner.model = SimpleNamespace(start_layer=0, end_layer=3)
        from sglang_dflash_pp.srt.speculative.dflash_pp_worker import stage_ownership

        with pytest.raises(RuntimeError, match=r"holds target layers \[0, 3\) but the partition says \(0, 4\)"):
            stage_ownership(target)


# -- last stage: the stock forward with the partial stashed ------------------------------------


def _last_stage(model, pp_size=2, features=(1, 2, 3)):
    pool, translator = H.draft_pool(torch.float32)
    target = H.CapturingTarget(features, is_last=True, dtype=torch.float32, translator=translator)
    carry = StageCarry(pp_size - 1, pp_size, tuple(features), H.HIDDEN, receives=True, sends=False)
    return H.last_stage_worker(model, carry, target, pool, translator), target, pool


def _pp1_reference(model, chunks):
    """The stock PP1 path: the unmodified DFlashWorkerV2 forward on all four features."""
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    worker, target, pool = _last_stage(model, features=(0, 1, 2, 3))
    for chunk in chunks:
        target.chunk = chunk
        DFlashWorkerV2.forward_batch_generation(worker, chunk.schedule_batch())
    return pool


@pytest.mark.parametrize("padding_rows", [0, 3], ids=["exact", "padded"])
def test_last_stage_writes_the_draft_kv_of_the_pp1_path(draft, padding_rows):
    _, model = draft
    chunk = H.Chunk([(0, 0, 6), (1, 2, 7)], torch.tensor([40, 41, 42, 43, 44, 45, 90, 91, 92, 93, 94]), padding_rows)
    worker, target, pool = _last_stage(model)
    target.chunk = chunk
    inbound = torch.cat([_reference_partial(model, chunk, [0]), torch.full((padding_rows, H.HIDDEN), 1e4)])
    out = worker.forward_batch_generation(
        chunk.schedule_batch(),
        pp_proxy_tensors=_proxy({"hidden_states": torch.zeros(11 + padding_rows, H.HIDDEN), PARTIAL_KEY: inbound}),
    )
    assert stashed(model) is None
    from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2

    assert isinstance(out.next_draft_input, DFlashDraftInputV2)
    assert out.next_draft_input.bonus_tokens.tolist() == [100, 101]
    reference = H.pool_image(_pp1_reference(model, [chunk]))
    written = H.pool_image(pool)
    touched = chunk.out_cache_loc
    assert written[..., touched, :, :].abs().sum() > 0
    assert torch.allclose(written, reference, rtol=1e-5, atol=1e-5)
    untouched = torch.ones(H.POOL_SIZE + 1, dtype=torch.bool)
    untouched[touched] = False
    assert written[..., untouched, :, :].abs().sum() == 0  # padding rows never land


def test_stash_is_cleared_on_idle_batches_and_failures(draft):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    _, model = draft
    worker, target, _ = _last_stage(model)
    target.chunk = H.Chunk([], torch.zeros(0, dtype=torch.int64))
    idle = target.chunk.schedule_batch()
    idle.forward_mode = ForwardMode.IDLE
    idle.is_extend_in_batch = True  # an idle DP rank during an extend round
    idle.seq_lens = torch.zeros(0, dtype=torch.int64)
    seen = []
    original = target.forward_batch_generation

    def spy(*a, **k):
        seen.append(stashed(model))
        return original(*a, **k)

    target.forward_batch_generation = spy
    empty = _proxy({"hidden_states": torch.zeros(0, H.HIDDEN), PARTIAL_KEY: torch.zeros(0, H.HIDDEN)})
    worker.forward_batch_generation(idle, pp_proxy_tensors=empty)
    assert seen[-1] is not None and seen[-1].partial_in.shape == (0, H.HIDDEN)
    assert stashed(model) is None

    def boom(*a, **k):
        raise RuntimeError("target forward failed")

    target.forward_batch_generation = boom
    with pytest.raises(RuntimeError, match="target forward failed"):
        worker.forward_batch_generation(idle, pp_proxy_tensors=empty)
    assert stashed(model) is None


def test_last_stage_skips_steps_that_need_the_target_embedding():
    from sglang_dflash_pp.srt.speculative.dflash_pp_worker import PPDFlashWorkerV2

    worker = object.__new__(PPDFlashWorkerV2)  # must not touch any attribute
    assert worker._maybe_merge_trained_mask_embedding() is None
    assert worker._cache_full_embed_weight() is None


# -- worker selection and the draft load group -------------------------------------------------


def _resolved_args(model_dirs, **kw):
    from sglang.srt.server_args import ServerArgs

    from test_dflash_pp_gate import _args

    sa = ServerArgs(**_args(model_dirs, **kw))
    sa.resolve_once()
    return sa


def test_create_worker_picks_ours_only_for_dflash_pp_prefill(sglang_with_plugin, model_dirs):
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from sglang_dflash_pp.srt.speculative.dflash_pp_worker import PPDFlashWorkerV2

    dflash = SpeculativeAlgorithm.DFLASH
    assert dflash.create_worker(_resolved_args(model_dirs, pp_size=2)) is PPDFlashWorkerV2
    assert dflash.create_worker(_resolved_args(model_dirs, pp_size=1)) is DFlashWorkerV2
    assert (
        dflash.create_worker(_resolved_args(model_dirs, pp_size=1))
        is SpeculativeAlgorithm.create_worker.__wrapped__(dflash, _resolved_args(model_dirs, pp_size=1))
    )
    dspark = SpeculativeAlgorithm.DSPARK
    args = _resolved_args(model_dirs, pp_size=1)
    assert dspark.create_worker(args) is SpeculativeAlgorithm.create_worker.__wrapped__(dspark, args)


def test_draft_seed_and_load_group_are_injected_only_while_building_the_last_stage_draft(
    sglang_with_plugin,
):
    from sglang.srt.speculative import draft_worker_common

    from sglang_dflash_pp.srt.speculative.last_stage_draft_build import last_stage_draft_build

    hooked = draft_worker_common.build_draft_tp_worker
    seen = []

    def original(*args, **kwargs):
        seen.append((kwargs.get("load_group", "<default>"), kwargs.get("random_seed")))

    # Call our hook around a recording stand-in for the (GPU-building) original.
    from sglang_dflash_pp.srt.speculative.worker_selection import build_draft_tp_worker_around

    assert hooked.__wrapped__ is not None
    build_draft_tp_worker_around(original, algo_label="DFLASH")
    with last_stage_draft_build("stage-tp-group", 1234):
        build_draft_tp_worker_around(original, algo_label="DFLASH")
        build_draft_tp_worker_around(
            original, algo_label="DFLASH", load_group="explicit", random_seed=7
        )
    build_draft_tp_worker_around(original, algo_label="DFLASH")
    assert seen == [
        ("<default>", None),
        ("stage-tp-group", 1234),
        ("explicit", 7),
        ("<default>", None),
    ]


# -- scheduler relay ---------------------------------------------------------------------------


def _scheduler_self():
    """The attributes the real ``_pp_prep_batch_result`` reads on a PD prefill stage."""
    recorded = []
    return SimpleNamespace(
        _pp_spec_relay=False,
        pp_group=SimpleNamespace(is_first_rank=False),
        future_map=SimpleNamespace(stash=lambda idx, payload: recorded.append(payload)),
        tp_worker=SimpleNamespace(model_runner=SimpleNamespace(sampling_observer=None)),
    ), recorded


@pytest.mark.parametrize("algorithm", ["DFLASH", "EAGLE"])
def test_every_rank_rebuilds_the_draft_input_from_the_relay(sglang_with_plugin, algorithm):
    from sglang.srt.managers.scheduler_pp_mixin import SchedulerPPMixin
    from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2
    from sglang.srt.speculative.eagle_info import EagleDraftInput
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    algo = SpeculativeAlgorithm[algorithm]
    bs = 3
    result = SimpleNamespace(
        next_token_ids=torch.tensor([5, 6, 7]),
        accept_lens=None,
        next_draft_input=SimpleNamespace(
            topk_p=torch.empty(bs, 0), topk_index=torch.empty(bs, 0, dtype=torch.int64),
            hidden_states=torch.empty(bs, 0), dsa_topk_indices=None,
        ),
        logits_output=None,
    )
    batch = SimpleNamespace(
        spec_algorithm=algo, return_logprob=False, seq_lens=torch.tensor([9, 4, 12]),
        req_pool_indices=torch.arange(bs), input_ids=None,
    )
    scheduler, stashed_payloads = _scheduler_self()
    tensor_dict = SchedulerPPMixin._pp_prepare_tensor_dict(scheduler, result, batch)
    relay_keys = {"draft_topk_p", "draft_topk_index", "draft_hidden_states"}
    if algorithm == "DFLASH":
        assert not relay_keys & set(tensor_dict)
    else:
        assert relay_keys <= set(tensor_dict)
    out = SchedulerPPMixin._pp_prep_batch_result(
        scheduler, batch, SimpleNamespace(can_run_cuda_graph=False, fpm_timing=None, fwd_batch=None),
        _proxy(tensor_dict),
    )
    assert out.next_draft_input is batch.spec_info  # prefill.py asserts this identity
    if algorithm == "DFLASH":
        assert type(out.next_draft_input) is DFlashDraftInputV2
        assert out.next_draft_input.bonus_tokens.tolist() == [5, 6, 7]
        assert out.next_draft_input.new_seq_lens.tolist() == [9, 4, 12]
    else:
        assert type(out.next_draft_input) is EagleDraftInput


@pytest.mark.parametrize("hosts_draft", [True, False])
def test_a_prefill_stage_never_captures_a_draft_decode_graph(monkeypatch, hosts_draft):
    """Stock captures a draft decode graph whenever the decode graph backend is on, which an
    explicit ``--cuda-graph-backend-decode`` keeps on for a prefill server; the KV-write-only
    draft has no ``o_proj`` or MLP to capture. The last stage asks for no decode graph, inside
    the draft's PP and TP scopes; earlier stages have no draft to capture."""
    import contextlib

    import sglang_dflash_pp.srt.speculative.dflash_pp_worker as worker_module

    scopes, calls = [], []

    def scope(name):
        @contextlib.contextmanager
        def enter(*args):
            scopes.append((name, *args))
            yield

        return enter

    monkeypatch.setattr(worker_module, "draft_pp_context", scope("pp"))
    monkeypatch.setattr(worker_module, "draft_tp_context", scope("tp"))
    w = object.__new__(worker_module.PPDFlashWorkerV2)
    w._hosts_draft = hosts_draft
    w.draft_parallel_layout = "draft layout"
    w._draft_worker = SimpleNamespace(
        init_cuda_graphs=lambda **kw: calls.append((list(scopes), kw))
    )
    w.init_cuda_graphs()
    if hosts_draft:
        assert calls == [([("pp",), ("tp", "draft layout")], {"capture_decode_cuda_graph": False})]
    else:
        assert calls == []


# -- the KV-write fence (kv_write_fence) ------------------------------------------------------


@pytest.mark.parametrize("stage", ["last", "first"])
def test_every_stage_records_the_kv_written_event_after_its_forward(draft, monkeypatch, stage):
    """The event the requests' transfers wait on is recorded after the stage's whole forward: on
    the last stage after the draft KV is in the pool, on earlier stages after the target forward
    (its KV) and the partial."""
    from sglang_dflash_pp.srt.speculative import dflash_pp_worker

    path, model = draft
    reqs = [SimpleNamespace(rid="a"), SimpleNamespace(rid="b")]
    seen = []
    if stage == "last":
        worker, target, pool = _last_stage(model)
        chunk = H.Chunk([(0, 0, 6)], torch.arange(40, 46))
        kwargs = dict(pp_proxy_tensors=_proxy({
            "hidden_states": torch.zeros(6, H.HIDDEN),
            PARTIAL_KEY: _reference_partial(model, chunk, [0]),
        }))  # fmt: skip
        written = lambda: H.pool_image(pool)[..., chunk.out_cache_loc, :, :].abs().sum() > 0  # noqa: E731
        context = lambda: __import__("contextlib").nullcontext()  # noqa: E731
    else:
        target = H.CapturingTarget((0,), is_last=False, dtype=torch.float32)
        context = lambda: H.pp_stage(0, 2, path)  # noqa: E731
        chunk = H.Chunk([(0, 0, 6)], torch.arange(6))
        kwargs = {}
        written = lambda: bool(target.calls)  # noqa: E731
    target.chunk = chunk
    monkeypatch.setattr(
        dflash_pp_worker,
        "record_kv_written",
        lambda batch_reqs, device: seen.append((list(batch_reqs), device, written())),
    )
    with context():
        if stage == "first":
            worker = H.non_last_stage_worker(target, path, dtype=torch.float32)
        batch = chunk.schedule_batch()
        batch.reqs = reqs
        worker.forward_batch_generation(batch, **kwargs)
    assert seen == [(reqs, worker.device, True)]
