"""Our hooks as data, and the check that every one of them is really in place.

SGLang's ``HookRegistry.apply_hooks`` logs a failure to patch a target and carries on. For
DFLASH with ``--pp-size > 1`` that is not acceptable: a stage whose worker hook is missing would
build a full draft, and a rank whose transfer hook is missing would write draft KV to the wrong
decode addresses, silently. So the configurations that depend on us call
:func:`require_hooks_applied` at startup, which names every hook that is not installed.

No sglang import here: a hook is identified by the function object we registered, found in the
closure of the wrapper that ``HookRegistry`` installed (``_wrap_fn`` closes over ``hook`` and sets
``__wrapped__`` on every wrapper, so the chain can be walked whatever other plugins stacked on it).
"""

from __future__ import annotations

import pkgutil
from dataclasses import dataclass
from typing import Callable, List


@dataclass(frozen=True)
class PluginHook:
    """One patch of an upstream 0.5.23 symbol."""

    target: str  # dotted path, as HookRegistry takes it
    hook: Callable
    hook_type: str  # "around" | "before" | "after" | "replace" (HookType values)
    why: str  # one line for logs and the applied-check error

    @property
    def name(self) -> str:
        return f"{self.hook_type.upper()} {self.target}"


_registered: List[PluginHook] = []


def record_registered(hooks) -> None:
    _registered.extend(hooks)


def registered_hooks() -> List[PluginHook]:
    return list(_registered)


def _current_attribute(target: str):
    owner_path, attr = target.rsplit(".", 1)
    owner = pkgutil.resolve_name(owner_path)
    if isinstance(owner, type):
        # Walk the MRO like attribute lookup, but keep classmethod/staticmethod wrappers out.
        for klass in owner.__mro__:
            if attr in klass.__dict__:
                raw = klass.__dict__[attr]
                return getattr(raw, "__func__", raw)
        raise AttributeError(f"{owner_path} has no attribute {attr}")
    return getattr(owner, attr)


def is_applied(hook: PluginHook) -> bool:
    """True when ``hook.hook`` sits somewhere in the wrapper chain now bound at ``hook.target``."""
    try:
        fn = _current_attribute(hook.target)
    except (ImportError, AttributeError, ValueError):
        return False
    seen = set()
    while fn is not None and id(fn) not in seen:
        seen.add(id(fn))
        if fn is hook.hook:  # a class REPLACE installs the hook itself
            return True
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                if cell.cell_contents is hook.hook:
                    return True
            except ValueError:  # empty cell
                continue
        fn = getattr(fn, "__wrapped__", None)
    return False


def unapplied_hooks() -> List[PluginHook]:
    return [h for h in _registered if not is_applied(h)]


def require_hooks_applied(configuration: str) -> None:
    """Refuse to start ``configuration`` unless every registered hook of ours is installed."""
    if not _registered:
        raise RuntimeError(
            f"{configuration} needs the sglang-dflash-pp plugin, but its hooks were never "
            "registered in this process. Check that the package is installed in this "
            "environment and that SGLANG_PLUGINS (if set) lists 'dflash_pp'."
        )
    _refuse_missing(unapplied_hooks(), f"{configuration} cannot start",
                    "Fix that error (usually a missing optional dependency of the target module) "
                    "or run without --pp-size > 1.")  # fmt: skip


def require_applied(hooks, configuration: str) -> None:
    """Refuse ``configuration`` unless every hook of ``hooks`` is installed, naming the missing."""
    _refuse_missing([h for h in hooks if not is_applied(h)], f"{configuration} needs its hooks",
                    "Fix it before serving.")  # fmt: skip


def _refuse_missing(missing: List[PluginHook], head: str, fix: str) -> None:
    if missing:
        lines = "\n".join(f"  - {h.name}: {h.why}" for h in missing)
        raise RuntimeError(
            f"{head}: {len(missing)} sglang-dflash-pp hook(s) are not installed in this "
            f"process:\n{lines}\nSGLang logged the reason as 'Failed to apply hooks to "
            f"<target>' above. {fix}"
        )
