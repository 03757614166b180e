"""Import checks in children forked from one process that already imported sglang's third-party
dependencies: what checking every prefix of the series costs (``verify.verify_prefixes``).

A cold subprocess that imports sglang's scheduler stack spends most of its ~15 s in torch,
transformers and the other packages sglang imports, which are the same for every prefix; only
sglang itself differs from commit to commit. So the server checks the first request in a child
forked from a bare interpreter, then imports the non-sglang modules that child loaded (an import
hook keeps sglang out of the server: a package that needs sglang stays unloaded there), and forks
every later check from that state: each child inserts its tree first on ``sys.path``, takes the
tree's environment, installs the checks' import hook and imports sglang from the tree, as a cold
subprocess would (``verify`` still asserts where sglang came from).

The protocol is JSON lines: a request ``{"env", "path", "modules", "timeout"}`` on stdin, one
``IMPORT_CHECK {...}`` line on stdout per request (``{"fatal": ...}`` when the child died or ran
past its timeout). A child's own output goes to the server's stderr, never among the replies; it
runs in a process group of its own, killed when its reply is in or its timeout passed (with what
its imports started); the caller waits for a reply at most the check's timeout plus
``PRELOAD_BOUND_S``. Linux (``os.fork``) only; elsewhere ``verify`` runs cold subprocesses.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
from typing import Optional, Sequence

from sglang_dflash_pp.tools.export_patches.errors import ExportError

TAG = "IMPORT_CHECK"
# How much longer than a check's own timeout its reply may take: the server loads the third-party
# modules of its first check before it reads the next request (~10 s on a 2-core machine).
PRELOAD_BOUND_S = 300.0

_SERVER = r"""
import importlib, importlib.abc, json, os, select, signal, sys, time, traceback

_PRELUDE = {prelude!r}


class _NoSglang(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "sglang" or name.startswith("sglang."):
            raise ImportError("not in the import server: " + name)
        return None


_guard = _NoSglang()
sys.meta_path.insert(0, _guard)


def _child(req):
    os.dup2(2, 1)  # what the imports print stays off the server's replies
    os.setpgid(0, 0)  # what they start is killed with the child
    sys.meta_path.remove(_guard)
    os.environ.clear()
    os.environ.update(req["env"])
    sys.path.insert(0, req["path"])
    sys.pycache_prefix = req["env"].get("PYTHONPYCACHEPREFIX")
    sys.dont_write_bytecode = False
    importlib.invalidate_caches()
    scope = {{"__name__": "__import_check__"}}
    exec(compile(_PRELUDE, "<import-check prelude>", "exec"), scope)
    before = set(sys.modules)
    errors = {{}}
    for name in req["modules"]:
        try:
            importlib.import_module(name)
        except BaseException:
            errors[name] = traceback.format_exc(limit=-4)
    state = scope["_plugin_state"]()
    loaded = set(sys.modules) - before
    state["errors"] = errors
    state["third_party"] = sorted(m for m in loaded if not (m == "sglang" or m.startswith("sglang.")))
    return state


def _check(req):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            out = json.dumps(_child(req))
        except BaseException:
            out = json.dumps({{"fatal": traceback.format_exc(limit=-6)}})
        with os.fdopen(w, "w") as f:
            f.write(out + "\n")
        os._exit(0)
    os.close(w)
    deadline, data = time.monotonic() + float(req["timeout"]), b""
    # until the reply's newline, not EOF: a process the imports started holds the pipe open
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        ready = select.select([r], [], [], max(0.0, left))[0] if left > 0 else []
        if not ready:
            _reap(pid, r)
            return {{"fatal": "the import check ran past %gs and was killed" % float(req["timeout"])}}
        chunk = os.read(r, 1 << 16)
        if not chunk:
            break
        data += chunk
    status = _reap(pid, r)
    try:
        return json.loads(data)
    except ValueError:
        return {{"fatal": "the import check's child died (wait status %d)" % status}}


def _reap(pid, r):
    os.close(r)
    for kill in (os.killpg, os.kill):  # the child's group: whatever its imports started; the child
        try:
            kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return os.waitpid(pid, 0)[1]


preloaded = False
for line in sys.stdin:
    state = _check(json.loads(line))
    print({tag!r} + " " + json.dumps(state), flush=True)
    if not preloaded and not state.get("fatal"):
        preloaded = True
        for name in state["third_party"]:
            try:
                importlib.import_module(name)
            except BaseException:
                pass
"""


class ImportServer:
    """One server process (see the module docstring); :meth:`check` one request at a time."""

    def __init__(self, prelude: str, env: dict):
        self._stderr = tempfile.TemporaryFile(mode="w+")
        code = _SERVER.format(prelude=prelude, tag=TAG)
        self._proc = subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._stderr, text=True, env=env, cwd=tempfile.gettempdir(),
        )  # fmt: skip
        self._replies: "queue.Queue[Optional[str]]" = queue.Queue()
        threading.Thread(target=self._read_replies, daemon=True).start()

    def _read_replies(self) -> None:
        for line in self._proc.stdout:
            if line.startswith(TAG + " "):
                self._replies.put(line[len(TAG) + 1 :])
        self._replies.put(None)  # the server exited

    def check(self, path: str, modules: Sequence[str], env: dict, timeout: float) -> dict:
        """The child's state (``errors``, ``sglang_file``, ``hooks``, ``plugin_modules``) after
        importing ``modules`` with ``path`` first on ``sys.path`` and ``env`` as its
        environment."""
        request = dict(env=env, path=path, modules=list(modules), timeout=timeout)
        bound = timeout + PRELOAD_BOUND_S
        try:
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
            reply = self._replies.get(timeout=bound)
            state = None if reply is None else json.loads(reply)
            why = state.get("fatal") if state else f"the import server exited ({self._proc.poll()})"
        except (BrokenPipeError, OSError, ValueError) as e:
            rc = self._proc.poll()
            why = f"the import server exited ({rc})" if rc is not None else (
                f"the import server's reply was lost ({e!r})")
        except queue.Empty:
            self._proc.kill()
            why = f"the import server did not answer in {bound:g} s and was killed"
        if why:
            raise ExportError(f"the import check did not finish: {why}\n{self._stderr_tail()}")
        state.pop("third_party", None)
        return state

    def _stderr_tail(self, n: int = 3000) -> str:
        self._stderr.seek(0)
        return self._stderr.read()[-n:]

    def close(self) -> None:
        try:
            self._proc.stdin.close()
            self._proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self._proc.kill()
            self._proc.wait()
        self._stderr.close()


def available() -> bool:
    return hasattr(os, "fork")


def server_env(env: Optional[dict] = None) -> dict:
    """The server's own environment: the caller's, without a ``PYTHONPATH`` that could hold a
    tree (each child takes its tree's)."""
    out = dict(os.environ if env is None else env)
    out.pop("PYTHONPATH", None)
    return out
