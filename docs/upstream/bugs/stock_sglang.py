"""Run a reproduction against stock sglang 0.5.23, with no general plugin loaded.

SGLang 0.5.23 discovers general plugins through the ``sglang.srt.plugins`` entry-point group and
runs them from ``sglang.srt.plugins.load_plugins()`` (every server process calls it). The
``SGLANG_PLUGINS`` environment variable, when set, is a whitelist of entry-point names. A
reproduction calls :func:`stock_only` before it imports sglang: it sets a whitelist that names no
plugin, then :func:`load_plugins_like_a_server` calls ``load_plugins()`` exactly as a server
would, so an installed ``sglang-dflash-pp`` (or any other plugin) is discovered and skipped.
:func:`assert_stock` then proves it: no sglang-dflash-pp hook registered and no module of it
imported, and none of the stock symbols the reproduction calls is wrapped by any plugin.

``--with-plugins`` (used by this repository's tests) keeps the caller's ``SGLANG_PLUGINS`` so the
same script shows the fixed path instead. A maintainer never needs it.

Every reproduction prints one line starting with ``RESULT `` followed by JSON: ``mode``,
``sglang``, ``shows_bug`` and the bug's own ``observed`` / ``expected`` fields.
"""

from __future__ import annotations

import json
import os
import pkgutil
import sys
from typing import Iterable

NO_PLUGIN = "stock-sglang-only"  # an entry-point name no plugin uses
REQUIRED_SGLANG = "0.5.23"


def with_plugins() -> bool:
    return "--with-plugins" in sys.argv[1:]


def stock_only() -> str:
    """Call before importing sglang. Returns the mode, ``stock`` or ``with-plugins``."""
    if with_plugins():
        return "with-plugins"
    os.environ["SGLANG_PLUGINS"] = NO_PLUGIN
    return "stock"


def load_plugins_like_a_server() -> None:
    from sglang.srt.plugins import load_plugins

    load_plugins()


def _stock_symbol(target: str):
    owner_path, attr = target.rsplit(".", 1)
    owner = pkgutil.resolve_name(owner_path)
    raw = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr)
    return getattr(raw, "__func__", raw)


def wrapped(target: str) -> bool:
    """True when a plugin hook sits on ``target`` (HookRegistry wrappers set ``__wrapped__``)."""
    return getattr(_stock_symbol(target), "__wrapped__", None) is not None


def assert_stock(targets: Iterable[str]) -> None:
    """Fail unless this process runs stock sglang: no plugin hook anywhere near ``targets``."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    ours = sorted(
        t
        for t, hooks in HookRegistry._hooks.items()
        for _type, fn, _src in hooks
        if (getattr(fn, "__module__", "") or "").startswith("sglang_dflash_pp")
    )
    assert not ours, f"sglang-dflash-pp hooks are registered: {ours}"
    plugin_modules = sorted(m for m in sys.modules if m.startswith("sglang_dflash_pp"))
    assert not plugin_modules, f"plugin modules are imported: {plugin_modules}"
    hooked = [t for t in targets if wrapped(t)]
    assert not hooked, f"stock symbols are wrapped: {hooked}"


def sglang_version() -> str:
    from importlib.metadata import version

    return version("sglang")


def check_version() -> None:
    found = sglang_version()
    if found != REQUIRED_SGLANG:
        print(f"note: written against sglang {REQUIRED_SGLANG}, running on {found}", file=sys.stderr)


def report(mode: str, targets: Iterable[str], **fields) -> None:
    targets = list(targets)
    out = {
        "mode": mode,
        "sglang": sglang_version(),
        "hooked_targets": [t for t in targets if wrapped(t)],
        **fields,
    }
    print("RESULT " + json.dumps(out, sort_keys=True))


def compare(mode: str, targets: Iterable[str], bug: str, observed: dict, expected: dict,
            **fields) -> None:
    """Print what this sglang did next to the right answer, key by key, then the RESULT line."""
    width = max(len(k) for k in observed)
    for key in observed:
        print(f"  {key:{width}s} {mode}: {observed[key]}\n  {'':{width}s} right: {expected[key]}")
    report(mode, targets, bug=bug, shows_bug=observed != expected, observed=observed,
           expected=expected, **fields)


def begin(targets: Iterable[str]) -> str:
    """Load plugins as a server does; in stock mode prove none is there. Returns the mode."""
    mode = "with-plugins" if with_plugins() else "stock"
    check_version()
    load_plugins_like_a_server()
    if mode == "stock":
        assert_stock(targets)
    return mode
