"""The CPU bypasses, one per stock 0.5.23 symbol that cannot run on a CPU.

Each entry says: the stock symbol, why it cannot run here, what we do instead, and why that does
not touch what the end-to-end tests prove (tokens, draft KV, acceptance, the PP/PD plumbing). All
of them are inert for CUDA tensors and for ``--device`` other than ``cpu``.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class Patch:
    target: str
    hook: Callable
    hook_type: str
    why: str


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


# -- 1. arg_groups/speculative_hook._handle_dflash: the platform refusal ---------------------------
# Stock: "DFLASH speculative decoding is not supported by SRTPlatform on device 'cpu'"; the draft
# attention backend resolution also knows no CPU backend. The base SRTPlatform on a CUDA-less box
# declares nothing. While ``_handle_dflash`` runs for ``--device cpu`` we show it a platform view
# that supports DFLASH with a CPU attention backend (torch_native; triton under the interpreter).
# Every other decision of the handler (block size, steps, topk, running-request cap) is stock.


class _CpuDflashPlatform:
    """Read-through view of the real platform that declares DFLASH on CPU."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)

    def is_out_of_tree(self) -> bool:
        return True

    def supports_speculative_algorithm(self, algorithm: str) -> bool:
        return algorithm == "DFLASH"

    def supports_speculative_draft_attention_backend(self, algorithm: str, backend: str) -> bool:
        return backend in ("torch_native", "triton")

    def get_default_speculative_draft_attention_backend(self, algorithm: str) -> str:
        return "triton" if _interpreting() else "torch_native"


def handle_dflash_on_cpu(original, server_args, *args, **kwargs):
    from sglang.srt.arg_groups import speculative_hook
    from sglang.srt.arg_groups.overrides import resolving_view

    if resolving_view(server_args).device != "cpu":
        return original(server_args, *args, **kwargs)
    real = speculative_hook.current_platform
    speculative_hook.current_platform = _CpuDflashPlatform(real)
    try:
        return original(server_args, *args, **kwargs)
    finally:
        speculative_hook.current_platform = real


def draft_worker_backend_on_cpu(original, *args, **kwargs):
    """``speculative/draft_worker_common.resolve_draft_worker_attention_backend`` falls back to
    flashinfer for any backend outside its CUDA list; on ``--device cpu`` keep the CPU backend
    resolution chose (the same one the target runs)."""
    from sglang.srt.runtime_context import get_device, get_spec

    backend = get_spec().speculative_draft_attention_backend
    if get_device().device == "cpu" and backend in ("torch_native", "triton"):
        return backend
    return original(*args, **kwargs)


# -- 2. mem_cache/memory_pool.MHATokenToKVPool._init_kv_copy_and_warmup --------------------------
# Speculative decoding turns on the KV-cache copy, whose warm-up launches a Triton kernel (no
# driver on CPU). The tests set SGLANG_NATIVE_MOVE_KV_CACHE=1 so every real move uses torch; the
# warm-up is then pointless and skipped for CPU pools only.


def skip_kv_copy_warmup_on_cpu(original, self, *args, **kwargs):
    if torch.device(self.device).type == "cpu" and not _interpreting():
        self._kv_copy_config = None
        return None
    return original(self, *args, **kwargs)


# -- 3. mem_cache/allocation.assign_req_to_token_pool_func ---------------------------------------
# Its CPU branch needs sgl_kernel's CPU ops (not in the CUDA wheel; cpu-harness.md), otherwise it
# launches a Triton kernel. Same contract in torch: row ``req_pool_indices[i]`` of
# ``req_to_token`` gets ``out_cache_loc``'s next ``end - start`` entries at ``[start, end)``.


def assign_req_to_token_pool_torch(original, req_pool_indices, req_to_token, start_offset,
                                   end_offset, out_cache_loc, batch_size, *args, **kwargs):
    if req_to_token.is_cuda or _interpreting():
        return original(req_pool_indices, req_to_token, start_offset, end_offset,
                        out_cache_loc, batch_size, *args, **kwargs)
    taken = 0
    for i in range(int(batch_size)):
        start, end = int(start_offset[i]), int(end_offset[i])
        row = int(req_pool_indices[i])
        req_to_token[row, start:end] = out_cache_loc[taken : taken + end - start].to(
            req_to_token.dtype
        )
        taken += end - start
    return None


