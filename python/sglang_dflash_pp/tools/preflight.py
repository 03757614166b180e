"""``sglang-dflash-pp preflight``: the draft-KV data path, end to end on CPU, verified byte by byte.

Scaled-down geometry, the deployment's topology: by default the Kimi-K3 example's P PP8 x TP4 ->
D TP32 with its 8 draft KV heads, 93 target layers and capture layers (so the partition and the
ownership are the production ones), but hidden 64, head_dim 16 and a short prompt. Processes:

* one per prefill PP stage (``preflight_stage``): non-last stages import no sglang and pass the
  carry through a gloo process group; the last stage (``preflight_last``) runs the real
  ``DFlashDraftModel``, writes page-layout draft KV pools and sends them with the plugin's send
  path over the real Mooncake engine;
* one for all decode ranks (``preflight_decode``): pools with guard regions, one engine, the
  byte check.

This process only validates the geometry (the plugin's own refusals), starts the others,
relays what one needs from another, prints progress to stderr, and always ends every child
(``peer_process``). The verdict: every decode byte equals the bytes of the prefill pools it
was sent from and every other byte is untouched (``byte_exact``), each decode rank received
exactly its physical minimum with the descriptors ``check`` predicts, and the draft KV is within
rounding of the single-process reference.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import time

from sglang_dflash_pp.tools import examples
from sglang_dflash_pp.tools.exit_codes import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_REFUSED,
)
from sglang_dflash_pp.tools.preflight_spec import SPEC_FILE, PreflightSpec, scaled_draft_config

# Allowed |PP path - reference|, in units of the model dtype's epsilon times the reference's
# largest magnitude. The PP path sums fp32 partials and normalises in fp32 where the reference
# rounds one fc GEMM to the model dtype first, so the two differ by rounding: about one unit in the
# last place here. A wrong feature, column block or order is off by the size of the values.
TOLERANCE_EPS = {"bfloat16": 4, "float32": 64}
DTYPE_EPS = {"bfloat16": 2.0**-7, "float32": 2.0**-23}


def add_arguments(p) -> None:
    ex = examples.load("kimi-k3")
    draft = ex.config("draft")
    p.add_argument(
        "--pp", type=int, default=int(ex.prefill_arg("--pp-size")), help="prefill PP stages"
    )
    p.add_argument(
        "--p-tp", type=int, default=int(ex.prefill_arg("--tp-size")), help="prefill TP size"
    )
    p.add_argument("--d-tp", type=int, default=ex.decode_tp_size, help="decode TP size")
    p.add_argument(
        "--draft-heads", type=int, default=int(draft["num_key_value_heads"]), help="draft KV heads"
    )
    p.add_argument(
        "--draft-layers", type=int, default=int(draft["num_hidden_layers"]), help="draft layers"
    )
    p.add_argument("--hidden", type=int, default=64, help="hidden size (scaled down)")
    p.add_argument("--head-dim", type=int, default=16, help="draft head_dim (scaled down)")
    p.add_argument("--tokens", type=int, default=100, help="prompt tokens")
    p.add_argument("--page-size", type=int, default=16, help="KV page size")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(TOLERANCE_EPS), help="model dtype")
    p.add_argument(
        "--carry-dtype",
        choices=["float32", "bfloat16"],
        help="carry dtype (default: SGLANG_DFLASH_PP_CARRY_DTYPE, else float32)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--pack-buffer-mb",
        type=int,
        default=1,
        help="SGLANG_DFLASH_DRAFT_KV_PACK_BUFFER_MB of the last stage (small: CPU memory)",
    )
    p.add_argument("--timeout", type=float, default=300.0, help="seconds for the whole run")
    p.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    p.add_argument(
        "--keep-workdir", action="store_true", help="keep the work directory (logs, pools)"
    )
    p.add_argument(
        "--network",
        choices=["auto", "isolated", "host"],
        default="auto",
        help="isolated: run in a new network namespace holding only loopback (unshare); "
        "auto: isolated when the system allows it, else host",
    )


class Refused(Exception):
    def __init__(self, source: str, message: str):
        super().__init__(message)
        self.source = source


def _progress_printer(t0: float):
    def say(who: str, message: str) -> None:
        sys.stderr.write(f"[preflight {time.monotonic() - t0:6.1f}s] {who}: {message}\n")
        sys.stderr.flush()

    return say


def _carry_dtype(opts) -> str:
    from sglang_dflash_pp.srt.models.context_partial import CARRY_DTYPES, carry_dtype_from_env

    if opts.carry_dtype:
        return opts.carry_dtype
    try:
        dtype = carry_dtype_from_env()
    except ValueError as e:
        raise Refused("carry dtype (context_partial)", str(e)) from None
    return next(n for n, d in CARRY_DTYPES.items() if d == dtype)


def _validate(opts) -> None:
    for name in "pp p_tp d_tp draft_heads draft_layers hidden head_dim tokens page_size".split():
        if getattr(opts, name) < 1:
            raise Refused("arguments", f"--{name.replace('_', '-')} must be at least 1")
    if opts.head_dim % 2:
        raise Refused("arguments", "--head-dim must be even (RoPE rotates pairs)")


def predicted_transfer(spec: PreflightSpec) -> dict:
    """What ``check`` predicts for this geometry and these pages (the plugin's verdict and
    descriptor builders); raises ``DraftKVLayoutError`` with the refusal."""
    from sglang_dflash_pp.srt.disaggregation.draft_kv_geometry import DraftKVShape
    from sglang_dflash_pp.tools.draft_kv_report import DraftKVTopology, report

    elem = {"bfloat16": 2, "float32": 4}[spec.dtype]
    topo = DraftKVTopology(
        DraftKVShape(spec.draft_heads, spec.head_dim, spec.head_dim, elem),
        spec.draft_layers, spec.page_size, spec.p_tp, spec.d_tp, spec.pp,
    )  # fmt: skip
    return report(
        topo, spec.tokens, pack_slot_bytes=spec.pack_buffer_mb << 20,
        src_pages=spec.src_pages, dst_pages=spec.dst_pages,
    )  # fmt: skip


def run_preflight(opts, say) -> dict:
    """The run; returns the summary (``verdict``: pass / fail), or raises :class:`Refused`."""
    from sglang_dflash_pp.srt.disaggregation.draft_kv_geometry import DraftKVLayoutError
    from sglang_dflash_pp.tools.peer_process import Children

    t_start = time.monotonic()
    _validate(opts)
    ex = examples.load("kimi-k3")
    target_text = ex.config("target").get("text_config") or ex.config("target")
    draft_cfg = ex.config("draft")
    spec = PreflightSpec(
        workdir="", pp=opts.pp, p_tp=opts.p_tp, d_tp=opts.d_tp,
        draft_heads=opts.draft_heads, head_dim=opts.head_dim, hidden=opts.hidden,
        draft_layers=opts.draft_layers, tokens=opts.tokens, page_size=opts.page_size,
        num_layers=int(target_text["num_hidden_layers"]),
        target_layer_ids=list(draft_cfg["dflash_config"]["target_layer_ids"]),
        dtype=opts.dtype, carry_dtype=_carry_dtype(opts), seed=opts.seed,
        pack_buffer_mb=opts.pack_buffer_mb, timeout_s=opts.timeout,
    )  # fmt: skip
    try:
        predicted = predicted_transfer(spec)
    except DraftKVLayoutError as e:
        raise Refused("draft KV transfer (the plugin's registration verdict)", str(e)) from None
    spec.workdir = tempfile.mkdtemp(prefix="sglang-dflash-pp-preflight-")
    children = Children(t_start + opts.timeout, say)
    try:
        os.makedirs(spec.draft_dir)
        with open(os.path.join(spec.draft_dir, "config.json"), "w") as f:
            json.dump(scaled_draft_config(draft_cfg, spec), f, indent=1)
        spec.save()
        say("preflight", f"work directory {spec.workdir}")
        results = _run_processes(spec, children, say)
        summary = _summary(spec, predicted, **results)
    finally:
        children.kill_all()
        if not opts.keep_workdir:
            shutil.rmtree(spec.workdir, ignore_errors=True)
    summary["wall_s"] = time.monotonic() - t_start
    ph = summary["phases_s"]
    ph["other"] = max(0.0, summary["wall_s"] - sum(ph.values()))
    if opts.keep_workdir:
        summary["workdir"] = spec.workdir
    return summary


def _run_processes(spec: PreflightSpec, children, say) -> dict:
    """Start the decode process and the last stage, then the other stages once the last stage
    has the partition; relay the decode's registration; collect every result."""
    from sglang_dflash_pp.tools.peer_process import loopback_env

    env = loopback_env({"SGLANG_DFLASH_DRAFT_KV_PACK_BUFFER_MB": str(spec.pack_buffer_mb)})
    spec_path = spec.path(SPEC_FILE)

    def spawn(name: str, module: str, *args: str) -> None:
        argv = [sys.executable, "-m", f"sglang_dflash_pp.tools.{module}", spec_path, *args]
        children.spawn(name, argv, env, spec.path(name.replace(" ", "") + ".log"))

    last = f"stage {spec.pp - 1}"
    spawn("decode", "preflight_decode")
    spawn(last, "preflight_stage", str(spec.pp - 1))
    hello = children.wait_for("decode", "ready")
    say(
        "decode",
        f"{spec.d_tp} ranks x {spec.draft_layers} layers: {hello['registered']} pool "
        f"allocations ({hello['pool_bytes']:,} B, guards included) registered with Mooncake, "
        f"session {hello['session']}",
    )
    children.children[last].write({"decode": hello})

    own = children.wait_for(last, "ownership", "refused")
    if own["kind"] == "refused":
        raise Refused(own["source"], own["message"])
    say(last, "partition " + ", ".join(_stage_text(s) for s in own["stages"]))
    for s in range(spec.pp - 1):
        spawn(f"stage {s}", "preflight_stage", str(s))
    stage_results = []
    for s in range(spec.pp - 1):
        res = children.wait_for(f"stage {s}", "result")
        stage_results.append(res)
        if res["sent_bytes"]:
            say(
                f"stage {s}",
                f"features {res['features']}: sent the partial, {res['sent_bytes']:,} B "
                f"({res['sent_bytes'] // spec.tokens:,} B/token) in "
                f"{res['done_s'] * 1e3:.1f} ms",
            )
    written = children.wait_for(last, "written")
    say(
        last,
        f"draft KV written by the real DFlashDraftModel in "
        f"{written['kv_write_s'] * 1e3:.1f} ms; max |PP - reference| "
        f"{written['kv_max_abs_error']:.3g} (reference max {written['kv_ref_absmax']:.3g})",
    )
    sent = children.wait_for(last, "transferred")
    say(
        last,
        f"Mooncake: {sum(1 for x in sent['pairs'] if x['sent'])} prefill->decode sends, "
        f"{sent['calls']} engine calls, "
        f"{sum(x.get('descriptors', 0) for x in sent['pairs']):,} descriptors in "
        f"{sent['transfer_s'] * 1e3:.1f} ms",
    )
    children.children[last].write({"cmd": "exit"})
    children.children["decode"].write({"cmd": "verify"})
    verified = children.wait_for("decode", "verified")
    say(
        "decode",
        f"{verified['checked_bytes']:,} bytes checked, "
        f"{verified['mismatched_bytes']:,} mismatched",
    )
    children.children["decode"].write({"cmd": "exit"})
    return dict(own=own, stage_results=stage_results, written=written, sent=sent, verified=verified)


