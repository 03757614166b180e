"""Resolve ``ServerArgs`` the way ``launch_server`` does (``resolve_once`` then
``check_server_args``) and report the outcome as plain data, so the same cases can be resolved
in this process (plugin loaded) and in a subprocess where SGLang loads no plugin (stock).

Run as a script: ``python resolution.py CASES.json`` prints ``{name: outcome}`` as JSON.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Dict


def resolve(kwargs: Dict[str, Any]) -> Dict[str, Any]:
    from sglang.srt.server_args import ServerArgs

    sa = ServerArgs(**kwargs)
    try:
        sa.resolve_once()
        sa.check_server_args()
    except Exception as e:  # the outcome under test
        return {"error": f"{type(e).__name__}: {e}"}
    return {"resolved": json.loads(json.dumps(sa.resolved_dict(), default=repr))}


def main(path: str) -> None:
    from sglang.srt.plugins import load_plugins

    load_plugins()
    with open(path) as f:
        cases = json.load(f)
    print(json.dumps({name: resolve(kw) for name, kw in cases.items()}))


if __name__ == "__main__":
    main(sys.argv[1])