# -- 4. kernels/ops/speculative/cache_locs.assign_extend_cache_locs_func --------------------------
# No CPU branch (returns None). Same contract in torch: the cache locations
# ``req_to_token[req_pool_indices[i], start[i]:end[i]]``, concatenated.


def assign_extend_cache_locs_torch(original, req_pool_indices, req_to_token, start_offset,
                                   end_offset, batch_size, draft_token_num, device, *args, **kwargs):
    if req_to_token.is_cuda:  # the stock CPU answer is None, interpreter or not
        return original(req_pool_indices, req_to_token, start_offset, end_offset,
                        batch_size, draft_token_num, device, *args, **kwargs)
    rows = [
        req_to_token[int(req_pool_indices[i]), int(start_offset[i]) : int(end_offset[i])]
        for i in range(int(batch_size))
    ]
    return torch.cat(rows).to(torch.int64) if rows else torch.empty(0, dtype=torch.int64)


# -- 5. layers/attention/torch_native_backend.TorchNativeAttnBackend.forward_extend ---------------
# DFLASH verify (and the draft block, which also runs as TARGET_VERIFY) reaches forward_extend
# without extend lengths: the CUDA backends derive them from the draft-token count. We give the
# stock torch implementation the same view for that call: every request extends its committed
# ``seq_lens`` by ``tokens / batch`` rows. The attention math is stock.


@contextmanager
def _verify_extend_view(forward_batch, num_tokens: int):
    bs = int(forward_batch.batch_size)
    per_req = num_tokens // bs
    saved = (forward_batch.extend_prefix_lens, forward_batch.extend_seq_lens, forward_batch.seq_lens)
    prefix = forward_batch.seq_lens
    forward_batch.extend_prefix_lens = prefix
    forward_batch.extend_seq_lens = torch.full_like(prefix, per_req)
    forward_batch.seq_lens = prefix + per_req
    try:
        yield
    finally:
        (forward_batch.extend_prefix_lens, forward_batch.extend_seq_lens,
         forward_batch.seq_lens) = saved


def torch_native_target_verify(original, self, q, k, v, layer, forward_batch, *args, **kwargs):
    if forward_batch.extend_seq_lens is not None or not forward_batch.forward_mode.is_target_verify():
        return original(self, q, k, v, layer, forward_batch, *args, **kwargs)
    with _verify_extend_view(forward_batch, q.shape[0]):
        return original(self, q, k, v, layer, forward_batch, *args, **kwargs)


# -- 7. disaggregation/mooncake/conn.MooncakeKVSender.supports_host_tensor_indices ---------------
# When True, the PD prefill path (disaggregation/prefill.py, send_kv_chunk) stages page indices in
# pinned host memory and records a CUDA event. On a CPU the indices already live in host memory:
# the sender takes the plain path (the one every non-Mooncake backend takes), same indices.


def mooncake_sender_host_indices_off_on_cpu(original, self, *args, **kwargs):
    out = original(self, *args, **kwargs)
    from sglang.srt.runtime_context import get_device

    if get_device().device == "cpu":
        self.supports_host_tensor_indices = False
    return out


# -- 8. distributed/parallel_state.GroupCoordinator.all_gather_into_tensor / reduce_scatter_tensor --
# Their CPU branch (a plain torch.distributed collective over the gloo group) is chosen by
# ``_is_cpu``, frozen at import from SGLANG_USE_CPU_ENGINE, which must stay unset here; CPU tensors
# otherwise go to sglang custom ops registered for CUDA only. We take the stock CPU branch for CPU
# tensors (a TP2 decode's vocab-parallel greedy head gathers through it).


def all_gather_into_tensor_cpu(original, self, output, input, *args, **kwargs):
    if input.is_cuda:
        return original(self, output, input, *args, **kwargs)
    return self._all_gather_into_tensor(output, input)


def reduce_scatter_tensor_cpu(original, self, output, input, *args, **kwargs):
    if input.is_cuda:
        return original(self, output, input, *args, **kwargs)
    return self._reduce_scatter_tensor(output, input)


