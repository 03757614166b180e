"""What stops an export, named the way ``git am`` names a patch that does not apply."""

from __future__ import annotations

from typing import Optional


class AnchorError(Exception):
    """An edit's anchor is not where the edit expects it (raised by the primitives, which do
    not know their PR; :class:`EditFailed` adds it)."""


class EditFailed(Exception):
    """One edit of one PR could not be applied: the PR, the file, the symbol and why."""

    def __init__(self, pr: str, title: str, file: str, symbol: str, detail: str):
        self.pr, self.title, self.file, self.symbol, self.detail = pr, title, file, symbol, detail
        super().__init__(self.message())

    def message(self) -> str:
        return f"PR {self.pr} does not apply: {self.file}: {self.symbol}: {self.detail}"


class NotFinished(Exception):
    """The next PR of the stack has no complete in-tree form in this generator yet."""

    def __init__(self, pr: str, title: str, reason: str):
        self.pr, self.title, self.reason = pr, title, reason
        super().__init__(f"PR {pr} is not finished in the generator: {reason}")


class ExportError(Exception):
    """Anything else that stops an export before it touches the tree (usage, a dirty tree)."""

    def __init__(self, message: str, hint: Optional[str] = None):
        self.hint = hint
        super().__init__(message if hint is None else f"{message}\nhint: {hint}")