def _summary(spec, predicted, own, stage_results, written, sent, verified) -> dict:
    pairs = [x for x in sent["pairs"] if x["sent"]]
    per_decode = {}
    for x in pairs:
        d = per_decode.setdefault(x["decode_rank"], dict(descriptors=0, bytes=0, writers=[]))
        d["descriptors"] += x["descriptors"]
        d["bytes"] += x["bytes"]
        d["writers"].append(x["prefill_rank"])
    expected = {r["decode_rank"]: r for r in predicted["decode_ranks"]}
    matches = all(
        per_decode.get(r, {}).get("descriptors") == e["descriptors"]
        and per_decode.get(r, {}).get("bytes") == e["bytes"]
        and sorted(per_decode.get(r, {}).get("writers", [])) == sorted(e["writers"])
        for r, e in expected.items()
    )
    minimum_ok = all(
        per_decode.get(r, {}).get("bytes") == e["physical_minimum_bytes"]
        for r, e in expected.items()
    )
    eps = DTYPE_EPS[spec.dtype] * TOLERANCE_EPS[spec.dtype]
    tol = eps * max(written["kv_ref_absmax"], 1e-30)
    byte_exact = verified["mismatched_bytes"] == 0
    numerics_ok = verified["max_abs_error"] <= tol and written["kv_max_abs_error"] <= tol
    hops = [
        dict(hop=f"{r['stage']}->{r['stage'] + 1}", bytes=r["sent_bytes"],
             bytes_per_token=r["sent_bytes"] // spec.tokens)
        for r in stage_results
    ]  # fmt: skip
    ok = byte_exact and matches and minimum_ok and numerics_ok
    return dict(
        verdict="pass" if ok else "fail",
        ok=ok,
        byte_exact=byte_exact,
        mismatched_bytes=verified["mismatched_bytes"],
        checked_bytes=verified["checked_bytes"],
        geometry=dict(
            pp=spec.pp,
            p_tp=spec.p_tp,
            d_tp=spec.d_tp,
            draft_heads=spec.draft_heads,
            head_dim=spec.head_dim,
            hidden=spec.hidden,
            draft_layers=spec.draft_layers,
            tokens=spec.tokens,
            page_size=spec.page_size,
            pages=spec.n_pages,
            dtype=spec.dtype,
            carry_dtype=spec.carry_dtype,
            num_layers=spec.num_layers,
            target_layer_ids=spec.target_layer_ids,
            src_pages=spec.src_pages,
            dst_pages=spec.dst_pages,
        ),
        stages=own["stages"],
        carry=dict(dtype=spec.carry_dtype, hops=hops, total_bytes=sum(h["bytes"] for h in hops)),
        kv=dict(
            max_abs_error=written["kv_max_abs_error"],
            decode_max_abs_error=verified["max_abs_error"],
            ref_absmax=written["kv_ref_absmax"],
            tolerance=tol,
            within_tolerance=numerics_ok,
        ),
        transfer=dict(
            sends=len(pairs),
            silent=[x for x in sent["pairs"] if not x["sent"]],
            descriptors=sum(x["descriptors"] for x in pairs),
            bytes=sum(x["bytes"] for x in pairs),
            engine_calls=sent["calls"],
            max_descriptors_per_call=sent["max_batch"],
            per_decode_rank=[dict(decode_rank=r, **v) for r, v in sorted(per_decode.items())],
            physical_minimum_bytes_per_decode_rank=sorted(
                {e["physical_minimum_bytes"] for e in expected.values()}
            ),
            bytes_equal_physical_minimum=minimum_ok,
            matches_check_prediction=matches,
            pairs=pairs,
        ),
        verify=verified,
        phases_s=dict(
            stage_forwards_and_carry=written["carry_wait_s"],
            kv_write=written["kv_write_s"],
            transfer=sent["transfer_s"],
            verify=verified["verify_s"],
        ),
    )


def render(summary: dict) -> str:
    g, t, k, ph = summary["geometry"], summary["transfer"], summary["kv"], summary["phases_s"]
    desc = "/".join(str(x) for x in sorted({r["descriptors"] for r in t["per_decode_rank"]}))
    byts = "/".join(f"{x:,}" for x in sorted({r["bytes"] for r in t["per_decode_rank"]}))
    hops = [h for h in summary["carry"]["hops"] if h["bytes"]]
    yes = {True: "yes", False: "NO"}
    lines = [
        f"preflight: P PP{g['pp']} x TP{g['p_tp']} -> D TP{g['d_tp']}; draft {g['draft_layers']} "
        f"layers x {g['draft_heads']} KV heads x {g['head_dim']} ({g['dtype']}), hidden "
        f"{g['hidden']}, {g['tokens']} tokens, page {g['page_size']} ({g['pages']} pages)",
        "  partition: " + ", ".join(_stage_text(s) for s in summary["stages"]),
    ]
    if hops:
        lines.append(
            f"  carry ({summary['carry']['dtype']}): {len(hops)} hops x {hops[0]['bytes']:,} B "
            f"({hops[0]['bytes_per_token']:,} B/token)"
        )
    lines += [
        f"  draft KV vs single-process reference: max abs error {k['max_abs_error']:.3g} "
        f"(reference max {k['ref_absmax']:.3g}, tolerance {k['tolerance']:.3g}): "
        + ("ok" if k["within_tolerance"] else "OUT OF TOLERANCE"),
        f"  transfer (Mooncake TCP, 127.0.0.1): {t['sends']} sends, {t['descriptors']:,} "
        f"descriptors in {t['engine_calls']} engine calls (at most "
        f"{t['max_descriptors_per_call']} per call), {t['bytes']:,} B; per D rank {desc} "
        f"descriptors, {byts} B (physical minimum: {yes[t['bytes_equal_physical_minimum']]}; "
        f"as check predicts: {yes[t['matches_check_prediction']]})",
        f"  verify: {summary['checked_bytes']:,} D bytes checked (guards included), "
        f"{summary['mismatched_bytes']:,} mismatched: "
        + ("byte-exact" if summary["byte_exact"] else "MISMATCH"),
        "  phases: "
        + ", ".join(f"{name.replace('_', ' ')} {v:.3f} s" for name, v in ph.items())
        + f"; wall {summary['wall_s']:.1f} s",
        f"  network: {summary.get('network')}",
    ]
    lines += [f"    {bad}" for bad in summary["verify"].get("bad", [])[:5]]
    lines.append("PASS" if summary["ok"] else "FAIL")
    return "\n".join(lines)


def _stage_text(s: dict) -> str:
    text = f"{s['stage']}:[{s['layers'][0]},{s['layers'][1]})"
    return text + (f" {s['features']}" if s["features"] else "")


# -- network isolation ------------------------------------------------------------------------
#
# Every connection of the run goes to 127.0.0.1: the carry group's gloo device is bound to it and
# rendezvouses through a file, sglang's world-1 group initialises through a file, both Mooncake
# engines start on 127.0.0.1 and every session id is 127.0.0.1:port. But the Mooncake engine
# (0.3.13) binds its two listeners (handshake RPC and TCP transport) to the wildcard address, and
# has no setting for it. So where the system allows unprivileged user namespaces the whole run
# (this process and its children) is re-executed in a new network namespace whose only interface
# is loopback: no port of the run is reachable from outside the machine.

NETNS_ENV = "SGLANG_DFLASH_PP_PREFLIGHT_NETNS"
UNSHARE = ["unshare", "--net", "--map-root-user", "--"]


def _netns_available() -> bool:
    if not shutil.which("unshare"):
        return False
    import subprocess

    try:
        return subprocess.run(UNSHARE + ["true"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _loopback_up() -> None:
    """Bring ``lo`` up inside the new namespace (it starts down)."""
    import fcntl
    import socket
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifr = struct.pack("16sh", b"lo", 0)
        flags = struct.unpack("16sh", fcntl.ioctl(s, 0x8913, ifr))[1]  # SIOCGIFFLAGS
        fcntl.ioctl(s, 0x8914, struct.pack("16sh", b"lo", flags | 0x1))  # SIOCSIFFLAGS, IFF_UP


def _run_in_netns(argv) -> int:
    """Run ``sglang-dflash-pp preflight ARGV`` in a new network namespace and wait for it; a
    signal to this process is passed on, and the inner run cleans up its own children."""
    import subprocess

    from sglang_dflash_pp.tools.peer_process import child_setup

    env = dict(os.environ, **{NETNS_ENV: "1"})
    cmd = UNSHARE + [sys.executable, "-m", "sglang_dflash_pp", "preflight", *argv]
    inner = subprocess.Popen(cmd, env=env, preexec_fn=child_setup)
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        return inner.wait()
    except KeyboardInterrupt:
        _stop(inner)
        return EXIT_INTERRUPTED
    except BaseException:
        _stop(inner)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)


def _stop(inner) -> None:
    """Ask the inner run to clean up (SIGTERM), then insist."""
    import subprocess

    if inner.poll() is None:
        inner.send_signal(signal.SIGTERM)
        try:
            inner.wait(timeout=30)
        except subprocess.TimeoutExpired:
            inner.kill()
            inner.wait()


def run_preflight_cli(opts, argv=()) -> int:

    inside = os.environ.get(NETNS_ENV) == "1"
    if not inside and opts.network != "host":
        if _netns_available():
            return _run_in_netns(list(argv))
        if opts.network == "isolated":
            print(
                "preflight: --network isolated needs unshare with user namespaces", file=sys.stderr
            )
            return EXIT_FAILED
    if inside:
        _loopback_up()
    network = (
        "isolated (new network namespace, loopback only)"
        if inside
        else (
            "host (Mooncake's listeners bind the wildcard address; all traffic goes to 127.0.0.1)"
        )
    )
    say = _progress_printer(time.monotonic())
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        try:
            summary = run_preflight(opts, say)
        except Refused as e:
            summary = dict(
                verdict="refused", ok=False, refusal=dict(source=e.source, message=str(e))
            )
            code = EXIT_REFUSED
        except KeyboardInterrupt:
            summary = dict(verdict="interrupted", ok=False)
            code = EXIT_INTERRUPTED
        except Exception as e:
            summary = dict(verdict="error", ok=False, error=f"{type(e).__name__}: {e}")
            code = EXIT_FAILED
        else:
            code = EXIT_OK if summary["ok"] else EXIT_FAILED
    finally:
        signal.signal(signal.SIGTERM, previous)
    summary["network"] = network
    if opts.json:
        print(json.dumps(summary, indent=1, default=str))
    elif summary["verdict"] == "refused":
        print(
            f"preflight refused: [{summary['refusal']['source']}] {summary['refusal']['message']}"
        )
    elif summary["verdict"] == "error":
        print(f"preflight failed: {summary['error']}")
    elif summary["verdict"] == "interrupted":
        print("preflight interrupted; its processes were stopped")
    else:
        print(render(summary))
    return code


def _terminate(signum, frame):
    raise SystemExit(128 + signum)  # unwinds through run_preflight's cleanup
