"""``sglang-dflash-pp preflight``: the draft-KV data path end to end on CPU, through the installed
console script, judged by its JSON verdict.

Each run starts real processes: PP stages passing the carry over gloo, the real DFlashDraftModel
writing page-layout pools on the last stage, the plugin's send path over the real Mooncake engine,
and one decode process that checks every byte. The tests assert the verdict's parts (byte-exact,
zero mismatches, each decode rank's physical minimum, the counts ``check`` predicts), that a
corrupted transfer is caught with a non-zero exit, that a refused geometry is refused before any
process starts, and that no process of a run outlives it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import psutil

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONSOLE_SCRIPT = os.path.join(os.path.dirname(sys.executable), "sglang-dflash-pp")
EXIT_FAILED, EXIT_REFUSED = 1, 3
ENTRIES = 12  # 6 draft layers x (K, V)

# Test-only fault injection, loaded in every process of the run through PYTHONPATH: the draft
# send path's first descriptor lands one byte past its destination.
CORRUPT_SITECUSTOMIZE = """
import importlib.abc, importlib.util, sys

# Test-only: the first draft KV descriptor the prefill sends lands one byte off. The draft send's
# one transfer function is draft_kv_send.transfer; the packed send binds it by name.
TARGETS = {
    "sglang_dflash_pp.srt.disaggregation.draft_kv_send",
    "sglang_dflash_pp.srt.disaggregation.draft_kv_packed_send",
}
_state = {"corrupted": False}


def _patch(module):
    original = module.transfer

    def shifted(manager, session, descriptors, *args):
        if not _state["corrupted"]:
            _state["corrupted"] = True
            descriptors.dst[0] += 1
        return original(manager, session, descriptors, *args)

    module.transfer = shifted


