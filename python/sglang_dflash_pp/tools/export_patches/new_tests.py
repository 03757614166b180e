"""Our unit tests, moved in-tree with the PR whose code they test, in sglang's test layout.

A :class:`NewTest` reads one of this repository's test files (our code) and writes it where
sglang keeps such tests (``test/registered/unit/<the module's path under srt/>/test_<name>.py``),
transformed as :class:`~.new_modules.NewModule` transforms a module: imports of
``sglang_dflash_pp.srt.X`` become the in-tree modules the PRs so far created; the tests and
helpers named in ``drop`` (those that need the plugin's hooks or a test-only helper of this
repository) are left out with the imports only they used, and so is a ``sys.path`` edit that
made a sibling helper importable; an in-tree docstring can replace ours. After its imports the
file registers for sglang's CPU CI (``register_cpu_ci(est_time=..., suite=...)``, which sglang's
CI collector reads from the file's AST), and it ends with the ``__main__`` entry that collector
requires (``sys.exit(pytest.main([__file__, "-v"]))``: the CI runs ``python3 file.py``).

It refuses to write a test that would still import ``sglang_dflash_pp``, or a helper module of
this repository's ``test/`` (``tiny_models``, a harness, ...), naming the import.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Dict, Optional, Set, Tuple

import libcst as cst

from sglang_dflash_pp.tools.export_patches.cst_edits import code_of
from sglang_dflash_pp.tools.export_patches.errors import AnchorError
from sglang_dflash_pp.tools.export_patches.new_modules import (
    OUR_PACKAGE,
    PACKAGE_DIR,
    _defined_name,
    _DropImports,
    _imported_names,
    _used_names,
    _with_docstring,
    rewrite_in_tree,
)

REPO_DIR = os.path.dirname(os.path.dirname(PACKAGE_DIR))  # this repository's root
CI_REGISTER_MODULE = "sglang.test.ci.ci_register"
CPU_SUITE = "base-a-test-cpu"
# sglang's CI runs a registered file as ``python3 file.py`` and its collector refuses a file
# without an entry that runs its tests
MAIN_ENTRY = 'if __name__ == "__main__":\n    sys.exit(pytest.main([__file__, "-v"]))\n'


def helper_module_names() -> Set[str]:
    """Top-level names a file of this repository's ``test/`` can be imported as (its sibling
    modules and packages), ``conftest`` aside."""
    names: Set[str] = set()
    for d, dirs, files in os.walk(os.path.join(REPO_DIR, "test")):
        dirs[:] = [x for x in dirs if x != "__pycache__"]
        names |= {f[: -len(".py")] for f in files if f.endswith(".py")}
        names |= set(dirs)
    names.discard("conftest")
    return names


def _is_sys_path_edit(stmt) -> bool:
    """``sys.path.insert(...)`` / ``sys.path.append(...)`` at the top level."""
    if not (isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1):
        return False
    node = stmt.body[0]
    return (
        isinstance(node, cst.Expr)
        and isinstance(node.value, cst.Call)
        and code_of(node.value.func) in ("sys.path.insert", "sys.path.append")
    )


def _imports_of(module: cst.Module) -> Set[str]:
    """Every absolute module an import statement of the module names (at any depth)."""
    names: Set[str] = set()

    class V(cst.CSTVisitor):
        def visit_Import(self, node):
            names.update(code_of(a.name) for a in node.names)

        def visit_ImportFrom(self, node):
            if not node.relative and node.module is not None:
                names.add(code_of(node.module))

    module.visit(V())
    return names


def collected_tests(module: cst.Module) -> Tuple[str, ...]:
    """The tests pytest collects from the module: ``test*`` functions, ``Test*`` classes'
    ``test*`` methods (as ``Class::method``)."""
    out = []
    for stmt in module.body:
        if isinstance(stmt, cst.FunctionDef) and stmt.name.value.startswith("test"):
            out.append(stmt.name.value)
        elif isinstance(stmt, cst.ClassDef) and stmt.name.value.startswith("Test"):
            for item in stmt.body.body:
                if isinstance(item, cst.FunctionDef) and item.name.value.startswith("test"):
                    out.append(f"{stmt.name.value}::{item.name.value}")
    return tuple(out)


def _is_import(stmt) -> bool:
    return isinstance(stmt, cst.SimpleStatementLine) and all(
        isinstance(n, (cst.Import, cst.ImportFrom)) for n in stmt.body
    )


def _section(stmt) -> int:
    """isort's sections: __future__, the standard library, third party, sglang."""
    node = stmt.body[0]
    if isinstance(node, cst.ImportFrom):
        name = "" if node.module is None else code_of(node.module)
    else:
        name = code_of(node.names[0].name)
    top = name.split(".")[0]
    if top == "__future__":
        return 0
    if top in sys.stdlib_module_names:
        return 1
    return 3 if top == "sglang" else 2


def _sort_key(stmt):
    """isort's order: by section, ``import x`` before ``from x import``, then by module."""
    node = stmt.body[0]
    if isinstance(node, cst.ImportFrom):
        name = "" if node.module is None else code_of(node.module)
        return (_section(stmt), 1, name.lower())
    return (_section(stmt), 0, code_of(node.names[0].name).lower())


