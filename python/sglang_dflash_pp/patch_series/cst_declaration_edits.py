"""Edits that add a declaration to an upstream file: an import, a parameter, a method, a
class attribute; laid out as sglang's black and isort lay them out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import libcst as cst

from sglang_dflash_pp.patch_series.cst_anchors import (
    at_symbol, code_of, has_docstring, one_line, parse_statements, the_one,
)
from sglang_dflash_pp.patch_series.cst_edits import Edit
from sglang_dflash_pp.patch_series.errors import AnchorError

LINE_LENGTH = 88  # sglang's black line length


# -- imports ---------------------------------------------------------------------------------


def _import_from_module(stmt) -> Optional[str]:
    if not isinstance(stmt, cst.SimpleStatementLine) or len(stmt.body) != 1:
        return None
    node = stmt.body[0]
    if isinstance(node, cst.ImportFrom) and not node.relative and node.module is not None:
        return code_of(node.module)
    if isinstance(node, cst.Import):
        return code_of(node.names[0].name)
    return None


def _isort_name_key(name: str):
    # isort's default order_by_type: CONSTANTS, Classes, functions; alphabetical within each.
    kind = 0 if name.isupper() else 1 if name[:1].isupper() else 2
    return (kind, name.lower())


def _render_import(module: str, names: Sequence[str]) -> cst.SimpleStatementLine:
    one = f"from {module} import {', '.join(names)}\n"
    if len(one) - 1 <= LINE_LENGTH:
        return cst.parse_statement(one)
    lines = "".join(f"    {n},\n" for n in names)
    return cst.parse_statement(f"from {module} import (\n{lines})\n")


@dataclass(frozen=True)
class AddImport(Edit):
    """``from module import names`` at module level: merged into an existing import of the same
    module, else placed in order among the file's top-level ``sglang`` imports."""

    module: str = ""
    names: Tuple[str, ...] = ()
    symbol: str = ""

    def apply(self, module):
        body = list(module.body)
        for i, stmt in enumerate(body):
            if _import_from_module(stmt) != self.module:
                continue
            if not isinstance(stmt.body[0], cst.ImportFrom):
                continue
            node = stmt.body[0]
            if isinstance(node.names, cst.ImportStar):
                return module
            have = [code_of(a.name) for a in node.names if a.asname is None]
            missing = [n for n in self.names if n not in have]
            if not missing:
                return module
            if any(a.asname is not None for a in node.names):
                raise AnchorError(f"`from {self.module} import ...` renames a name; merge by hand")
            names = sorted(have + missing, key=_isort_name_key)
            new = _render_import(self.module, names)
            body[i] = new.with_changes(leading_lines=stmt.leading_lines)
            return module.with_changes(body=body)
        new = _render_import(self.module, sorted(self.names, key=_isort_name_key))
        top = []  # indices of the leading top-level imports
        for i, stmt in enumerate(body):
            mod = _import_from_module(stmt)
            if mod is not None:
                top.append((i, mod))
            elif top and not _is_docstring_or_future(stmt):
                break
        if not top:
            raise AnchorError("no top-level import block to add an import to")
        ours = [(i, m) for i, m in top if m.split(".")[0] == self.module.split(".")[0]]
        candidates = ours or top
        at = next((i for i, m in candidates if m > self.module), candidates[-1][0] + 1)
        if at == candidates[0][0]:  # first of its group: the blank line above the group is ours
            lines = list(body[at].leading_lines)
            blank = 0
            while blank < len(lines) and lines[blank].comment is None:
                blank += 1
            new = new.with_changes(leading_lines=lines[:blank])
            body[at] = body[at].with_changes(leading_lines=lines[blank:])
        body.insert(at, new)
        return module.with_changes(body=body)

    def describe(self):
        return f"import `{', '.join(self.names)}` from `{self.module}`"


def _is_docstring_or_future(stmt) -> bool:
    if not isinstance(stmt, cst.SimpleStatementLine):
        return False
    node = stmt.body[0]
    return isinstance(node, cst.Expr) and isinstance(node.value, cst.SimpleString)