class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in TARGETS or getattr(self, "busy", False):
            return None
        self.busy = True
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self.busy = False
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Hook())
"""


def _preflight(*args, env_extra=None, timeout=300):
    env = dict(os.environ)
    for name in (
        "SGLANG_DFLASH_PP_CARRY_DTYPE",
        "SGLANG_PP_LAYER_PARTITION",
        "SGLANG_USE_CPU_ENGINE",
    ):
        env.pop(name, None)
    env.update(env_extra or {})
    proc = subprocess.run(
        [CONSOLE_SCRIPT, "preflight", "--json", "--keep-workdir", *args],
        capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO,
    )  # fmt: skip
    try:
        summary = json.loads(proc.stdout)
    except json.JSONDecodeError:
        raise AssertionError(
            f"no JSON summary (rc {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        )
    workdir = summary.get("workdir")
    if workdir:
        leftovers = [
            p.pid
            for p in psutil.process_iter(["cmdline"])
            if workdir in " ".join(p.info["cmdline"] or [])
        ]
        shutil.rmtree(workdir, ignore_errors=True)
        assert leftovers == [], f"processes of the run outlived it: {leftovers}"
    return proc, summary


def _runs(pages):
    """Maximal runs of consecutive pages (an independent count)."""
    return 1 + sum(1 for a, b in zip(pages, pages[1:]) if b != a + 1)


def test_example_geometry_is_byte_exact():
    """The example's topology (P PP8 x TP4 -> D TP32, 8 draft heads, Kimi-K3's 93 layers and
    capture layers) at hidden 64: each decode rank takes one of its prefill rank's two heads,
    packed; every decode byte is checked."""
    proc, s = _preflight()
    assert proc.returncode == 0, s
    assert s["verdict"] == "pass" and s["ok"] is True
    assert s["byte_exact"] is True and s["mismatched_bytes"] == 0
    g = s["geometry"]
    assert (g["pp"], g["p_tp"], g["d_tp"], g["draft_heads"], g["hidden"]) == (8, 4, 32, 8, 64)
    owners = [s_["stage"] for s_ in s["stages"] if s_["features"]]
    assert owners == [1, 3, 4, 5, 6, 7]  # the production partition's owners
    # Every byte of every decode allocation was compared: 32 ranks x 6 layers x (K|V + 2 guards).
    rows = (max(g["dst_pages"]) + 2) * g["page_size"] + g["page_size"]
    row_bytes = 1 * g["head_dim"] * 2  # one head per decode rank (8 heads / TP32), bf16
    assert s["checked_bytes"] == 32 * 6 * (2 * rows * row_bytes + 2 * 4096)
    t = s["transfer"]
    assert t["matches_check_prediction"] and t["bytes_equal_physical_minimum"]
    assert {x["regime"] for x in t["pairs"]} == {"pack on prefill, then page runs"}
    assert [r["writers"] for r in t["per_decode_rank"]] == [[r // 8] for r in range(32)]
    assert [x["heads"] for x in t["pairs"]] == [[r // 4] for r in range(32)]
    dst_runs = _runs(g["dst_pages"])
    assert dst_runs > 1  # the request's pages are not contiguous on the decode side
    assert {r["descriptors"] for r in t["per_decode_rank"]} == {ENTRIES * dst_runs}
    assert {r["bytes"] for r in t["per_decode_rank"]} == {
        ENTRIES * g["pages"] * g["page_size"] * row_bytes
    }
    # The carry: one [tokens, hidden] fp32 partial on each of the six hops after stage 1 starts it.
    assert [h["bytes"] for h in s["carry"]["hops"]] == [0] + [g["tokens"] * g["hidden"] * 4] * 6
    assert s["kv"]["within_tolerance"] and s["kv"]["max_abs_error"] <= s["kv"]["tolerance"]
    assert s["kv"]["decode_max_abs_error"] == s["kv"]["max_abs_error"]  # the transfer is exact
    assert set(s["phases_s"]) >= {"stage_forwards_and_carry", "kv_write", "transfer", "verify"}


def test_smaller_decode_tp_two_writers_per_token_descriptors():
    """P PP3 x TP4 -> D TP2: two prefill ranks fill disjoint heads of every decode row; the second
    is let through sglang's replicated-target skip to send its draft heads only."""
    proc, s = _preflight("--pp", "3", "--p-tp", "4", "--d-tp", "2", "--tokens", "40")
    assert proc.returncode == 0, s
    assert s["verdict"] == "pass" and s["byte_exact"] and s["mismatched_bytes"] == 0
    t, g = s["transfer"], s["geometry"]
    assert t["matches_check_prediction"] and t["bytes_equal_physical_minimum"]
    assert [r["writers"] for r in t["per_decode_rank"]] == [[0, 1], [2, 3]]
    actions = {(x["prefill_rank"], x["action"]) for x in t["pairs"]}
    assert actions == {(0, "head aware"), (1, "draft only"), (2, "head aware"), (3, "draft only")}
    assert {x["regime"] for x in t["pairs"]} == {"one descriptor per token row"}
    per_writer = ENTRIES * g["pages"] * g["page_size"]
    assert {r["descriptors"] for r in t["per_decode_rank"]} == {2 * per_writer}
    assert 0 < t["max_descriptors_per_call"] <= 1024
    assert len(s["carry"]["hops"]) == 2


def test_a_corrupted_transfer_fails_the_run(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(CORRUPT_SITECUSTOMIZE)
    pythonpath = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    proc, s = _preflight(
        "--pp", "2", "--p-tp", "2", "--d-tp", "4", env_extra={"PYTHONPATH": pythonpath}
    )
    assert proc.returncode == EXIT_FAILED
    assert s["verdict"] == "fail" and s["ok"] is False
    assert s["byte_exact"] is False and s["mismatched_bytes"] > 0
    assert any(b.startswith("decode rank ") for b in s["verify"]["bad"])


def test_refused_geometry_exits_before_starting_anything():
    proc, s = _preflight("--d-tp", "3", timeout=120)
    assert proc.returncode == EXIT_REFUSED
    assert s["verdict"] == "refused"
    assert (
        "decode attention TP 3 and the draft's 8 KV heads: neither divides the other"
        in s["refusal"]["message"]
    )
    assert "workdir" not in s