def _without_noqa(stmt):
    """An import no longer placed after a ``sys.path`` edit needs no ``# noqa: E402``."""
    trailing = stmt.trailing_whitespace
    comment = trailing.comment
    if comment is not None and "E402" in comment.value:
        rest = comment.value.split("E402", 1)[1].lstrip(",").strip()
        if rest and not rest.startswith("("):
            return stmt
        value = "# " + rest if rest else None
        new = cst.Comment(value) if value else None
        stmt = stmt.with_changes(
            trailing_whitespace=trailing.with_changes(
                comment=new, whitespace=trailing.whitespace if new else cst.SimpleWhitespace("")
            )
        )
    return stmt


def _with_registration(module: cst.Module, est_time: int, suite: str) -> cst.Module:
    """The module's leading imports regrouped as isort groups them (dropping imports leaves
    holes), sglang's CI registration import last, then the registration call."""
    body = list(module.body)
    start = 1 if body and _defined_name(body[0]) is None and _is_docstring(body[0]) else 0
    end = start
    while end < len(body) and _is_import(body[end]):
        end += 1
    if end == start:
        raise AnchorError("the test has no leading import to register after")
    imports = [_without_noqa(s) for s in body[start:end]]
    have = _imported_names(module)
    for name in ("sys", "pytest"):  # the __main__ entry's
        if name not in have:
            imports.append(cst.parse_statement(f"import {name}\n"))
    imports.append(cst.parse_statement(f"from {CI_REGISTER_MODULE} import register_cpu_ci\n"))
    first_lines = body[start].leading_lines
    grouped, last = [], None
    for stmt in sorted(imports, key=_sort_key):
        sec = _section(stmt)
        if not grouped:
            lines = first_lines
        else:
            lines = [cst.EmptyLine()] if sec != last else []
        grouped.append(stmt.with_changes(leading_lines=lines))
        last = sec
    call = cst.parse_statement(f'register_cpu_ci(est_time={est_time}, suite="{suite}")\n')
    call = call.with_changes(leading_lines=[cst.EmptyLine()])
    nxt = body[end:]
    if nxt:  # two blank lines before what followed the imports
        nxt[0] = nxt[0].with_changes(leading_lines=[cst.EmptyLine(), cst.EmptyLine()])
    main = cst.parse_statement(MAIN_ENTRY).with_changes(
        leading_lines=[cst.EmptyLine(), cst.EmptyLine()]
    )
    return module.with_changes(body=body[:start] + grouped + [call] + nxt + [main])


def _is_docstring(stmt) -> bool:
    return (
        isinstance(stmt, cst.SimpleStatementLine)
        and isinstance(stmt.body[0], cst.Expr)
        and isinstance(stmt.body[0].value, (cst.SimpleString, cst.ConcatenatedString))
    )


@dataclass(frozen=True)
class NewTest:
    """Move our test file ``source`` (relative to this repository) in-tree as ``target``
    (relative to sglang's repository root, under ``test/registered/``)."""

    source: str
    target: str
    est_time: int  # seconds, for sglang's CI partitioning
    drop: Tuple[str, ...] = ()  # top-level tests and helpers that stay in this repository
    docstring: Optional[str] = None  # the in-tree module docstring, replacing ours
    suite: str = CPU_SUITE

    symbol = "<new test>"

    @property
    def file(self) -> str:
        return self.target

    def _parse(self) -> cst.Module:
        with open(os.path.join(REPO_DIR, self.source)) as f:
            return cst.parse_module(f.read())

    def render(self, moved: Dict[str, str]) -> Tuple[str, Tuple[str, ...]]:
        """The in-tree text and the tests it holds; ``moved`` maps our modules already
        in-tree (this PR's included)."""
        if not self.target.startswith("test/registered/") or not os.path.basename(
            self.target
        ).startswith("test_"):
            raise AnchorError(f"{self.target} is not a test_*.py under test/registered/")
        tree = self._parse()
        before_drop = _used_names(tree)
        body, dropped = [], set()
        for stmt in tree.body:
            name = _defined_name(stmt)
            if name in self.drop:
                dropped.add(name)
                continue
            if _is_sys_path_edit(stmt):
                continue  # in-tree the test imports no sibling of ours
            body.append(stmt)
        missing = set(self.drop) - dropped
        if missing:
            raise AnchorError(f"{self.source} defines no top-level {sorted(missing)}")
        tree = tree.with_changes(body=body)
        if self.docstring is not None:
            tree = _with_docstring(tree, self.docstring)
        unused = (before_drop - _used_names(tree)) & _imported_names(tree)
        tree = tree.visit(_DropImports(unused))
        helpers = sorted(
            n for n in _imports_of(tree) if n.split(".")[0] in helper_module_names()
        )
        if helpers:
            raise AnchorError(
                f"{self.source} imports {helpers}, test-only helpers of this repository that "
                "no PR moves in-tree; drop the tests that use them"
            )
        tree = rewrite_in_tree(tree, self.source, moved, dropped,
                               "; drop the tests that use them, or move the test with a later PR")
        tree = _with_registration(tree, self.est_time, self.suite)
        text = tree.code
        if OUR_PACKAGE in text:
            raise AnchorError(
                f"the in-tree {self.target} would still name {OUR_PACKAGE}; give it an in-tree "
                "docstring or drop the code that does"
            )
        names = collected_tests(tree)
        if not names:
            raise AnchorError(f"the in-tree {self.target} would hold no test")
        return text, names

    def describe(self) -> str:
        drop = f", without {', '.join(self.drop)}" if self.drop else ""
        return f"new test from our `{self.source}`{drop}"