# -- 9. model_loader/weight_utils.initialize_dummy_weights: seeded weights for --load-format dummy --
# Not a CPU gap: stock dummy weights are uniform(+-1e-3) from one seed, so every parameter of a
# shape holds the same values and a forward's activations all but vanish: nothing for two
# deployments to disagree on. With SGLANG_DFLASH_PP_TEST_SEEDED_WEIGHTS=1 every floating
# parameter is drawn instead from a generator seeded by its (global) name: norm-like 1-D weights
# 1 + 0.1 N(0,1), everything else 0.1 N(0,1). Names carry global layer ids, so every PP stage,
# and the prefill and decode servers, hold the same weights for the same layer.

SEEDED_WEIGHTS_ENV = "SGLANG_DFLASH_PP_TEST_SEEDED_WEIGHTS"


def seeded_dummy_weights(original, model, *args, **kwargs):
    import zlib

    if os.environ.get(SEEDED_WEIGHTS_ENV) != "1":
        return original(model, *args, **kwargs)
    with torch.no_grad():
        for name, param in model.state_dict().items():
            if not torch.is_floating_point(param):
                continue
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            r = torch.randn(param.shape, generator=g, dtype=torch.float32)
            value = 1 + 0.1 * r if (param.ndim == 1 and "norm" in name) else 0.1 * r
            param.copy_(value.to(param.dtype))
    return None


# -- 10. kernels/ops/mamba/mamba_state_scatter_triton.scatter_mamba_states_after_mtp_verify --------
# After a DFLASH verify on a hybrid target (Kimi-K3's KDA layers) the accepted step's recurrent
# and conv states are scattered into the state cache by Triton kernels that refuse non-CUDA/XPU
# tensors. The same contract in torch, from the kernels' docstrings: for every request i whose
# step s_i >= 0, ``dst[:, dst_index[i]] = src[:, src_row[i], s_i]`` (src_row = i unless given),
# for the SSM states and each conv window, with the state slots and then the track slots.


def _scatter_steps(dst, src, dst_indices, steps, src_indices):
    valid = (steps >= 0).nonzero().flatten()
    if valid.numel() == 0:
        return
    rows = valid if src_indices is None else src_indices[valid]
    dst[:, dst_indices[valid].long()] = src[:, rows.long(), steps[valid].long()].to(dst.dtype)


def scatter_mamba_states_torch(original, mamba_caches, state_indices_tensor,
                               last_correct_step_indices, mamba_track_indices,
                               mamba_steps_to_track, src_indices_raw=None, *args, **kwargs):
    if mamba_caches.temporal.is_cuda:
        return original(mamba_caches, state_indices_tensor, last_correct_step_indices,
                        mamba_track_indices, mamba_steps_to_track, src_indices_raw,
                        *args, **kwargs)
    slots = [(state_indices_tensor, last_correct_step_indices)]
    if mamba_track_indices is not None:
        slots.append((mamba_track_indices, mamba_steps_to_track))
    pairs = [(mamba_caches.temporal, mamba_caches.intermediate_ssm)] + list(
        zip(mamba_caches.conv, mamba_caches.intermediate_conv_window)
    )
    for dst, src in pairs:
        if dst.numel() == 0:
            continue
        for indices, steps in slots:
            _scatter_steps(dst, src, indices, steps, src_indices_raw)
    return None


def _commit_then_dump(original, self, decode_req, *args, **kwargs):
    from sglang_dflash_pp_cpu_support.draft_kv_readout import commit_then_dump

    return commit_then_dump(original, self, decode_req, *args, **kwargs)


# -- 13. disaggregation/checksum.KvChecksumComputer.compute ----------------------------------------
# Upstream's digest of equal layouts (--disaggregation-enable-kv-checksum) is a JIT CUDA kernel,
# ``kernels.ops.memory.adler32.adler32_strided_checksum``. For CPU page indices: zlib's Adler-32 of
# the same items, in the same order, read from the same host addresses. Both PD sides run it, so
# equal layouts compare as upstream's do; the placement-keyed checksum of the series (other
# layouts) has its own torch path and is not bypassed.


