"""What stops the series' commands: a patch ``git am`` refuses, or a usage problem."""

from __future__ import annotations

from typing import Optional


class PatchFailed(Exception):
    """``git am`` could not apply one patch of the series; the tree keeps the ones before."""

    def __init__(self, patch: str, detail: str):
        self.patch, self.detail = patch, detail
        super().__init__(self.message())

    def message(self) -> str:
        return f"{self.patch} does not apply: {self.detail}"


class ExportError(Exception):
    """Anything else that stops a command before it touches a tree (usage, a dirty tree)."""

    def __init__(self, message: str, hint: Optional[str] = None):
        self.hint = hint
        super().__init__(message if hint is None else f"{message}\nhint: {hint}")
