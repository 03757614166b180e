"""Faults in a DFLASH x PP deployment through real servers, and what must hold after each.

One deployment for the module, real ``launch_server`` processes started together:

* ``P``: PD prefill, DFLASH, **PP2** (TP1 per stage): the last stage holds the draft and sends
  its KV;
* ``D``: PD decode, DFLASH, **TP2**: the draft has 2 KV heads, so P's last stage holds 2 per
  rank and each D rank 1, and the draft KV goes head by head;
* ``R``: the real PD router. Its own failure policies are off (``ROUTER_ARGS``): no retries, no
  circuit breaker, no background health checks, so what a client sees is what the servers did.
  (With the router's defaults a fault's outcome depends on when a 60 s health check lands: a
  decode that is down for its ~100 s restart is marked unhealthy and kept out for up to two more
  minutes; a retry would turn the injected failure into a success; a health-check request that
  lands in a prefill batch changes the micro-batch the draft KV is computed in, and the byte
  comparisons below assume the same computation.)

Same tiny seeded fp32 Llama target (4 KV heads) and DFlash draft as ``test_llama_pd_dflash``.
Both servers run with the stock strict idle check on
(``SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE``: a scheduler that is idle while any KV slot or
request row is unaccounted for raises, which takes the server down).

First a reference: a short prompt and one several ``--chunked-prefill-size`` long (chunked over
micro-batches), their tokens and D's draft KV rows on both D ranks (the test readout
``cpu_support/draft_kv_readout``). Then the faults, in order:

1. the client drops its connection while P is still prefilling a long prompt chunk by chunk;
2. D is SIGKILLed while P prefills a long prompt, then started again on the same port with the
   same arguments (P must take the new decode's registration);
3. an empty prompt through the router: refused with a 400 by both servers' tokenizers (it used
   to crash a PP stage's forward and leave the decode unable to release it), and every server
   keeps serving;
4. an abort storm: requests dropped by their clients at every point of their way (queued, mid
   chunked prefill, in transfer, decoding), with the KV checksum on;
5. a damaged frame: the KV checksum sums of P's last stage a few bytes short
   (``cpu_support/kv_misplacement``): that request fails, nothing else.

After each fault (bounded, ``RECOVERY_S``): P's two stages and D's two ranks are idle with no KV
held by a request: ``/v1/loads`` of each server (which reports one scheduler, PP rank 0 /
attention TP rank 0: ``Scheduler.init_ipc_channels``) shows nothing running, queued or in
transfer and no used token, and every rank of both servers passed the stock strict idle check
after the fault with the series' per-room tables of its KV manager empty (the per-rank record
of ``cpu_support/idle_check_trace``: the KV checksum's sums on P, its reports on D; upstream's
own room tables are recorded beside them, and left to upstream: a prefill keeps one
``transfer_infos`` and one ``failure_records`` entry per request aborted mid-prefill); all
servers are alive; and the next request gives the reference tokens and D's draft KV rows byte-equal to the
reference on both D ranks (same prefill computation: P's radix cache is flushed first).

Requests after a fault are sent once (``post_once``): a second try could hide the property
(sglang's failed-session probe clears a wrongly failed decode after 30 s). The reference
requests keep the suite's retry after a Mooncake TCP transport stall (``cpu_servers.generate``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import socket
import threading
import time

import pytest
import requests
import torch

import cpu_servers
import deployments
import e2e_models as models
from deployment_args import CHUNK, DECODE_ARGS, prefill_args, server_args
from kv_checksum_counts import CHECKED_DECODE, CHECKSUM, INJECT_ENV, checksum_counts
from deployments import Deployment

pytestmark = pytest.mark.slow

MAX_NEW_TOKENS = 16
REFERENCE = {
    "short": "hello world, this is",
    "long": "The quick brown fox jumps over the lazy dog. " * 6,  # 270 tokens: five chunks of 64
}
ROUTER_ARGS = ("--disable-retries", "--disable-circuit-breaker", "--disable-health-check")
STRICT_IDLE = {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1"}
RECOVERY_S = 120.0  # fault resolved -> every rank idle with no KV held
# The per-room tables the series adds (idle_check_trace.ROOM_TABLES records upstream's too).
SERIES_ROOM_TABLES = ("kv_checksum_sums", "kv_checksum_reports")
REQUEST_S = 120.0  # a request that a fault breaks must end within this
PREFILL_SEEN_S = 60.0  # the long prompt's first chunks show up in P's log within this
EMPTY_PROMPT_MESSAGE = "The input prompt is empty"  # TokenizerManager._validate_one_request
SESSION_PROBE_S = 30.0  # stock SGLANG_FAILED_SESSION_PROBE_INTERVAL_S
# The fault tests act once this many chunks of their prompt are logged; at least MIN_LEFT chunks
# must still be ahead of P then (the fault lands mid chunked prefill, not after it).
CHUNKS_SEEN, MIN_LEFT = 2, 10
# P's stages and D's ranks, as named by idle_check_trace.
RANKS = {"P": ("pp0-tp0", "pp1-tp0"), "D": ("pp0-tp0", "pp0-tp1")}
# P's first stage logs each prefill micro-batch: its new tokens and the chunked prompt's rest.
PREFILL_LINE = re.compile(
    r"PP0\] Prefill batch, #new-seq: \d+, #new-token: (\d+), .*?#pending-token: (\d+)")


def fault_prompt(tag: str) -> str:
    """About 2,600 tokens (some 40 chunks, seconds of prefill on 2 cores), its own first bytes
    so that no fault prompt hits another's radix cache entry."""
    return f"[{tag}] " + "Lorem ipsum dolor sit amet, consectetur adipiscing elit. " * 45


