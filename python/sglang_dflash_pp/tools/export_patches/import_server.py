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
past its timeout, which kills it). Linux (``os.fork``) only; elsewhere ``verify`` runs cold
subprocesses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Optional, Sequence

from sglang_dflash_pp.tools.export_patches.errors import ExportError

TAG = "IMPORT_CHECK"

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
            f.write(out)
        os._exit(0)
    os.close(w)
    deadline, chunks = time.monotonic() + float(req["timeout"]), []
    while True:
        left = deadline - time.monotonic()
        ready = select.select([r], [], [], max(0.0, left))[0] if left > 0 else []
        if not ready:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(r)
            return {{"fatal": "the import check ran past %gs and was killed" % float(req["timeout"])}}
        data = os.read(r, 1 << 16)
        if not data:
            break
        chunks.append(data)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    try:
        return json.loads(b"".join(chunks))
    except ValueError:
        return {{"fatal": "the import check's child died (wait status %d)" % status}}


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

    def check(self, path: str, modules: Sequence[str], env: dict, timeout: float) -> dict:
        """The child's state (``errors``, ``sglang_file``, ``hooks``, ``plugin_modules``) after
        importing ``modules`` with ``path`` first on ``sys.path`` and ``env`` as its
        environment."""
        request = dict(env=env, path=path, modules=list(modules), timeout=timeout)
        try:
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
            for line in self._proc.stdout:
                if line.startswith(TAG + " "):
                    state = json.loads(line[len(TAG) + 1 :])
                    break
            else:
                state = None
        except (BrokenPipeError, OSError):
            state = None
        if state is None or state.get("fatal"):
            why = state["fatal"] if state else f"the import server exited ({self._proc.poll()})"
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
