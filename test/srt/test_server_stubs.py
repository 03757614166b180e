"""The ``flashinfer`` stub the test session and its servers run with
(``cpu_servers.write_flashinfer_stub``, put first on the path by ``test/conftest.py``) changes
nothing stock does on a CPU: stock's guarded imports take their fallbacks, flashinfer reports
unavailable as it does on any CPU, and neither flashinfer nor the ``cutlass`` it pulls in gets
loaded. The servers' own tests (tokens, bytes, digests) run with it; this checks the stub
itself, in a fresh interpreter that inherits this session's ``PYTHONPATH``."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys

import cpu_servers

PROBE = r"""
import json, sys
out = {}
try:
    import flashinfer  # noqa: F401
    out["import"] = "imported"
except ImportError as e:
    out["import"] = str(e)
from sglang.srt.layers.quantization import fp4_utils
from sglang.srt.utils.common import is_flashinfer_available
out["fp4_quantize"] = repr(fp4_utils.fp4_quantize)
out["available"] = is_flashinfer_available()
out["loaded"] = sorted(m for m in ("flashinfer", "cutlass") if m in sys.modules)
print("RESULT " + json.dumps(out))
"""


def test_the_flashinfer_stub_gives_stocks_cpu_fallbacks_and_loads_no_cuda_library():
    assert importlib.metadata.version("flashinfer-python")  # installed: only the stub hides it
    first = os.environ["PYTHONPATH"].split(os.pathsep)[0]  # test/conftest.py's stub root
    assert os.path.isfile(os.path.join(first, "flashinfer", "__init__.py"))
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads([x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1][7:])
    assert got["import"] == cpu_servers.FLASHINFER_STUB_MESSAGE
    assert got["fp4_quantize"] == "None"  # fp4_utils' try/except ImportError fallback
    assert got["available"] is False  # as on a CPU without the stub: is_cuda() is False
    assert got["loaded"] == []


def test_the_servers_stub_root_holds_both_stubs(tmp_path):
    root = cpu_servers.write_server_stubs(str(tmp_path / "stub"))
    assert os.path.isfile(os.path.join(root, "vllm", "_custom_ops.py"))
    with open(os.path.join(root, "flashinfer", "__init__.py")) as f:
        assert cpu_servers.FLASHINFER_STUB_MESSAGE in f.read()