class Faults:
    """The deployment and the directories its instruments write."""

    def __init__(self, root: str):
        self.root = root
        self.dep = Deployment("pd-faults")
        self.dump = os.path.join(root, "decode_draft_kv")
        self.idle = {"P": os.path.join(root, "idle-P"), "D": os.path.join(root, "idle-D")}
        self.boot = cpu_servers.free_port()
        self.inject = os.path.join(root, "misplace")

    @property
    def router(self) -> str:
        return self.dep["R"].base_url

    def tails(self, n: int = 3000) -> str:
        return "".join(f"\n----- {name} log tail ({s.log_path}) -----\n{s.log_tail(n)}"
                       for name, s in self.dep.servers.items())


@pytest.fixture(scope="module")
def fx(e2e_root, stub_root):
    root = os.path.join(e2e_root, "pd_faults")
    target = models.write_llama_target(os.path.join(root, "target"), kv_heads=4)
    draft = models.write_dflash_draft(os.path.join(root, "draft"))
    f = Faults(root)
    os.makedirs(root, exist_ok=True)
    open(f.inject, "w").close()
    launch = lambda name, args, **kw: f.dep.add(  # noqa: E731
        cpu_servers.launch_server(name, root, target, args, stub_root=stub_root, spec=True,
                                  pd=True, ranks=2, **kw)
    )
    try:
        p = launch("P", server_args(draft, *prefill_args(f.boot), "--pp-size", "2", CHECKSUM),
                   env={**STRICT_IDLE, "SGLANG_DFLASH_PP_TEST_IDLE_CHECK_DIR": f.idle["P"],
                        INJECT_ENV: f.inject})
        d = launch("D", server_args(draft, *DECODE_ARGS, "--tp-size", "2", *CHECKED_DECODE),
                   env={**STRICT_IDLE, "SGLANG_DFLASH_PP_TEST_IDLE_CHECK_DIR": f.idle["D"],
                        "SGLANG_DFLASH_PP_TEST_DRAFT_KV_DUMP": f.dump})
        f.dep.add(cpu_servers.launch_pd_router("R", root, [(p.base_url, f.boot)], [d.base_url],
                                               ROUTER_ARGS))
        f.dep.wait()
        yield f
    finally:
        f.dep.kill()


# -- helpers -------------------------------------------------------------------------------------


