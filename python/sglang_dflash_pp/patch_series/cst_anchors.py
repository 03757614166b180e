"""Where an edit of an upstream file applies: its symbol, and an anchor inside it.

A symbol is a qualified name (``Class.method``, ``function``, ``function.inner``); an anchor
is a statement (:class:`Stmt`) or an ``if`` by its test (:class:`IfTest`), matched by its
Python AST so that comments, line breaks and formatting of the upstream code do not matter.
A match must be unique within the symbol; a missing or ambiguous one raises
:class:`AnchorError` with what was looked for and, for a moved anchor, the closest candidate.
"""

from __future__ import annotations

import ast
import functools
import textwrap
from dataclasses import dataclass
from typing import Callable, List, Union

import libcst as cst

from sglang_dflash_pp.patch_series.errors import AnchorError

_EMPTY = cst.Module(body=[])


def code_of(node: cst.CSTNode) -> str:
    return _EMPTY.code_for_node(node)


@functools.lru_cache(maxsize=None)
def expr_key(code: str) -> str:
    return ast.dump(ast.parse("(" + code.strip() + "\n)", mode="eval").body)


@functools.lru_cache(maxsize=None)
def stmt_key(code: str) -> str:
    return ast.dump(ast.parse(textwrap.dedent(code)))


def one_line(code: str) -> str:
    return " ".join(code.split())


def parse_statements(code: str) -> List[cst.BaseStatement]:
    """Our snippet as statements of a block (leading comments stay with their statement)."""
    body = textwrap.indent(textwrap.dedent(code).strip("\n") + "\n", "    ")
    fn = cst.parse_module("def _():\n" + body).body[0]
    return list(fn.body.body)


# -- anchors inside a symbol -----------------------------------------------------------------


@dataclass(frozen=True)
class Stmt:
    """A simple statement line of the upstream symbol, e.g. ``Stmt("x = f(y)")``."""

    code: str

    def matches(self, node: cst.CSTNode) -> bool:
        if not isinstance(node, cst.SimpleStatementLine):
            return False
        try:
            return stmt_key(code_of(node)) == stmt_key(self.code)
        except SyntaxError:
            return False

    def __str__(self) -> str:
        return f"statement `{one_line(self.code)}`"


@dataclass(frozen=True)
class IfTest:
    """An ``if`` statement of the upstream symbol, by its test (``elif`` branches excluded)."""

    test: str

    def matches(self, node: cst.CSTNode) -> bool:
        return isinstance(node, cst.If) and expr_key(code_of(node.test)) == expr_key(self.test)

    def __str__(self) -> str:
        return f"`if {one_line(self.test)}:`"


Anchor = Union[Stmt, IfTest]


# -- finding the symbol ----------------------------------------------------------------------


class _AtSymbol(cst.CSTTransformer):
    """Apply ``fn`` to the one class or function whose qualified name is ``symbol``."""

    def __init__(self, symbol: str, fn: Callable[[cst.CSTNode], cst.CSTNode]):
        super().__init__()
        self.symbol, self.fn = symbol, fn
        self.stack: List[str] = []
        self.hits = 0

    def on_visit(self, node) -> bool:
        # A simple statement or an expression holds no def: not visited (and not rebuilt),
        # as visiting every node of a 3,000-line module cost seconds per edit.
        if isinstance(node, (cst.SimpleStatementLine, cst.BaseExpression)):
            return False
        return super().on_visit(node)

    def _enter(self, node) -> bool:
        """Whether the symbol can be this def or inside it (else its body is skipped)."""
        self.stack.append(node.name.value)
        name = ".".join(self.stack)
        return name == self.symbol or self.symbol.startswith(name + ".")

    def _leave(self, updated):
        name = ".".join(self.stack)
        self.stack.pop()
        if name != self.symbol:
            return updated
        self.hits += 1
        return self.fn(updated)

    def visit_ClassDef(self, node):
        return self._enter(node)

    def visit_FunctionDef(self, node):
        return self._enter(node)

    def leave_ClassDef(self, original, updated):
        return self._leave(updated)

    def leave_FunctionDef(self, original, updated):
        return self._leave(updated)


def at_symbol(module: cst.Module, symbol: str, fn) -> cst.Module:
    t = _AtSymbol(symbol, fn)
    out = module.visit(t)
    if t.hits == 0:
        raise AnchorError(f"no class or function `{symbol}` in this file (moved or renamed?)")
    if t.hits > 1:
        raise AnchorError(f"`{symbol}` is defined {t.hits} times in this file; ambiguous")
    return out


class _FindAll(cst.CSTVisitor):
    def __init__(self, pred):
        super().__init__()
        self.pred, self.found = pred, []

    def on_visit(self, node) -> bool:
        if self.pred(node):
            self.found.append(node)
        return True


def find_all(node: cst.CSTNode, pred) -> list:
    v = _FindAll(pred)
    node.visit(v)
    return v.found


def closest_hint(node: cst.CSTNode, anchor) -> str:
    """A hint for a moved anchor: the symbol's most similar statement or ``if`` test."""
    import difflib

    if isinstance(anchor, IfTest):
        ifs = find_all(node, lambda n: isinstance(n, cst.If))
        cands = [one_line(code_of(n.test)) for n in ifs]
        want = one_line(anchor.test)
    else:
        cands = [
            one_line(code_of(n.with_changes(leading_lines=())))
            for n in find_all(node, lambda n: isinstance(n, cst.SimpleStatementLine))
        ]
        want = one_line(anchor.code)
    best = difflib.get_close_matches(want, cands, n=1, cutoff=0.6)
    return f" (closest in the symbol: `{best[0]}`)" if best else ""


def the_one(found: list, what: str, hint: str = ""):
    if not found:
        raise AnchorError(f"{what} not found{hint}")
    if len(found) > 1:
        raise AnchorError(f"{what} found {len(found)} times; the anchor is ambiguous")
    return found[0]


class _Replace(cst.CSTTransformer):
    """Replace one node, found by identity, with ``fn(updated node)``."""

    def __init__(self, target: cst.CSTNode, fn):
        super().__init__()
        self.target, self.fn = target, fn

    def on_leave(self, original, updated):
        if original is self.target:
            return self.fn(updated)
        return updated


def replace_node(root: cst.CSTNode, target: cst.CSTNode, fn):
    return root.visit(_Replace(target, fn))


def has_docstring(block: cst.IndentedBlock) -> bool:
    if not block.body or not isinstance(block.body[0], cst.SimpleStatementLine):
        return False
    first = block.body[0].body[0]
    return isinstance(first, cst.Expr) and isinstance(
        first.value, (cst.SimpleString, cst.ConcatenatedString)
    )
