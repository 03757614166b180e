"""Edits inside upstream functions as code transformations on ``libcst``, anchored on symbols.

An edit names the upstream file (relative to the ``sglang`` package), the symbol it changes
(``Class.method``, ``function``, ``function.inner``; ``""`` for the module's imports) and, inside
that symbol, the code it hooks onto: an expression, a statement, or an ``if`` by its test. Anchors
are matched by their Python AST, so comments, line breaks and formatting of the upstream code do
not matter, and a match must be unique within the symbol. What an edit inserts is our own code,
given here as source text; the upstream code is only ever read from the tree being patched.

Every primitive raises :class:`AnchorError` with what it looked for when the symbol or the anchor
is missing (or ambiguous); the generator adds the PR, the file and the symbol. No line numbers,
no text patches. ``libcst`` round-trips a module exactly, so everything an edit does not touch
stays byte-identical.

Edits that add a declaration (an import, a parameter, a method, a class attribute) are in
:mod:`.cst_declaration_edits`; where an edit applies, in :mod:`.cst_anchors`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import libcst as cst

from sglang_dflash_pp.patch_series.cst_anchors import (
    Anchor, Stmt, at_symbol, closest_hint, code_of, expr_key, find_all,
    has_docstring, one_line, parse_statements, replace_node, the_one,
)
from sglang_dflash_pp.patch_series.errors import AnchorError


# -- the primitives --------------------------------------------------------------------------


@dataclass(frozen=True)
class Edit:
    """One change to one upstream file, anchored on ``symbol``."""

    file: str  # relative to the sglang package, e.g. "srt/managers/scheduler_pp_mixin.py"
    symbol: str  # "Class.method", "function"; "" for the module level

    def apply(self, module: cst.Module) -> cst.Module:  # pragma: no cover - abstract
        raise NotImplementedError

    def describe(self) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    def anchors(self) -> Tuple[str, ...]:
        """The upstream code this edit matches on (the only upstream text it knows)."""
        return ()


@dataclass(frozen=True)
class ReplaceExpression(Edit):
    """Replace the one expression ``old`` in ``symbol`` with ``new`` (our code)."""

    old: str = ""
    new: str = ""

    def apply(self, module):
        key = expr_key(self.old)
        kind = type(cst.parse_expression(self.old))

        def edit(node):
            found = find_all(
                node, lambda n: isinstance(n, kind) and _safe_key(n) == key
            )
            target = the_one(found, f"expression `{one_line(self.old)}`")
            new = cst.parse_expression(self.new)
            return replace_node(
                node, target, lambda old: new.with_changes(lpar=old.lpar, rpar=old.rpar)
            )

        return at_symbol(module, self.symbol, edit)

    def describe(self):
        return f"`{self.old}` -> `{self.new}`"

    def anchors(self):
        return (self.old,)


def _safe_key(node) -> Optional[str]:
    try:
        return expr_key(code_of(node))
    except SyntaxError:
        return None


@dataclass(frozen=True)
class AddKeywordArgument(Edit):
    """Pass one more keyword argument in the one call of ``call`` inside ``symbol``."""

    call: str = ""
    keyword: str = ""
    value: str = ""
    comment: Optional[str] = None  # our comment line above the new argument (one per line)
    having: Optional[str] = None  # a keyword the call already passes, where it is not unique

    def apply(self, module):
        func_key = expr_key(self.call)

        def passes(call: cst.Call) -> bool:
            return self.having is None or any(
                a.keyword is not None and a.keyword.value == self.having for a in call.args
            )

        def edit(node):
            calls = find_all(
                node,
                lambda n: isinstance(n, cst.Call)
                and _safe_key(n.func) == func_key
                and passes(n),
            )
            target = the_one(calls, f"call of `{self.call}(...)`")
            if any(a.keyword is not None and a.keyword.value == self.keyword for a in target.args):
                raise AnchorError(f"`{self.call}(...)` already passes `{self.keyword}=`")
            return replace_node(node, target, self._add)

        return at_symbol(module, self.symbol, edit)

    def _add(self, call: cst.Call) -> cst.Call:
        args = list(call.args)
        arg = cst.Arg(
            value=cst.parse_expression(self.value),
            keyword=cst.Name(self.keyword),
            equal=cst.AssignEqual(
                whitespace_before=cst.SimpleWhitespace(""),
                whitespace_after=cst.SimpleWhitespace(""),
            ),
        )
        if not args:
            return call.with_changes(args=[arg])
        last = args[-1]
        if len(args) >= 2 and isinstance(args[-2].comma, cst.Comma):
            between = args[-2].comma  # the separator the call already uses (one arg per line?)
        else:
            between = cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
        trailing = last.comma  # a trailing comma and the break before ")" stay at the end
        ws = between.whitespace_after
        if isinstance(ws, cst.ParenthesizedWhitespace):
            # not the comments that sit above the old last argument
            lines = [] if not self.comment else [
                cst.EmptyLine(indent=ws.indent, whitespace=ws.last_line,
                              comment=cst.Comment("# " + self.comment))
            ]
            between = between.with_changes(whitespace_after=ws.with_changes(empty_lines=lines))
        elif self.comment:
            raise AnchorError(f"`{self.call}(...)` is on one line; no room for a comment")
        args[-1] = last.with_changes(comma=between)
        args.append(arg.with_changes(comma=trailing))
        return call.with_changes(args=args)

    def describe(self):
        return f"`{self.call}(...)` also passes `{self.keyword}={self.value}`"

    def anchors(self):
        return (self.call,)


class _InsertAtAnchor(cst.CSTTransformer):
    def __init__(self, anchor: Anchor, stmts, where: str):
        super().__init__()
        self.anchor, self.stmts, self.where = anchor, stmts, where
        self.hits = 0

    def leave_IndentedBlock(self, original, updated):
        body = []
        for stmt in updated.body:
            if self.anchor.matches(stmt):
                self.hits += 1
                if self.where == "before":
                    # the blank lines that set the anchor apart now set our code apart too
                    blank = []
                    for line in stmt.leading_lines:
                        if line.comment is not None:
                            break
                        blank.append(line)
                    first = self.stmts[0]
                    body.append(first.with_changes(leading_lines=blank + list(first.leading_lines)))
                    body.extend(self.stmts[1:])
                    body.append(stmt.with_changes(leading_lines=stmt.leading_lines[len(blank):]))
                else:
                    body.append(stmt)
                    body.extend(self.stmts)
            else:
                body.append(stmt)
        return updated.with_changes(body=body)


@dataclass(frozen=True)
class InsertStatements(Edit):
    """Insert our statements into ``symbol``: ``after`` or ``before`` an anchor, or ``at`` the
    ``"start"`` (after the docstring) or ``"end"`` of its body."""

    code: str = ""
    after: Optional[Anchor] = None
    before: Optional[Anchor] = None
    at: Optional[str] = None

    def apply(self, module):
        given = [x for x in (self.after, self.before, self.at) if x is not None]
        if len(given) != 1:
            raise ValueError("InsertStatements takes exactly one of after=, before=, at=")
        stmts = parse_statements(self.code)

        def edit(node):
            if self.at is not None:
                body = list(node.body.body)
                if self.at == "start":
                    i = 1 if has_docstring(node.body) else 0
                    body[i:i] = stmts
                elif self.at == "end":
                    if body and isinstance(body[-1], cst.SimpleStatementLine) and isinstance(
                        body[-1].body[-1], cst.Return
                    ):
                        raise AnchorError("the body ends with a return; insert before it")
                    body.extend(stmts)
                else:
                    raise ValueError(f"at={self.at!r}")
                return node.with_changes(body=node.body.with_changes(body=body))
            anchor = self.after or self.before
            t = _InsertAtAnchor(anchor, stmts, "after" if self.after else "before")
            out = node.visit(t)
            the_one([None] * t.hits, str(anchor), closest_hint(node, anchor) if not t.hits else "")
            return out

        return at_symbol(module, self.symbol, edit)

    def describe(self):
        n = len(parse_statements(self.code))
        where = (
            f"at the {self.at}" if self.at else
            f"after {self.after}" if self.after else f"before {self.before}"
        )
        return f"{n} statement(s) of ours inserted {where}"

    def anchors(self):
        a = self.after or self.before
        return () if a is None else (getattr(a, "code", None) or getattr(a, "test"),)


def _flatten(expr: cst.BaseExpression, op: type) -> list:
    if isinstance(expr, cst.BooleanOperation) and isinstance(expr.operator, op) and not expr.lpar:
        return _flatten(expr.left, op) + [expr.right]
    return [expr]


@dataclass(frozen=True)
class WidenCondition(Edit):
    """Add one more alternative (``op="or"``) or requirement (``op="and"``) to the one condition
    ``condition`` inside ``symbol``. A parenthesised condition that spans lines gets one operand
    per line, as black lays it out."""

    condition: str = ""
    extra: str = ""
    op: str = "or"

    def apply(self, module):
        key = expr_key(self.condition)
        op_cls = {"or": cst.Or, "and": cst.And}[self.op]

        def edit(node):
            found = find_all(
                node, lambda n: isinstance(n, cst.BaseExpression) and _safe_key(n) == key
            )
            # A parenthesised expression and its content are one anchor, not two.
            outer = [n for n in found if not any(o is not n and _contains(o, n) for o in found)]
            target = the_one(outer, f"condition `{one_line(self.condition)}`")
            return replace_node(node, target, lambda old: self._widen(old, op_cls))

        return at_symbol(module, self.symbol, edit)

    def _widen(self, old: cst.BaseExpression, op_cls) -> cst.BaseExpression:
        extra = cst.parse_expression(self.extra)
        if isinstance(extra, cst.BooleanOperation) and not isinstance(extra.operator, op_cls):
            extra = extra.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
        lpar, rpar = old.lpar, old.rpar
        operands = _flatten(old.with_changes(lpar=(), rpar=()), op_cls) + [extra]
        broken = bool(lpar) and isinstance(lpar[0].whitespace_after, cst.ParenthesizedWhitespace)
        before = lpar[0].whitespace_after if broken else cst.SimpleWhitespace(" ")
        expr = operands[0]
        for operand in operands[1:]:
            expr = cst.BooleanOperation(
                left=expr,
                operator=op_cls(
                    whitespace_before=before, whitespace_after=cst.SimpleWhitespace(" ")
                ),
                right=operand,
            )
        return expr.with_changes(lpar=lpar, rpar=rpar)

    def describe(self):
        return f"condition widened: `... {self.op} {self.extra}`"

    def anchors(self):
        return (self.condition,)


def _contains(outer: cst.CSTNode, inner: cst.CSTNode) -> bool:
    return bool(find_all(outer, lambda n: n is inner))


@dataclass(frozen=True)
class GuardStatement(Edit):
    """Run the one upstream statement ``statement`` of ``symbol`` (through the statement
    ``through`` that follows it in the same block, if given) only when ``condition``."""

    statement: str = ""
    condition: str = ""
    comment: Optional[str] = None  # our comment line above the new ``if``
    through: Optional[str] = None

    def apply(self, module):
        anchor = Stmt(self.statement)
        last = Stmt(self.through) if self.through else anchor

        def edit(node):
            found = find_all(node, anchor.matches)
            target = the_one(found, str(anchor), "" if found else closest_hint(node, anchor))
            return node.visit(_GuardRun(target, last, self._guard))

        return at_symbol(module, self.symbol, edit)

    def _guard(self, stmts) -> cst.If:
        leading = list(stmts[0].leading_lines)
        if self.comment:
            leading.append(cst.EmptyLine(comment=cst.Comment("# " + self.comment)))
        body = [stmts[0].with_changes(leading_lines=())] + list(stmts[1:])
        return cst.If(
            test=cst.parse_expression(self.condition),
            body=cst.IndentedBlock(body=body),
            leading_lines=leading,
        )

    def describe(self):
        run = f" through {Stmt(self.through)}" if self.through else ""
        return f"{Stmt(self.statement)}{run} runs only if `{self.condition}`"

    def anchors(self):
        return (self.statement,)


class _GuardRun(cst.CSTTransformer):
    """Wrap the run of statements from ``first`` (by identity) through the first statement
    matching ``last`` in one ``if`` (``wrap``)."""

    def __init__(self, first: cst.CSTNode, last: Stmt, wrap):
        super().__init__()
        self.first, self.last, self.wrap = first, last, wrap
        self.done = False

    def leave_IndentedBlock(self, original, updated):
        if self.done or not any(s is self.first for s in original.body):
            return updated
        i = next(k for k, s in enumerate(original.body) if s is self.first)
        j = next(
            (k for k in range(i, len(original.body)) if self.last.matches(original.body[k])),
            None,
        )
        if j is None:
            raise AnchorError(f"{self.last} does not follow the guarded statement")
        body = list(updated.body)
        body[i : j + 1] = [self.wrap(body[i : j + 1])]
        self.done = True
        return updated.with_changes(body=body)


@dataclass(frozen=True)
class WrapStatement(Edit):
    """Run the one statement of ``symbol`` that calls ``call`` inside ``with <context>:`` (our
    code). ``rename`` (an argument name of that call, its new name) passes the call what the
    ``with`` binds (``as``) instead, where the name must keep its value after the block."""

    call: str = ""
    context: str = ""
    rename: Optional[Tuple[str, str]] = None

    def _calls(self, node) -> list:
        key = expr_key(self.call)
        return find_all(node, lambda n: isinstance(n, cst.Call) and _safe_key(n.func) == key)

    def apply(self, module):
        def edit(node):
            found = [
                s
                for s in find_all(node, lambda n: isinstance(n, cst.SimpleStatementLine))
                if self._calls(s)
            ]
            target = the_one(found, f"statement calling `{self.call}(...)`")
            return replace_node(node, target, self._wrap)

        return at_symbol(module, self.symbol, edit)

    def _wrap(self, stmt: cst.SimpleStatementLine) -> cst.With:
        if self.rename is not None:
            old, new = self.rename
            call = the_one(self._calls(stmt), f"call of `{self.call}(...)`")
            hits = [a for a in call.args if isinstance(a.value, cst.Name) and a.value.value == old]
            the_one(hits, f"argument `{old}` of `{self.call}(...)`")
            args = [a.with_changes(value=cst.Name(new)) if a in hits else a for a in call.args]
            stmt = replace_node(stmt, call, lambda c: c.with_changes(args=args))
        shell = cst.parse_statement(f"with {self.context}:\n    pass\n")
        return shell.with_changes(
            body=cst.IndentedBlock(body=[stmt.with_changes(leading_lines=())]),
            leading_lines=stmt.leading_lines,
        )

    def describe(self):
        renamed = f", passing `{self.rename[1]}` for `{self.rename[0]}`" if self.rename else ""
        return f"the statement calling `{self.call}(...)` runs in `with {self.context}`{renamed}"

    def anchors(self):
        return (self.call,)


@dataclass(frozen=True)
class ReplaceBody(Edit):
    """Replace the body of the small function ``symbol``, or of a class whose body is only
    ``pass`` (the docstring stays), with our code."""

    code: str = ""

    def apply(self, module):
        stmts = parse_statements(self.code)

        def edit(node):
            if isinstance(node, cst.ClassDef):
                rest = node.body.body[1:] if has_docstring(node.body) else node.body.body
                if [code_of(s).strip() for s in rest] != ["pass"]:
                    raise AnchorError(f"class `{self.symbol}` has a body; insert into it instead")
            elif not isinstance(node, cst.FunctionDef):
                raise AnchorError(f"`{self.symbol}` is not a function")
            keep = list(node.body.body[:1]) if has_docstring(node.body) else []
            return node.with_changes(body=node.body.with_changes(body=keep + stmts))

        return at_symbol(module, self.symbol, edit)

    def describe(self):
        return f"body replaced by {len(parse_statements(self.code))} statement(s) of ours"


@dataclass(frozen=True)
class ReplaceKeywordArgument(Edit):
    """Pass ``keyword=value`` (our code) instead of the value the one call of ``call`` inside
    ``symbol`` passes today; ``old`` is that value (the anchor, matched by AST)."""

    call: str = ""
    keyword: str = ""
    old: str = ""
    value: str = ""

    def apply(self, module):
        func_key, old_key = expr_key(self.call), expr_key(self.old)

        def edit(node):
            calls = find_all(
                node, lambda n: isinstance(n, cst.Call) and _safe_key(n.func) == func_key
            )
            target = the_one(calls, f"call of `{self.call}(...)`")
            args = [a for a in target.args if a.keyword is not None
                    and a.keyword.value == self.keyword]  # fmt: skip
            arg = the_one(args, f"`{self.call}(...)` argument `{self.keyword}=`")
            if _safe_key(arg.value) != old_key:
                raise AnchorError(
                    f"`{self.call}(...)` passes `{self.keyword}={one_line(code_of(arg.value))}`"
                    f", not `{self.old}`"
                )
            new = cst.parse_expression(self.value)
            return replace_node(node, arg.value, lambda old: new)

        return at_symbol(module, self.symbol, edit)

    def describe(self):
        return f"`{self.call}(...)` passes `{self.keyword}={self.value}` (was `{self.old}`)"

    def anchors(self):
        return (self.call, self.old)


@dataclass(frozen=True)
class ReplaceStatement(Edit):
    """Replace the one upstream statement ``statement`` of ``symbol`` with our statements
    (its leading comments and blank lines stay above ours)."""

    statement: str = ""
    code: str = ""

    def apply(self, module):
        anchor = Stmt(self.statement)
        stmts = parse_statements(self.code)

        def edit(node):
            found = find_all(node, anchor.matches)
            the_one(found, str(anchor), "" if found else closest_hint(node, anchor))
            return node.visit(_ReplaceInBlock(found[0], stmts))

        return at_symbol(module, self.symbol, edit)

    def describe(self):
        return f"{Stmt(self.statement)} replaced by {len(parse_statements(self.code))} of ours"

    def anchors(self):
        return (self.statement,)


class _ReplaceInBlock(cst.CSTTransformer):
    """Replace one statement (found by identity) of a block with several."""

    def __init__(self, target: cst.CSTNode, stmts):
        super().__init__()
        self.target, self.stmts = target, stmts

    def leave_IndentedBlock(self, original, updated):
        body = []
        for old, new in zip(original.body, updated.body):
            if old is self.target:
                first = self.stmts[0]
                leading = list(new.leading_lines) + list(first.leading_lines)
                body.append(first.with_changes(leading_lines=leading))
                body.extend(self.stmts[1:])
            else:
                body.append(new)
        return updated.with_changes(body=body)


@dataclass(frozen=True)
class AddElif(Edit):
    """Add an ``elif <test>:`` branch (our code) right after the branch of the one ``if`` or
    ``elif`` of ``symbol`` whose test is ``after_test``."""

    after_test: str = ""
    test: str = ""
    code: str = ""

    def apply(self, module):
        key = expr_key(self.after_test)

        def edit(node):
            found = find_all(
                node, lambda n: isinstance(n, cst.If) and _safe_key(n.test) == key
            )
            target = the_one(found, f"`if`/`elif` on `{one_line(self.after_test)}`")
            branch = cst.If(
                test=cst.parse_expression(self.test),
                body=cst.IndentedBlock(body=parse_statements(self.code)),
                orelse=target.orelse,
            )
            return replace_node(node, target, lambda old: old.with_changes(orelse=branch))

        return at_symbol(module, self.symbol, edit)

    def describe(self):
        return f"`elif {self.test}:` added after the branch on `{self.after_test}`"

    def anchors(self):
        return (self.after_test,)