def kv_checksum_on_cpu(original, self, kv_page_indices_gpu, state_indices_gpu=None):
    if kv_page_indices_gpu.is_cuda:
        return original(self, kv_page_indices_gpu, state_indices_gpu)
    import ctypes
    import zlib

    groups = [(self._kv_data_ptrs, self._kv_item_lens, kv_page_indices_gpu)]
    if self._state_data_ptrs:
        groups.append((self._state_data_ptrs, self._state_item_lens, state_indices_gpu))
    value = 1
    for ptrs, item_lens, indices in groups:
        for ptr, item_len in zip(ptrs, item_lens):
            for i in indices.tolist():
                value = zlib.adler32(ctypes.string_at(ptr + i * item_len, item_len), value)
    return value


PATCHES = (
    Patch("sglang.srt.arg_groups.speculative_hook._handle_dflash", handle_dflash_on_cpu, "around",
          "declare DFLASH with a CPU draft attention backend for --device cpu"),
    Patch("sglang.srt.speculative.draft_worker_common.resolve_draft_worker_attention_backend",
          draft_worker_backend_on_cpu, "around", "keep the CPU draft attention backend"),
    Patch("sglang.srt.mem_cache.memory_pool.MHATokenToKVPool._init_kv_copy_and_warmup",
          skip_kv_copy_warmup_on_cpu, "around", "no Triton KV-copy warm-up on CPU pools"),
    Patch("sglang.srt.mem_cache.allocation.assign_req_to_token_pool_func",
          assign_req_to_token_pool_torch, "around", "torch req_to_token assignment on CPU"),
    Patch("sglang.kernels.ops.speculative.cache_locs.assign_extend_cache_locs_func",
          assign_extend_cache_locs_torch, "around", "torch extend cache locations on CPU"),
    Patch("sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_extend",
          torch_native_target_verify, "around", "TARGET_VERIFY extend lengths for torch_native"),
    Patch("sglang.srt.disaggregation.mooncake.conn.MooncakeKVSender.__init__",
          mooncake_sender_host_indices_off_on_cpu, "around", "plain host page indices on CPU"),
    Patch("sglang.srt.distributed.parallel_state.GroupCoordinator.all_gather_into_tensor",
          all_gather_into_tensor_cpu, "around", "gloo all-gather for CPU tensors"),
    Patch("sglang.srt.distributed.parallel_state.GroupCoordinator.reduce_scatter_tensor",
          reduce_scatter_tensor_cpu, "around", "gloo reduce-scatter for CPU tensors"),
    Patch("sglang.srt.model_loader.weight_utils.initialize_dummy_weights",
          seeded_dummy_weights, "around", "per-name seeded weights for --load-format dummy"),
    Patch("sglang.kernels.ops.mamba.mamba_state_scatter_triton.scatter_mamba_states_after_mtp_verify",
          scatter_mamba_states_torch, "around", "torch state scatter after verify on CPU"),
    Patch("sglang.srt.disaggregation.decode.DecodeTransferQueue._commit_transfer_to_req",
          _commit_then_dump, "around", "test readout of the decode's transferred draft KV"),
    Patch("sglang.srt.disaggregation.checksum.KvChecksumComputer.compute",
          kv_checksum_on_cpu, "around", "Adler-32 of equal-layout KV on CPU"),
)


# -- 12. torch.Tensor.record_stream on CPU tensors --------------------------------------------------
# DFlashWorkerV2.forward_batch_generation records ``seq_lens`` on the device's current stream;
# CPU tensors have no streams. A no-op for CPU tensors (there is no other stream to race with).

_record_stream = torch.Tensor.record_stream


def _record_stream_cpu_noop(self, stream):
    if self.device.type == "cpu":
        return None
    return _record_stream(self, stream)


def install_process_patches() -> None:
    """Patches that are not sglang symbols, installed once per server process."""
    import faulthandler
    import signal

    if torch.Tensor.record_stream is not _record_stream_cpu_noop:
        torch.Tensor.record_stream = _record_stream_cpu_noop
    # Not a bypass: lets a test that times out on a hung startup print every thread's stack
    # into the server log (SIGUSR1) before it kills the server.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