@dataclass(frozen=True)
class AddParameter(Edit):
    """Give the function ``symbol`` one more parameter with a default (our code), after its
    last positional-or-keyword parameter, laid out as its parameters are (one per line, or on
    one line). A function with ``*args`` or keyword-only parameters gets it keyword-only."""

    name: str = ""
    default: str = "None"
    annotation: Optional[str] = None

    def apply(self, module):
        def edit(node):
            if not isinstance(node, cst.FunctionDef):
                raise AnchorError(f"`{self.symbol}` is not a function")
            p = node.params
            every = list(p.posonly_params) + list(p.params) + list(p.kwonly_params)
            if any(q.name.value == self.name for q in every):
                raise AnchorError(f"`{self.symbol}` already has a parameter `{self.name}`")
            keyword_only = p.star_arg is not cst.MaybeSentinel.DEFAULT or bool(p.kwonly_params)
            field = "kwonly_params" if keyword_only else "params"
            params = list(getattr(p, field))
            if not params:
                raise AnchorError(f"`{self.symbol}` has no {field} to follow")
            spaced = self.annotation is not None  # black: `x: T = None`, `x=None`
            ws = cst.SimpleWhitespace(" " if spaced else "")
            new = cst.Param(
                name=cst.Name(self.name),
                annotation=(
                    cst.Annotation(cst.parse_expression(self.annotation)) if spaced else None
                ),
                equal=cst.AssignEqual(whitespace_before=ws, whitespace_after=ws),
                default=cst.parse_expression(self.default),
            )
            last = params[-1]
            if len(params) >= 2 and isinstance(params[-2].comma, cst.Comma):
                between = params[-2].comma
            elif isinstance(last.comma, cst.Comma):
                between = last.comma
            else:
                between = cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
            # the break before ")" (in the last parameter's comma or after it) stays at the end
            params[-1] = last.with_changes(
                comma=between, whitespace_after_param=cst.SimpleWhitespace("")
            )
            params.append(
                new.with_changes(comma=last.comma, whitespace_after_param=last.whitespace_after_param)
            )
            return node.with_changes(params=p.with_changes(**{field: params}))

        return at_symbol(module, self.symbol, edit)

    def describe(self):
        if self.annotation:
            return f"parameter `{self.name}: {self.annotation} = {self.default}` added"
        return f"parameter `{self.name}={self.default}` added"


@dataclass(frozen=True)
class AddMethod(Edit):
    """Add our method (or methods) to the class ``symbol``: after the method ``after``, or
    at the end of the class body; one blank line above each, as black lays methods out."""

    code: str = ""
    after: Optional[str] = None

    def apply(self, module):
        defs = [
            s.with_changes(
                leading_lines=[cst.EmptyLine(indent=False)]
                + [line for line in s.leading_lines if line.comment is not None]
            )
            for s in parse_statements(self.code)
        ]

        def edit(node):
            if not isinstance(node, cst.ClassDef):
                raise AnchorError(f"`{self.symbol}` is not a class")
            body = list(node.body.body)
            names = [getattr(getattr(s, "name", None), "value", None) for s in body]
            for d in defs:
                if d.name.value in names:
                    raise AnchorError(f"`{self.symbol}` already has `{d.name.value}`")
            if self.after is None:
                at = len(body)
            else:
                hits = [i for i, n in enumerate(names) if n == self.after]
                at = the_one(hits, f"method `{self.after}`") + 1
            body[at:at] = defs
            return node.with_changes(body=node.body.with_changes(body=body))

        return at_symbol(module, self.symbol, edit)

    def describe(self):
        names = [s.name.value for s in parse_statements(self.code)]
        return f"method(s) {', '.join(f'`{n}`' for n in names)} added"


@dataclass(frozen=True)
class AddClassAttribute(Edit):
    """Add ``name: annotation = value`` (or ``name = value``) to the class ``symbol``, after its
    docstring and existing class-level assignments."""

    code: str = ""

    def apply(self, module):
        stmts = parse_statements(self.code)

        def edit(node):
            if not isinstance(node, cst.ClassDef):
                raise AnchorError(f"`{self.symbol}` is not a class")
            body = list(node.body.body)
            at = 1 if has_docstring(node.body) else 0
            while at < len(body) and isinstance(body[at], cst.SimpleStatementLine):
                at += 1
            body[at:at] = stmts
            return node.with_changes(body=node.body.with_changes(body=body))

        return at_symbol(module, self.symbol, edit)

    def describe(self):
        return f"class attribute `{one_line(self.code)}` added"