def post_once(base_url: str, text: str, rid: str, timeout_s: float = REQUEST_S) -> dict:
    """One greedy ``/generate``, never sent again: status (None if the connection failed),
    body, seconds taken."""
    body = {"text": text, "rid": rid,
            "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0}}
    t0 = time.monotonic()
    try:
        r = requests.post(base_url + "/generate", json=body, timeout=timeout_s)
        out = {"status": r.status_code, "text": r.text}
    except requests.RequestException as e:
        out = {"status": None, "text": repr(e)}
    out["seconds"] = time.monotonic() - t0
    out["ended_at"] = time.time()
    return out


def flush(fx: Faults, timeout_s: float = 60.0) -> None:
    """Flush P's radix cache, so the next prefill computes every token again. sglang refuses
    while P still holds a request: retry until it is idle."""
    deadline = time.monotonic() + timeout_s
    while True:
        r = requests.post(fx.dep["P"].base_url + "/flush_cache", timeout=30)
        if r.status_code == 200:
            return
        assert time.monotonic() < deadline, (
            f"P refused /flush_cache for {timeout_s:.0f} s: {r.status_code} {r.text}{fx.tails()}")
        time.sleep(0.5)


def read_dump(fx: Faults, rid: str, tp_rank: int) -> dict:
    path = os.path.join(fx.dump, f"tp{tp_rank}-{rid}.pt")
    assert os.path.exists(path), f"D rank {tp_rank} saved no draft KV for {rid} ({path})"
    return torch.load(path)


def log_offset(server) -> int:
    return os.path.getsize(server.log_path)


def log_since(server, offset: int) -> str:
    with open(server.log_path, errors="replace") as f:
        f.seek(offset)
        return f.read()


def wait_until_prefilling(fx: Faults, offset: int, request_done) -> int:
    """Wait until P's first stage has logged ``CHUNKS_SEEN`` full chunks of the one request in
    flight; return the tokens it still had to prefill then."""
    deadline = time.monotonic() + PREFILL_SEEN_S
    while True:
        chunks = [int(left) for new, left in PREFILL_LINE.findall(log_since(fx.dep["P"], offset))
                  if int(new) == CHUNK and int(left) > 0]
        if len(chunks) >= CHUNKS_SEEN:
            return chunks[-1]
        assert not request_done(), f"the long request ended before its prefill was seen{fx.tails()}"
        assert time.monotonic() < deadline, (
            f"P logged no chunked prefill within {PREFILL_SEEN_S:.0f} s{fx.tails()}")
        time.sleep(0.05)


def loads(server) -> dict:
    r = requests.get(server.base_url + "/v1/loads", params={"include": "core,disagg"}, timeout=10)
    r.raise_for_status()
    (load,) = r.json()["loads"]  # one DP rank
    return load


def busy_fields(load: dict) -> dict:
    """What a scheduler still holds or waits for; all zero when it is idle."""
    disagg = load.get("disaggregation") or {}
    fields = {k: load[k] for k in ("num_running_reqs", "num_waiting_reqs", "num_used_tokens")}
    fields.update({k: v for k, v in disagg.items() if k.endswith("_reqs")})
    return {k: v for k, v in fields.items() if v}


def idle_records(fx: Faults, name: str) -> dict:
    out = {}
    for rank in RANKS[name]:
        path = os.path.join(fx.idle[name], f"{rank}.json")
        try:
            with open(path) as f:
                out[rank] = json.load(f)
        except (OSError, ValueError):
            out[rank] = None
    return out


def assert_recovered(fx: Faults, since: float, what: str) -> float:
    """Bounded: every server alive, ``/v1/loads`` idle on P and D, and each rank of both (P's two
    stages, D's two ranks) passed the stock strict idle check after ``since`` holding no KV for
    a request. Returns the seconds it took."""
    t0 = time.monotonic()
    while True:
        for name, s in fx.dep.servers.items():
            assert s.alive(), (
                f"{name} died after {what} (with SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE a "
                f"leak found at idle raises in the scheduler){fx.tails()}")
        problems = {}
        for name in ("P", "D"):
            try:
                load = loads(fx.dep[name])
            except requests.RequestException as e:
                problems[f"{name} /v1/loads"] = repr(e)
            else:
                busy = busy_fields(load)
                if busy or load["timestamp"] <= since:  # an idle scheduler republishes every ~1 s
                    problems[f"{name} /v1/loads"] = busy or "not published since the fault"
            for rank, rec in idle_records(fx, name).items():
                if rec is None or rec["time"] <= since:
                    problems[f"{name} {rank}"] = "no passed idle check since the fault"
                elif (rec["num_used"] or rec["free_req_slots"] != rec["req_slots"]
                      or any(rec["room_tables"].get(t) for t in SERIES_ROOM_TABLES)):
                    problems[f"{name} {rank}"] = rec
        if not problems:
            return time.monotonic() - t0
        assert time.monotonic() - t0 < RECOVERY_S, (
            f"not idle {RECOVERY_S:.0f} s after {what}: {problems}{fx.tails()}")
        time.sleep(1.0)


def assert_reference_again(fx: Faults, reference: dict, key: str, rid: str):
    """P's cache flushed, the reference prompt once more (sent once): the reference tokens, and
    D's draft KV rows on both ranks byte-equal to the reference's."""
    flush(fx)
    before = checksum_counts(fx.dep["D"])
    r = post_once(fx.router, REFERENCE[key], rid)
    assert r["status"] == 200, f"{rid} failed: {r}{fx.tails()}"
    # the KV checksum verified its transfer, and nothing failed or went unverified
    assert checksum_counts(fx.dep["D"]) == {**before, "verified": before.get("verified", 0) + 1}, rid
    out = json.loads(r["text"])
    assert out["output_ids"] == reference[key]["output_ids"], (
        f"{rid}: {out['output_ids']} != reference {reference[key]['output_ids']}{fx.tails()}")
    for tp in (0, 1):
        ref, got = reference[key]["dumps"][tp], read_dump(fx, rid, tp)
        assert got["input_ids"] == ref["input_ids"], (rid, tp)
        for kind in ("k", "v"):
            assert torch.equal(got[kind], ref[kind]), (
                f"{rid}: D rank {tp}'s draft {kind.upper()} differs from the reference "
                f"(max |diff| {float((got[kind].float() - ref[kind].float()).abs().max()):.3g})")
    return out


# -- the reference -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(fx):
    out = {}
    for key, prompt in REFERENCE.items():
        flush(fx)
        r = cpu_servers.generate(fx.router, prompt, MAX_NEW_TOKENS, rid=f"ref-{key}")
        out[key] = {"output_ids": r["output_ids"], "meta": r["meta_info"],
                    "dumps": [read_dump(fx, f"ref-{key}", tp) for tp in (0, 1)]}
    return out


def test_reference_is_a_chunked_dflash_run_with_head_split_draft_kv(reference):
    long = reference["long"]
    assert long["meta"]["prompt_tokens"] > 4 * CHUNK  # prefilled over several micro-batches
    for key, ref in reference.items():
        assert len(ref["output_ids"]) == MAX_NEW_TOKENS, key
        assert ref["meta"]["spec_verify_ct"] >= 1, key  # DFLASH verify steps on D
        n = ref["meta"]["prompt_tokens"]
        halves = ref["dumps"]
        for kind in ("k", "v"):
            # each D rank holds one of the draft's two KV heads for every prompt token
            assert all(h[kind].shape == (2, n, 1, models.HEAD_DIM) for h in halves), key
            assert all(float(h[kind].float().abs().mean()) > 1e-2 for h in halves), key
            assert not torch.equal(halves[0][kind], halves[1][kind]), key  # two different heads


# -- 1. the client goes away mid chunked prefill ---------------------------------------------------


@contextlib.contextmanager
def generate_then_drop(router, text: str, rid: str, max_new_tokens: int):
    """Send a /generate and yield its socket; the client goes away when the block ends,
    without reading the answer."""
    body = json.dumps({"text": text, "rid": rid, "sampling_params": {
        "max_new_tokens": max_new_tokens, "temperature": 0}})
    sock = socket.create_connection(("127.0.0.1", router.port), timeout=10)
    try:
        sock.sendall((f"POST /generate HTTP/1.1\r\nHost: 127.0.0.1:{router.port}\r\n"
                      "Content-Type: application/json\r\n"
                      f"Content-Length: {len(body.encode())}\r\nConnection: close\r\n\r\n"
                      ).encode() + body.encode())
        yield sock
    finally:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        finally:
            sock.close()


def test_client_disconnect_mid_chunked_prefill(fx, reference):
    flush(fx)
    offset = log_offset(fx.dep["P"])
    with generate_then_drop(fx.dep["R"], fault_prompt("f1"), "f1-dropped",
                            MAX_NEW_TOKENS) as sock:
        # an answer (an early error) would make the socket readable
        answered = lambda: bool(select.select([sock], [], [], 0)[0])  # noqa: E731
        left = wait_until_prefilling(fx, offset, request_done=answered)
    dropped_at = time.time()
    assert left >= MIN_LEFT * CHUNK, f"only {left} tokens were left to prefill at the disconnect"
    assert_recovered(fx, dropped_at, "the client disconnect")
    assert_reference_again(fx, reference, "long", "f1-next-long")


# -- 2. the decode is killed during a long prefill, then restarted on its port ---------------------


def test_decode_killed_during_prefill_then_restarted_on_same_port(fx, reference):
    flush(fx)
    offset = log_offset(fx.dep["P"])
    result = {}
    worker = threading.Thread(
        target=lambda: result.update(post_once(fx.router, fault_prompt("f2"), "f2-in-flight")),
        daemon=True)
    worker.start()
    left = wait_until_prefilling(fx, offset, request_done=lambda: not worker.is_alive())
    old = fx.dep["D"]
    old.kill()  # SIGKILL to its whole process tree
    killed_at = time.time()
    assert left >= MIN_LEFT * CHUNK, f"only {left} tokens were left to prefill at the kill"

    worker.join(REQUEST_S + 10)
    assert not worker.is_alive(), f"the in-flight request hung after the decode died{fx.tails()}"
    assert result["ended_at"] - killed_at <= REQUEST_S, (result, fx.tails())
    # A clear error naming the decode, not a success and not a silent empty answer.
    assert result["status"] is not None and result["status"] >= 500, (result, fx.tails())
    assert "decode" in result["text"].lower(), (result, fx.tails())

    new = cpu_servers.ServerProcess("D", old.cmd, old.env, os.path.join(fx.root, "D-restarted.log"),
                                    old.ready_url, old.base_url).start()
    fx.dep.servers["D"] = new
    try:
        cpu_servers.wait_all([new], deployments.STARTUP_TIMEOUT_S)
    finally:
        deployments.record_startup("pd-faults (D restarted)", [new])
    assert new.port == old.port

    assert_recovered(fx, killed_at, "the decode's kill and restart")
    # P registered the new decode's sessions and buffers: the same bytes arrive on both ranks.
    assert_reference_again(fx, reference, "long", "f2-next-long")


# -- 3. an empty prompt through the router ------------------------------------------------------


def test_an_empty_prompt_is_refused_and_every_server_keeps_serving(fx, reference):
    """A 0-token prompt used to crash a PP stage's forward and leave the decode unable to
    release it; both servers now refuse it at their tokenizer, and the router answers 400."""
    sent_at = time.time()
    refused = post_once(fx.router, "", "f3-empty")
    assert refused["status"] == 400, (refused, fx.tails())
    assert EMPTY_PROMPT_MESSAGE in refused["text"], refused["text"][:500]
    assert_reference_again(fx, reference, "short", "f3-next-short")
    assert_recovered(fx, sent_at, "the empty prompt")


# -- 4. an abort storm, the KV checksum on ---------------------------------------------------------


STORM_DROPS_S = (0.05, 0.3, 0.8, 1.5, 2.5, 4.0, 6.0, 9.0)  # client drops after these delays


def drop_after(router, text: str, rid: str, delay_s: float) -> None:
    with generate_then_drop(router, text, rid, 64):
        time.sleep(delay_s)


def test_an_abort_storm_leaves_no_room_state(fx, reference):
    flush(fx)
    started = time.time()
    workers = [threading.Thread(target=drop_after, daemon=True,
                                args=(fx.dep["R"], fault_prompt(f"s{i}")[: 300 + 400 * i],
                                      f"storm-{i}", delay))
               for i, delay in enumerate(STORM_DROPS_S)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(30)
    assert_recovered(fx, started, "the abort storm")
    assert_reference_again(fx, reference, "long", "f4-next-long")


# -- 5. a damaged frame ------------------------------------------------------------------------------


def test_a_damaged_sums_frame_fails_its_request_only(fx, reference):
    flush(fx)
    sent_at = time.time()
    before = checksum_counts(fx.dep["D"])
    with open(fx.inject, "w") as f:
        f.write("truncate-sums")
    try:
        broken = post_once(fx.router, REFERENCE["short"], "f5-truncated")
    finally:
        open(fx.inject, "w").close()
    assert broken["status"] is not None and broken["status"] >= 500, broken
    assert checksum_counts(fx.dep["D"]) == {**before, "failed": before.get("failed", 0) + 1}
    assert_recovered(fx, sent_at, "the damaged frame")
    assert_reference_again(fx, reference, "short", "f5-next-short")
