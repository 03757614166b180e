"""Real SGLang server processes on this CPU box, for the tests.

``python -m sglang.launch_server`` and ``python -m sglang_router.launch_router``, started as
separate process trees bound to 127.0.0.1, with the environment ``test/cpu_support/README.md``
says stock 0.5.23 needs on a CPU, and the test-only plugin ``test/cpu_support`` on their
``PYTHONPATH`` (it bypasses the CUDA-only spots; see its docstrings). Nothing here reaches the
product: the tests only talk HTTP to these processes and read the files they were asked to write.

Every wait is bounded. A server that is not ready in time has its threads' stacks dumped into its
log (SIGUSR1 -> faulthandler, installed by the test-support plugin) and the error carries the log
tail, so a startup hang fails the test with the place each process waits.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence

TEST_ROOT = os.path.dirname(os.path.abspath(__file__))
CPU_SUPPORT = os.path.join(TEST_ROOT, "cpu_support")

# cpu-servers.md section 2: Mooncake over TCP on loopback, CPU-safe PD switches.
PD_ENV = {
    "MOONCAKE_PROTOCOL": "tcp",
    "MC_FORCE_TCP": "1",
    "SGLANG_HOST_IP": "127.0.0.1",
    "SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX": "0",
}
# Speculative decoding moves KV with torch instead of the Triton tiled copy.
SPEC_ENV = {"SGLANG_NATIVE_MOVE_KV_CACHE": "1"}
# More than one rank per server (PP or TP) over gloo: one OMP group per rank, and no pynccl
# (the CUDA torch wheel ships libnccl, which then refuses CPU tensors).
MULTI_RANK_ENV = {"SGLANG_NCCL_SO_PATH": "/nonexistent/libnccl.so.2"}
# The model modules whose architectures the tests serve: LlamaForCausalLM, KimiK3LinearForCausalLM
# and the DFlash drafts (``tiny_models``, ``e2e/e2e_models``). sglang's model registry imports every
# module of ``sglang/srt/models`` in each process that loads it (255 in 0.5.23, ~4 s of a process's
# import on this box, ~20 processes per deployment); stock's SGLANG_DISABLED_MODEL_ARCHS skips the
# others. A test serving another architecture adds its module here (else sglang refuses it as
# unsupported at startup, naming the architecture).
SERVED_MODEL_MODULES = ("llama", "dflash", "kimi_k3")


def unserved_model_modules() -> str:
    """SGLANG_DISABLED_MODEL_ARCHS's value: every module of the installed ``sglang.srt.models``
    but :data:`SERVED_MODEL_MODULES` (found on disk: the test process does not import sglang for
    it)."""
    import importlib.util
    import pkgutil

    spec = importlib.util.find_spec("sglang")
    models = [os.path.join(p, "srt", "models") for p in spec.submodule_search_locations]
    names = {m.name for m in pkgutil.iter_modules(models) if not m.ispkg}
    return ",".join(sorted(names - set(SERVED_MODEL_MODULES)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_server_stubs(root: str) -> str:
    """Stub packages for the test servers' ``PYTHONPATH`` (``root``, returned): ``vllm`` (RoPE
    binds ``vllm._custom_ops.rotary_embedding`` at construction unless sglang's CPU engine is on,
    which needs a CPU sgl-kernel build that does not exist on PyPI; the stub is never called on
    CPU: cpu-harness.md items 3 and 5) and ``flashinfer`` (:func:`write_flashinfer_stub`)."""
    pkg = os.path.join(root, "vllm")
    os.makedirs(pkg, exist_ok=True)
    with open(os.path.join(pkg, "__init__.py"), "w") as f:
        f.write('"""Test stub: lets sglang construct RoPE on a CPU-only box."""\n')
    with open(os.path.join(pkg, "_custom_ops.py"), "w") as f:
        f.write(
            "def rotary_embedding(*args, **kwargs):\n"
            "    raise RuntimeError('vllm stub: rotary_embedding is never called on CPU')\n"
        )
    return write_flashinfer_stub(root)


FLASHINFER_STUB_MESSAGE = "flashinfer is CUDA-only: a CPU test stub (test/cpu_servers.py)"


def write_flashinfer_stub(root: str) -> str:
    """A ``flashinfer`` package whose import raises ImportError, for ``root`` first on the path.

    flashinfer is a CUDA-only library, and every sglang process on this box imported the
    installed one (with ``cutlass`` under it): about 3 of a server process's 15-18 s of startup
    CPU, and the tests start about 75 server processes (and more CLI ones). Stock 0.5.23
    imports it only under ``try: ... except ImportError`` or behind ``is_flashinfer_available()``,
    which is False on a CPU (``sglang.srt.utils.common``: ``find_spec("flashinfer")`` and
    ``is_cuda()``), so with the stub each import takes the fallback it names, and nothing that
    ran on a CPU called flashinfer before. ``test_server_stubs`` checks it on stock's code.
    Test-only: the series never sees it. ``test/conftest.py`` puts it first on the test
    session's path, which the servers inherit; :func:`write_server_stubs` writes it again into
    the servers' own stub root for the launches that set ``PYTHONPATH`` from scratch (the
    patched-tree servers)."""
    pkg = os.path.join(root, "flashinfer")
    os.makedirs(pkg, exist_ok=True)
    with open(os.path.join(pkg, "__init__.py"), "w") as f:
        f.write(f"raise ImportError({FLASHINFER_STUB_MESSAGE!r})\n")
    return root


# A server's /health runs a one-token generate (stock's SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION)
# and answers once the scheduler has replied, after at least a second: a Kimi-K3 server under the
# Triton interpreter, beside other servers still starting, takes several. A 2 s probe gave up on
# nearly every answer (K3 servers "fired up" after ~150 s were seen ready after ~330 s, each
# abandoned probe leaving a health request behind). Past stock's own bound (HEALTH_CHECK_TIMEOUT,
# 20 s) the server has answered 200 or 503.
READY_PROBE_TIMEOUT_S = 30


class ServerProcess:
    """One process tree (launcher and its children), its log, and a readiness probe."""

    def __init__(self, name: str, cmd: Sequence[str], env: Dict[str, str], log_path: str,
                 ready_url: str, base_url: str):
        self.name = name
        self.cmd = list(cmd)
        self.env = env
        self.log_path = log_path
        self.ready_url = ready_url
        self.base_url = base_url
        self.proc: Optional[subprocess.Popen] = None
        self.started_at: Optional[float] = None
        self.ready_after_s: Optional[float] = None

    @property
    def port(self) -> int:
        return int(self.base_url.rsplit(":", 1)[1])

    def start(self) -> "ServerProcess":
        started_servers.append(self)
        self.started_at = time.monotonic()
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                start_new_session=True, cwd=TEST_ROOT,
            )  # fmt: skip
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _ready(self) -> bool:
        import requests

        try:
            return requests.get(self.ready_url, timeout=READY_PROBE_TIMEOUT_S).status_code == 200
        except requests.RequestException:
            return False

    def poll_ready(self, timeout_s: float) -> bool:
        """One readiness probe: True once ready; raises if the process died or time ran out."""
        if self.ready_after_s is not None:
            return True
        if not self.alive():
            raise RuntimeError(
                f"{self.name} exited with {self.proc.returncode} before it was ready; "
                f"log tail:\n{self.log_tail()}"
            )
        if self._ready():
            self.ready_after_s = time.monotonic() - self.started_at
            return True
        if time.monotonic() > self.started_at + timeout_s:
            self.dump_stacks()
            tail = self.log_tail(8000)
            self.kill()
            raise TimeoutError(
                f"{self.name} was not ready within {timeout_s:.0f} s (a startup hang?). "
                f"Stacks of its processes were dumped into {self.log_path}; tail:\n{tail}"
            )
        return False

    def wait_ready(self, timeout_s: float) -> "ServerProcess":
        wait_all([self], timeout_s)
        return self

    def family(self):
        import psutil

        if self.proc is None:
            return []
        try:
            parent = psutil.Process(self.proc.pid)
            return parent.children(recursive=True) + [parent]
        except psutil.NoSuchProcess:
            return []

    def dump_stacks(self, settle_s: float = 3.0) -> None:
        for p in self.family():
            try:
                p.send_signal(signal.SIGUSR1)
            except Exception:
                pass
        time.sleep(settle_s)

    def kill(self) -> None:
        import psutil

        family = self.family()
        for p in family:
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(family, timeout=30)
        if self.proc is not None:
            try:
                self.proc.wait(timeout=30)
            except Exception:
                pass

    def log_tail(self, n: int = 4000) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-n:]
        except OSError:
            return "<no log>"

    def log_text(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()


def sglang_env(stub_root: str, *, ranks: int = 1, pd: bool = False, spec: bool = False,
               extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    env = dict(os.environ)
    env.pop("SGLANG_USE_CPU_ENGINE", None)  # cpu-harness.md: must stay unset
    env["SGLANG_DISABLED_MODEL_ARCHS"] = unserved_model_modules()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [CPU_SUPPORT, stub_root, env.get("PYTHONPATH")]))
    if pd:
        env.update(PD_ENV)
    if spec:
        env.update(SPEC_ENV)
    if ranks > 1:
        env.update(MULTI_RANK_ENV)
        env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(str(r % max(1, os.cpu_count() or 1))
                                                      for r in range(ranks))
    env.update(extra or {})
    return env


def launch_server(name: str, root: str, model_path: str, args: Sequence[str], *,
                  stub_root: str, ranks: int = 1, pd: bool = False, spec: bool = False,
                  env: Optional[Dict[str, str]] = None) -> ServerProcess:
    """Start ``python -m sglang.launch_server`` on CPU (not waiting for it)."""
    port = free_port()
    cmd = [
        sys.executable, "-m", "sglang.launch_server", "--model-path", model_path,
        "--device", "cpu", "--host", "127.0.0.1", "--port", str(port), *args,
    ]  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    return ServerProcess(
        name, cmd, sglang_env(stub_root, ranks=ranks, pd=pd, spec=spec, extra=env),
        os.path.join(root, f"{name}.log"), base + "/health", base,
    ).start()


def launch_pd_router(name: str, root: str, prefills: Sequence[tuple], decodes: Sequence[str],
                     extra_args: Sequence[str] = ()) -> ServerProcess:
    """Start the real PD router: ``prefills`` are (base_url, bootstrap_port), ``decodes`` URLs;
    ``extra_args`` are further ``launch_router`` options. It may start beside its workers: it
    registers them once they answer, probing each second (its default is every 30 s), so the
    deployment waits for its servers and routers together."""
    port, metrics = free_port(), free_port()
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation"]
    for url, bootstrap in prefills:
        cmd += ["--prefill", url, str(bootstrap)]
    for url in decodes:
        cmd += ["--decode", url]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(metrics), "--worker-startup-check-interval", "1", *extra_args]
    base = f"http://127.0.0.1:{port}"
    # /readiness answers 200 once the router has registered healthy workers (it listens before).
    return ServerProcess(name, cmd, dict(os.environ), os.path.join(root, f"{name}.log"),
                         base + "/readiness", base).start()


# Mooncake 0.3.13.post1's TCP transport on loopback occasionally stalls every session into one
# decode: each prefill rank logs "ClientSession: no transfer progress within 30s", target-only PP
# stages (no draft bytes) included, and the decode answers 500 with TRANSPORT_STALL (seen about
# once in ten runs of the Llama module; kvcache-ai/Mooncake#4209 is the same family: the failed
# transfers' sessions come back after about 90 s). The prefill blacklists the session and probes it
# again every SGLANG_FAILED_SESSION_PROBE_INTERVAL_S (stock: 30 s, doubled after a failed probe), so
# until then every request into that decode fails the same way. That is below what these tests
# check, so such a request is sent again every TRANSPORT_STALL_WAIT_S until TRANSPORT_STALL_WINDOW_S
# after its first stall (covering the probes at about 30, 90 and 210 s); every retry is recorded,
# with the prefill-side reasons the servers' logs give, and printed in the session summary. A stall
# that outlasts the window fails the test, the reasons in its message.
TRANSPORT_STALL = "Failed to get kvcache from prefill instance"
TRANSPORT_STALL_WAIT_S = 30.0
TRANSPORT_STALL_WINDOW_S = 240.0
# What a prefill (or its Mooncake engine) logs when it fails a transfer.
TRANSFER_FAILURE = re.compile(r"no transfer progress|Failed to send|is not alive|Session \S+ failed\."
                              r"|recovered via probe|rejection|Transfer thread failed")
transport_stall_retries: List[Dict] = []
started_servers: List["ServerProcess"] = []


def transfer_failure_lines(per_server: int = 4) -> List[str]:
    """The last lines of every running server's log that name a failed transfer (the decode's
    500 carries only stock's default reason: Mooncake's status message has no reason frame)."""
    lines = []
    for server in (s for s in started_servers if s.alive()):
        try:
            with open(server.log_path, errors="replace") as f:
                hits = [l.rstrip() for l in f if TRANSFER_FAILURE.search(l)]
        except OSError:
            continue
        lines += [f"{server.name}: {l[-300:]}" for l in hits[-per_server:]]
    return lines


def generate(base_url: str, text: str, max_new_tokens: int, *, rid: Optional[str] = None,
             timeout_s: float = 300.0) -> dict:
    """One greedy ``/generate``; raises with the body on an HTTP error."""
    import requests

    body = {"text": text, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}
    if rid is not None:
        body["rid"] = rid
    first_stall = None
    while True:
        r = requests.post(base_url + "/generate", json=body, timeout=timeout_s)
        if r.status_code == 200:
            return r.json()
        if TRANSPORT_STALL not in r.text:
            break
        now = time.monotonic()
        first_stall = now if first_stall is None else first_stall
        reasons = transfer_failure_lines()
        if now - first_stall + TRANSPORT_STALL_WAIT_S > TRANSPORT_STALL_WINDOW_S:
            raise RuntimeError(
                f"POST {base_url}/generate -> {r.status_code}: {r.text[:2000]}\n"
                f"still failing {now - first_stall:.0f} s after its first transport stall; the "
                "servers' logs name these transfer failures:\n" + "\n".join(reasons))
        transport_stall_retries.append({"url": base_url, "rid": rid, "error": r.text[:300],
                                        "after_s": round(now - first_stall), "reasons": reasons})
        time.sleep(TRANSPORT_STALL_WAIT_S)
    raise RuntimeError(f"POST {base_url}/generate -> {r.status_code}: {r.text[:2000]}")


def wait_all(servers: List[ServerProcess], timeout_s: float) -> None:
    """Probe every server until all are ready (each timed from its own start); on the first
    failure kill them all and re-raise."""
    try:
        while not all([s.poll_ready(timeout_s) for s in servers]):
            time.sleep(1)
    except BaseException:
        for s in servers:
            s.kill()
        raise
