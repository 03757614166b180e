"""The Kimi-K3 P/D recipe in examples/kimi_k3 cannot rot: the exact argument lists that
prefill.sh, decode.sh, router.sh and bench.sh build are extracted (RECIPE_PRINT_ARGS=1 makes a
script print its argv instead of exec'ing it) and parsed by the real parsers: P and D by
sglang 0.5.23's ``prepare_server_args`` -> ``resolve_once`` -> ``check_server_args`` with the
plugin loaded, the router by sglang-router's own CLI parser, the benchmark by ours.

Test-side substitutions, and nothing else: model paths point at tiny local configs (a 16-layer
text-only Kimi-K3 and a 6-layer DFlash draft with block size 16), ``--device cuda`` is appended
(only a string during resolution; this box has no GPU), and the platform's Mamba extra-buffer
support is reported as present, as on the GPU (cpu-harness.md item 1), so the recipe's default
radix-cache strategy resolves unchanged.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

import tiny_models

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPE = os.path.join(REPO, "examples", "kimi_k3")
SCRIPTS = ("prefill.sh", "decode.sh", "router.sh", "bench.sh")
P_HEAD, D_HEAD, ROUTER_ADDR = "10.0.0.1", "10.0.1.1", "10.0.2.1"


@pytest.fixture(scope="module")
def k3_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("kimi_k3_recipe")
    return {
        "target": tiny_models.write_model_dir(str(root / "k3"), tiny_models.kimi_k3_text_config(16)),
        "draft": tiny_models.write_model_dir(str(root / "draft"), tiny_models.kimi_k3_dflash_draft_config()),
    }


def script_argv(script, **env):
    """The argv the script would exec, exactly (NUL-separated on stdout)."""
    clean = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), "RECIPE_PRINT_ARGS": "1"}
    clean.update(env)
    proc = subprocess.run(["bash", os.path.join(RECIPE, script)], env=clean, capture_output=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr.decode()
    out = proc.stdout.decode()
    assert out.endswith("\0")
    return out[:-1].split("\0")


def p_argv(dirs, node_rank=0, **env):
    return script_argv("prefill.sh", KIMI_K3_PATH=dirs["target"], KIMI_K3_DFLASH_PATH=dirs["draft"],
                       NODE_RANK=str(node_rank), P_HEAD=P_HEAD, **env)


def d_argv(dirs, node_rank=0, **env):
    return script_argv("decode.sh", KIMI_K3_PATH=dirs["target"], KIMI_K3_DFLASH_PATH=dirs["draft"],
                       NODE_RANK=str(node_rank), D_HEAD=D_HEAD, **env)


@pytest.fixture
def gpu_like_mamba(monkeypatch):
    import sglang.srt.arg_groups.mamba_hook as mamba_hook

    monkeypatch.setattr(mamba_hook, "_platform_supports_mamba_cache_extra_buffer", lambda: True)


def resolve_launch_server(argv):
    """``python -m sglang.launch_server ARGS`` -> the resolved config, as launch_server does it."""
    from sglang.srt.server_args import prepare_server_args

    assert argv[:3] == ["python3", "-m", "sglang.launch_server"], argv[:3]
    sa = prepare_server_args(argv[3:] + ["--device", "cuda"])
    sa.resolve_once()
    sa.check_server_args()
    return json.loads(json.dumps(sa.resolved_dict(), default=str))


def _cuda_graph_backend(resolved, phase):
    return str(resolved["cuda_graph_config"][phase]["backend"]).lower()


@pytest.mark.parametrize("node_rank", [0, 3])
def test_prefill_recipe_resolves_with_plugin(patched_sglang, gpu_like_mamba, k3_dirs, node_rank):
    r = resolve_launch_server(p_argv(k3_dirs, node_rank))
    assert (r["tp_size"], r["pp_size"], r["ep_size"]) == (4, 8, 4)
    assert (r["nnodes"], r["node_rank"], r["dist_init_addr"]) == (4, node_rank, f"{P_HEAD}:5000")
    assert r["speculative_algorithm"] == "DFLASH"
    assert r["speculative_draft_model_path"] == k3_dirs["draft"]
    assert r["speculative_num_draft_tokens"] == 16  # from the draft's block_size
    assert r["disaggregation_mode"] == "prefill"
    assert r["disaggregation_transfer_backend"] == "mooncake"
    assert r["disaggregation_bootstrap_port"] == 8998
    assert r["chunked_prefill_size"] == 8192
    assert r["kv_cache_dtype"] == "bf16"
    assert "disabled" in _cuda_graph_backend(r, "prefill")
    assert r["disable_overlap_schedule"] is True  # PP forces it
    assert (r["host"], r["port"]) == ("0.0.0.0", 30000)


def test_decode_recipe_resolves_and_matches_prefill(patched_sglang, gpu_like_mamba, k3_dirs):
    d = resolve_launch_server(d_argv(k3_dirs))
    p = resolve_launch_server(p_argv(k3_dirs))
    assert (d["tp_size"], d["pp_size"], d["ep_size"]) == (32, 1, 4)
    assert (d["nnodes"], d["node_rank"], d["dist_init_addr"]) == (4, 0, f"{D_HEAD}:5000")
    assert d["speculative_algorithm"] == "DFLASH"
    assert d["disaggregation_mode"] == "decode"
    assert (d["host"], d["port"]) == ("0.0.0.0", 30001)
    # What P and D must agree on for the KV / draft-KV handoff.
    for field in (
        "model_path",
        "speculative_draft_model_path",
        "speculative_num_draft_tokens",
        "speculative_num_steps",
        "speculative_eagle_topk",
        "disaggregation_transfer_backend",
        "kv_cache_dtype",
        "page_size",
    ):
        assert d[field] == p[field], field
    assert d["speculative_num_draft_tokens"] == 16


def test_baseline_variant_resolves_without_speculation(patched_sglang, gpu_like_mamba, k3_dirs):
    """DFLASH=0: the same P and D without the two speculative flags (the --baseline run)."""
    p = resolve_launch_server(p_argv(k3_dirs, DFLASH="0"))
    d = resolve_launch_server(d_argv(k3_dirs, DFLASH="0"))
    assert p["speculative_algorithm"] is None and d["speculative_algorithm"] is None
    assert (p["pp_size"], p["disaggregation_mode"]) == (8, "prefill")
    assert (d["tp_size"], d["disaggregation_mode"]) == (32, "decode")


@pytest.mark.parametrize("argv_of", [p_argv, d_argv], ids=["prefill", "decode"])
def test_rdma_devices_reach_sglangs_ib_validation(patched_sglang, gpu_like_mamba, k3_dirs, argv_of):
    """IB_DEVICE adds --disaggregation-ib-device, which resolution checks against the host's
    /sys/class/infiniband (absent on this CPU box, present on the cluster)."""
    argv = argv_of(k3_dirs, IB_DEVICE="mlx5_0,mlx5_1")
    assert argv[-2:] == ["--disaggregation-ib-device", "mlx5_0,mlx5_1"]
    try:
        resolved = resolve_launch_server(argv)
    except Exception as e:  # this host lacks the HCAs: the real validation said so
        if not os.path.isdir("/sys/class/infiniband"):
            assert "InfiniBand sysfs path not found" in str(e)
        else:
            assert "mlx5_" in str(e), e
    else:  # a host that has mlx5_0 and mlx5_1
        assert resolved["disaggregation_ib_device"] == "mlx5_0,mlx5_1"


def test_router_recipe_parses_and_points_at_p_and_d(patched_sglang, gpu_like_mamba, k3_dirs):
    from sglang_router.launch_router import parse_router_args

    argv = script_argv("router.sh", P_HEAD=P_HEAD, D_HEAD=D_HEAD)
    assert argv[:3] == ["python3", "-m", "sglang_router.launch_router"]
    router = parse_router_args(argv[3:])
    p = resolve_launch_server(p_argv(k3_dirs))
    d = resolve_launch_server(d_argv(k3_dirs))
    assert router.pd_disaggregation is True
    assert router.prefill_urls == [(f"http://{P_HEAD}:{p['port']}", p["disaggregation_bootstrap_port"])]
    assert router.decode_urls == [f"http://{D_HEAD}:{d['port']}"]
    assert router.port == 8000 and router.worker_startup_timeout_secs == 3600


def test_bench_recipe_is_c1_c8_on_64_questions():
    sys.path.insert(0, REPO) if REPO not in sys.path else None
    from benchmark.gsm8k.bench_dflash_pd import build_parser

    argv = script_argv("bench.sh", GSM8K_TEST="/data/test.jsonl", GSM8K_TRAIN="/data/train.jsonl",
                       ROUTER_ADDR=ROUTER_ADDR)
    assert argv[0] == "python3" and argv[1] == os.path.join(REPO, "benchmark", "gsm8k", "bench_dflash_pd.py")
    args = build_parser().parse_args(argv[2:])
    assert (args.host, args.port) == (ROUTER_ADDR, 8000)  # router.sh's --port
    assert args.num_questions == 64 and args.parallel == [1, 8]
    assert args.max_new_tokens == 512 and args.num_shots == 5 and args.api == "native"
    assert (args.data_path, args.train_path) == ("/data/test.jsonl", "/data/train.jsonl")
    assert args.baseline is None and args.allow_failures is False
    with_base = build_parser().parse_args(
        script_argv("bench.sh", GSM8K_TEST="t", GSM8K_TRAIN="t", ROUTER_ADDR="r", BASELINE="b.json")[2:]
    )
    assert with_base.baseline == "b.json"


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_flag_is_explained(script):
    """Each line of a script that adds a flag is commented (on the line above, or inline)."""
    lines = open(os.path.join(RECIPE, script)).read().splitlines()
    flag_lines = 0
    for i, line in enumerate(lines):
        code = line.split(" # ", 1)[0].strip()
        flags = re.findall(r"(?:^|[\s(])(--[a-z][a-z0-9-]*)", code)
        if not flags or code.startswith("#") or code.startswith("launch") or code.startswith("require"):
            continue
        flag_lines += 1
        prev = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        assert prev.startswith("#") or " # " in line, f"{script}:{i + 1}: {flags} unexplained"
    assert flag_lines >= 5


@pytest.mark.parametrize(
    "script, needed",
    [
        ("prefill.sh", ["KIMI_K3_PATH", "KIMI_K3_DFLASH_PATH", "NODE_RANK", "P_HEAD"]),
        ("decode.sh", ["KIMI_K3_PATH", "KIMI_K3_DFLASH_PATH", "NODE_RANK", "D_HEAD"]),
        ("router.sh", ["P_HEAD", "D_HEAD"]),
        ("bench.sh", ["GSM8K_TEST", "GSM8K_TRAIN", "ROUTER_ADDR"]),
    ],
)
def test_scripts_refuse_to_start_without_their_settings(script, needed):
    proc = subprocess.run(["bash", os.path.join(RECIPE, script)], capture_output=True, text=True,
                          env={"PATH": os.environ["PATH"]}, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    for name in needed:
        assert f"set {name}" in proc.stderr
