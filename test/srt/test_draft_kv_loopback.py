"""Draft KV through a real Mooncake transfer engine, over TCP on 127.0.0.1, between two processes.

* The decode process (this file run with ``--decode``; numpy, torch and ``mooncake.engine`` only)
  allocates pool-shaped CPU buffers for every decode rank of a case -- target MLA entries, and
  per draft layer one fused K|V allocation as sglang's ``MHATokenToKVPool`` makes it -- with a
  guard region before and after each one, registers the whole allocation including the guards
  (so a stray write would land, not fail), fills everything with a sentinel, and later checks
  every byte: the sent pages hold exactly the decode rank's own heads, everything else is
  untouched.
* The prefill process (``--prefill``) loads sglang with the plugin, builds one manager per
  prefill rank around real CPU draft pools, registers them through sglang's own
  ``register_buffer_to_engine`` with sglang's ``MooncakeTransferEngine`` wrapper, registers each
  decode rank through the real (hooked) ``_publish_peer_registration``, and sends one chunk
  through the real ``transfer_worker`` -> ``send_kvcache`` -> ``_transfer_data`` -> engine.

Cases: prefill TP4 -> decode TP32 (prefill rank 1 and its 8 decode ranks: packed page runs),
TP2 -> TP1 (two prefill ranks fill one decode rank's rows: per-token descriptors, chunked below
the TCP transport's batch limit), and TP4 -> TP4 (sglang's own path).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

from sglang_dflash_pp.tools.peer_process import PeerProcess, write_message

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import test_draft_kv_mooncake as harness  # noqa: E402

GUARD = 4096
SENTINEL = 0xA5
SRC_PAGES, DST_PAGES = [5, 6, 7, 20, 11], [2, 3, 4, 9, 15]
CASES = {
    "tp4_to_tp32": dict(
        prefill_tp=4, prefill_ranks=[1], decode_tp=32, decode_ranks=list(range(8, 16))
    ),
    "tp2_to_tp1": dict(prefill_tp=2, prefill_ranks=[0, 1], decode_tp=1, decode_ranks=[0]),
    "tp4_to_tp4": dict(prefill_tp=4, prefill_ranks=[0, 3], decode_tp=4, decode_ranks=[0, 3]),
}
LOOPBACK_ENV = {
    "MOONCAKE_PROTOCOL": "tcp",
    "MC_FORCE_TCP": "1",
    "MC_TCP_BIND_ADDRESS": "127.0.0.1",
    "GLOG_minloglevel": "2",
}
INSTALL_HINT = (
    "the Mooncake transfer engine could not start. Install its system libraries and the "
    "non-CUDA build: `sudo apt-get install -y libibverbs1 libnuma1` and "
    "`pip install mooncake-transfer-engine-non-cuda==0.3.13.post1` (scripts/setup-dev.sh does both)."
)


def global_target_kv(entry: int) -> np.ndarray:
    """Target MLA bytes of one entry, [pages, item], the same on every prefill rank (replicated)."""
    return np.random.default_rng(500 + entry).integers(
        0, 256, (harness.POOL_PAGES, harness.MLA_ITEM), np.uint8
    )


# -- the two peers ----------------------------------------------------------------------------


def decode_main() -> None:
    import torch

    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:
        write_message({"error": f"{INSTALL_HINT} ({e})"})
        return
    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        write_message({"error": INSTALL_HINT + " (initialize failed)"})
        return
    write_message({"session": f"127.0.0.1:{engine.get_rpc_port()}"})
    H, P, S, L = harness.H, harness.POOL_PAGES, harness.PAGE, harness.DRAFT_LAYERS
    rows = P * S + S  # sglang's size + page_size token slots
    cases = {}
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "exit":
            return
        case = CASES[cmd["case"]]
        if cmd["cmd"] == "alloc":
            ranks = {}
            h = harness.heads_per_rank(case["decode_tp"])
            row_bytes = h * harness.HEAD_DIM * 2
            for r in case["decode_ranks"]:
                target, fused = [], []
                for _ in range(harness.N_TARGET):
                    target.append(np.full(GUARD + P * harness.MLA_ITEM + GUARD, SENTINEL, np.uint8))
                for _ in range(L):
                    fused.append(np.full(GUARD + 2 * rows * row_bytes + GUARD, SENTINEL, np.uint8))
                buffers = target + fused
                assert (
                    engine.batch_register_memory(
                        [b.ctypes.data for b in buffers], [b.size for b in buffers]
                    )
                    == 0
                )
                kv_ptrs = [b.ctypes.data + GUARD for b in target]
                kv_ptrs += [b.ctypes.data + GUARD for b in fused]  # K halves
                kv_ptrs += [b.ctypes.data + GUARD + rows * row_bytes for b in fused]  # V halves
                published = {
                    "kv_ptrs": kv_ptrs,
                    "item_lens": harness.decode_item_lens(case["decode_tp"]),
                }
                ranks[r] = dict(
                    target=target, fused=fused, row_bytes=row_bytes, published=published
                )
            cases[cmd["case"]] = ranks
            write_message({str(r): v["published"] for r, v in ranks.items()})
        elif cmd["cmd"] == "verify":
            errors, checked = [], 0
            for r, bufs in cases[cmd["case"]].items():
                tp = case["decode_tp"]
                heads = harness.owned_heads(tp, r)
                want_t = []
                for i, buf in enumerate(bufs["target"]):
                    want = np.full(buf.size, SENTINEL, np.uint8)
                    body = want[GUARD:-GUARD].reshape(P, harness.MLA_ITEM)
                    body[DST_PAGES] = global_target_kv(i)[SRC_PAGES]
                    want_t.append(want)
                for i, (buf, want) in enumerate(zip(bufs["target"], want_t)):
                    if not np.array_equal(buf, want):
                        errors.append(
                            f"decode rank {r} target entry {i}: {np.count_nonzero(buf != want)} bytes differ"
                        )
                    checked += buf.size
                rb = bufs["row_bytes"]
                for layer, buf in enumerate(bufs["fused"]):
                    want = np.full(buf.size, SENTINEL, np.uint8)
                    for half, q in ((0, layer), (1, L + layer)):
                        full = harness.global_draft_kv(q, rows)[:, heads.start : heads.stop]
                        full = full.contiguous()
                        tokens = full.view(torch.uint8).reshape(rows, rb).numpy()
                        body = want[
                            GUARD + half * rows * rb : GUARD + (half + 1) * rows * rb
                        ].reshape(rows, rb)
                        for sp, dp in zip(SRC_PAGES, DST_PAGES):
                            body[dp * S : (dp + 1) * S] = tokens[sp * S : (sp + 1) * S]
                    if not np.array_equal(buf, want):
                        bad = np.flatnonzero(buf != want)
                        where = "guard" if bad[0] < GUARD or bad[-1] >= buf.size - GUARD else "pool"
                        errors.append(
                            f"decode rank {r} draft layer {layer}: {bad.size} bytes differ, first at "
                            f"{bad[0]} ({where})"
                        )
                    checked += buf.size
            write_message({"errors": errors, "checked": checked})


PLUGIN_CODE = ("sglang_dflash_pp.srt", "sglang_dflash_pp.hooks", "sglang_dflash_pp.plugin")


class _RefusePluginCode:
    """An import hook of the patched-tree prefill: the plugin's hooks and transfer code must not
    be needed (its plugin-free tools, ``peer_process`` and the ``qkv_kv_heads`` oracle, are)."""

    def find_spec(self, name, path=None, target=None):
        if name in PLUGIN_CODE or name.startswith(tuple(p + "." for p in PLUGIN_CODE)):
            raise ImportError(name + " is imported: the patched tree must not need the plugin")
        return None


def plugin_state() -> dict:
    import sglang
    from sglang.srt.plugins.hook_registry import HookRegistry

    return {
        "sglang_file": sglang.__file__,
        "hooks": sorted(HookRegistry._hooks),
        "plugin_modules": sorted(m for m in sys.modules if m.startswith(PLUGIN_CODE)),
    }


def _count_tree_packs():
    """On a tree with PR 6: counters of its packed sends and pack launches, and the staging
    builder its ``_init_kv_manager`` calls; None on a tree without the pack."""
    try:
        from sglang.srt.disaggregation import draft_kv_chunk_packs
        from sglang.srt.disaggregation.draft_kv_staging import with_pack_staging
        from sglang.srt.disaggregation.mooncake import draft_kv_packed_send
    except ImportError:
        return None
    counts = {"sends": 0, "launches": 0, "with_pack_staging": with_pack_staging}
    send_packed, pack_slices = draft_kv_packed_send.send_packed, draft_kv_chunk_packs.pack_slices

    def counted_send(*args, **kwargs):
        counts["sends"] += 1
        return send_packed(*args, **kwargs)

    def counted_pack(*args, **kwargs):
        counts["launches"] += 1
        return pack_slices(*args, **kwargs)

    draft_kv_packed_send.send_packed = counted_send
    draft_kv_chunk_packs.pack_slices = counted_pack
    return counts


def prefill_main(on_tree: bool = False) -> None:
    """The prefill peer; ``on_tree``: sglang is a patched tree (``export-patches``, first on
    ``PYTHONPATH``) run without the plugin, the draft geometry in ``KVArgs.draft_kv_source``."""
    for k, v in LOOPBACK_ENV.items():
        os.environ.setdefault(k, v)
    if on_tree:
        sys.meta_path.insert(0, _RefusePluginCode())
    import torch

    if on_tree:
        from sglang.srt.disaggregation.draft_kv_plan import prefill_ranks_for
        from sglang.srt.disaggregation.draft_kv_source import describe_draft_pool

        packing = _count_tree_packs()  # None before PR 6
    else:
        from sglang_dflash_pp.srt.disaggregation.draft_kv_plan import prefill_ranks_for
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
        MooncakeTransferEngine,
    )
    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import get_context

    load_plugins()  # on the tree, SGLANG_PLUGINS names no plugin
    get_context().override_server_args(speculative_algorithm="DFLASH").install()
    try:
        engine = MooncakeTransferEngine(hostname="127.0.0.1", gpu_id=0, ib_device=None)
    except Exception as e:  # ImportError or init failure
        write_message({"error": f"{INSTALL_HINT} ({e!r})"})
        return
    targets = [torch.from_numpy(global_target_kv(i).copy()) for i in range(harness.N_TARGET)]
    write_message({"ready": True, **(plugin_state() if on_tree else {})})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "exit":
            return
        case = CASES[cmd["case"]]
        results = {}
        for p in case["prefill_ranks"]:
            pool = harness.make_draft_pool(case["prefill_tp"], p)
            if not on_tree:
                harness.record_source(pool, case["prefill_tp"], p)
            kv_args = harness.prefill_kv_args(
                pool, tp_rank=p, target_ptrs=[t.data_ptr() for t in targets]
            )
            if on_tree:  # what the patched _init_kv_manager fills
                kv_args.draft_kv_source = describe_draft_pool(pool, harness.H)
                if packing is not None:  # PR 6: with the rank's pack staging
                    kv_args.draft_kv_source = packing["with_pack_staging"](
                        kv_args.draft_kv_source, harness.PAGE, case["prefill_tp"], p
                    )
            m = harness.prefill_manager(
                kv_args, tp_size=case["prefill_tp"], tp_rank=p, engine=engine
            )
            m.register_buffer_to_engine()  # sglang's own registration of every KV entry
            sent = []

            def recorded(session, blocks, m=m, sent=sent):
                sent.append(list(blocks))
                return MooncakeKVManager._transfer_data(m, session, blocks)  # the real engine call

            m._transfer_data = recorded
            for r in case["decode_ranks"]:
                if p not in prefill_ranks_for(
                    r, prefill_tp=case["prefill_tp"], decode_tp=case["decode_tp"]
                ):
                    continue  # sglang's rank mapping never pairs them
                published = cmd["decode"][str(r)]
                reg = harness.decode_registration(
                    cmd["session"],
                    tp_size=case["decode_tp"],
                    tp_rank=r,
                    kv_ptrs=published["kv_ptrs"],
                )
                reason = m._publish_peer_registration(cmd["session"], reg)
                if reason:
                    results[f"{p}->{r}"] = {"rejected": reason}
                    continue
                sent.clear()
                if on_tree and packing is not None:
                    packing["sends"], packing["launches"] = 0, 0
                harness.run_worker(m, reg, SRC_PAGES, DST_PAGES)
                item_lens = published["item_lens"][harness.N_TARGET :]
                ranges = [
                    (ptr, ptr + (harness.POOL_PAGES + 1) * n)
                    for ptr, n in zip(published["kv_ptrs"][harness.N_TARGET :], item_lens)
                ]
                blocks = [b for batch in sent for b in batch]
                plan = getattr(reg, "dflash_draft_kv_plan", None)
                results[f"{p}->{r}"] = {
                    "failures": m.failures,
                    "action": None if plan is None else plan.action.value,
                    "regime": None if plan is None or plan.pair is None else plan.pair.regime.value,
                    "descriptors": len(blocks),
                    "calls": len(sent),
                    "max_batch": max((len(batch) for batch in sent), default=0),
                    "draft_bytes": sum(
                        n for _, d, n in blocks if any(a <= d < z for a, z in ranges)
                    ),
                }
                if on_tree and packing is not None:
                    staging = kv_args.draft_kv_source.staging
                    results[f"{p}->{r}"].update(
                        packed_sends=packing["sends"],
                        pack_launches=packing["launches"],
                        # by the patched register_buffer_to_engine, with the engine it registered
                        staging_registered=staging is not None
                        and staging.registered_engine is engine,
                    )
                m.failures = []
        if on_tree:
            results["_plugin_state"] = plugin_state()
        write_message(results)


# -- the test side ----------------------------------------------------------------------------


class Peer(PeerProcess):
    """One side of the loopback: this file run with ``--decode`` or ``--prefill``."""

    def __init__(self, role: str, log_dir: str, timeout: float, env=None):
        env = dict(os.environ if env is None else env, **LOOPBACK_ENV)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [HERE, env.get("PYTHONPATH")]))
        argv = [sys.executable, os.path.abspath(__file__), f"--{role}"]
        super().__init__(role, argv, env, os.path.join(log_dir, f"{role}.log"))
        self.timeout = timeout

    def read(self, timeout=None) -> dict:
        reply = super().read(timeout or self.timeout)
        if "error" in reply:
            raise RuntimeError(f"{self.name} peer: {reply['error']}")
        return reply

    def ask(self, cmd: dict, timeout=None) -> dict:
        self.write(cmd)
        return self.read(timeout)

    def close(self) -> None:
        super().close({"cmd": "exit"})


@pytest.fixture(scope="module")
def peers(tmp_path_factory):
    log_dir = str(tmp_path_factory.mktemp("draft_kv_loopback"))
    decode = prefill = None
    try:
        decode = Peer("decode", log_dir, timeout=120)
        prefill = Peer("prefill", log_dir, timeout=300)  # imports sglang: slow on a busy box
        session = decode.read()["session"]
        prefill.read()
        yield decode, prefill, session
    finally:
        for peer in (prefill, decode):
            if peer is not None:
                peer.close()


def run_case(peers, name):
    decode, prefill, session = peers
    published = decode.ask({"cmd": "alloc", "case": name})
    results = prefill.ask(
        {"cmd": "send", "case": name, "session": session, "decode": published}, timeout=300
    )
    rejected = {k: v["rejected"] for k, v in results.items() if "rejected" in v}
    assert rejected == {}, rejected
    report = decode.ask({"cmd": "verify", "case": name})
    assert report["errors"] == [], report["errors"]
    assert report["checked"] > 0
    return results


def test_tp4_to_tp32_one_prefill_rank_and_its_eight_decode_ranks(peers):
    results = run_case(peers, "tp4_to_tp32")
    for r in range(8, 16):
        res = results[f"1->{r}"]
        assert res["failures"] == [] and (res["action"], res["regime"]) == (
            "head aware",
            "pack on prefill, then page runs",
        )
        # 4 target entries x 3 page runs, then 12 draft entries x 3 destination runs
        assert res["descriptors"] == 4 * 3 + 12 * 3
        assert (
            res["draft_bytes"] == 12 * len(DST_PAGES) * 16384
        )  # the decode rank's own bytes, once


def test_tp2_to_tp1_two_writers_fill_each_row(peers):
    results = run_case(peers, "tp2_to_tp1")
    per_token = 12 * len(SRC_PAGES) * harness.PAGE
    assert results["0->0"]["action"] == "head aware" and results["1->0"]["action"] == "draft only"
    assert results["0->0"]["descriptors"] == 4 * 3 + per_token
    assert results["1->0"]["descriptors"] == per_token
    for p in (0, 1):
        assert results[f"{p}->0"]["failures"] == []
        assert results[f"{p}->0"]["draft_bytes"] == 12 * len(SRC_PAGES) * harness.PAGE * 4 * 256
        assert (
            results[f"{p}->0"]["max_batch"] == 1024
        )  # 3840 draft descriptors in batches of <= 1024


def test_equal_tp_keeps_the_stock_path(peers):
    results = run_case(peers, "tp4_to_tp4")
    for p in (0, 3):
        res = results[f"{p}->{p}"]
        assert res["failures"] == [] and res["action"] == "stock"
        assert (
            res["descriptors"] == (4 + 12) * 3 and res["calls"] == 1
        )  # one batch, as sglang sends it


if __name__ == "__main__":
    roles = {"--decode": decode_main, "--prefill": prefill_main}
    roles["--prefill-tree"] = lambda: prefill_main(on_tree=True)
    roles[sys.argv[1]]()
