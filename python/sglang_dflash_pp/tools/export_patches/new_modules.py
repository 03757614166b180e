"""Our pure modules, moved in-tree as new upstream files.

A :class:`NewModule` reads one of this package's modules (our code), rewrites its imports of
``sglang_dflash_pp.srt.X`` to the in-tree module that PR (or an earlier one) created, drops the
plugin glue named in ``drop`` (a hook function, the ``HOOKS`` table) together with the imports
only that glue used, and can give the module an in-tree docstring in place of one that speaks of
hooks. It refuses to write a module that would still import the plugin, or a file that already
exists in the tree.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, Optional, Set, Tuple

import libcst as cst

from sglang_dflash_pp.tools.export_patches.cst_edits import code_of, find_all
from sglang_dflash_pp.tools.export_patches.errors import AnchorError

OUR_PACKAGE = "sglang_dflash_pp"
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def our_module_path(module: str) -> str:
    assert module.startswith(OUR_PACKAGE + "."), module
    rel = module[len(OUR_PACKAGE) + 1 :].replace(".", os.sep) + ".py"
    return os.path.join(PACKAGE_DIR, rel)


def default_in_tree_name(module: str) -> str:
    """``sglang_dflash_pp.srt.X`` -> ``sglang.srt.X``."""
    assert module.startswith(OUR_PACKAGE + ".srt."), module
    return "sglang" + module[len(OUR_PACKAGE) :]


def in_tree_path(in_tree_module: str) -> str:
    """``sglang.srt.a.b`` -> ``srt/a/b.py`` (relative to the sglang package)."""
    assert in_tree_module.startswith("sglang."), in_tree_module
    return in_tree_module[len("sglang.") :].replace(".", "/") + ".py"


def _defined_name(stmt) -> Optional[str]:
    if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
        return stmt.name.value
    if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1:
        node = stmt.body[0]
        targets = []
        if isinstance(node, cst.Assign) and len(node.targets) == 1:
            targets = [node.targets[0].target]
        elif isinstance(node, cst.AnnAssign):
            targets = [node.target]
        if targets and isinstance(targets[0], cst.Name):
            return targets[0].value
    return None


def _used_names(module: cst.Module) -> Set[str]:
    """Every name read in the module outside its import statements."""
    names: Set[str] = set()

    class V(cst.CSTVisitor):
        def visit_Import(self, node):
            return False

        def visit_ImportFrom(self, node):
            return False

        def visit_Name(self, node):
            names.add(node.value)

    module.visit(V())
    return names


def _alias_name(alias: cst.ImportAlias) -> str:
    if alias.asname is not None:
        return alias.asname.name.value
    return code_of(alias.name).split(".")[0]


class _Rewrite(cst.CSTTransformer):
    """``sglang_dflash_pp.srt.X`` imports -> the in-tree modules they moved to."""

    def __init__(self, moved: Dict[str, str]):
        super().__init__()
        self.moved = moved
        self.unmoved: Set[str] = set()

    def _map(self, name: str) -> str:
        if name == OUR_PACKAGE or name.startswith(OUR_PACKAGE + "."):
            if name in self.moved:
                return self.moved[name]
            self.unmoved.add(name)
        return name

    def leave_ImportFrom(self, original, updated):
        if updated.relative or updated.module is None:
            return updated
        name = code_of(updated.module)
        if name not in self.moved and not isinstance(updated.names, cst.ImportStar):
            sub = self._submodules(name, updated.names)
            if sub is not None:
                return sub(updated)
        new = self._map(name)
        if new != name:
            updated = updated.with_changes(module=cst.parse_expression(new))
        return updated

    def _submodules(self, package: str, aliases):
        """``from our.package import a, b`` where ``a`` and ``b`` are moved modules of one
        in-tree package: ``from in_tree.package import a2 [as a], ...``."""
        targets = [self.moved.get(f"{package}.{code_of(a.name)}") for a in aliases]
        if None in targets or len({t.rsplit(".", 1)[0] for t in targets}) != 1:
            return None
        parent = targets[0].rsplit(".", 1)[0]
        names = []
        for a, t in zip(aliases, targets):
            local = a.asname.name.value if a.asname is not None else code_of(a.name)
            base = t.rsplit(".", 1)[1]
            asname = None if local == base else cst.AsName(name=cst.Name(local))
            names.append(a.with_changes(name=cst.Name(base), asname=asname))
        return lambda node: node.with_changes(module=cst.parse_expression(parent), names=names)

    def leave_Import(self, original, updated):
        names = [
            a.with_changes(name=cst.parse_expression(self._map(code_of(a.name))))
            for a in updated.names
        ]
        return updated.with_changes(names=names)


class _DropImports(cst.CSTTransformer):
    """Remove the imported names in ``unused`` (and an import left with none)."""

    def __init__(self, unused: Set[str]):
        super().__init__()
        self.unused = unused

    def leave_SimpleStatementLine(self, original, updated):
        node = updated.body[0] if len(updated.body) == 1 else None
        if isinstance(node, (cst.Import, cst.ImportFrom)) and not isinstance(
            getattr(node, "names", None), cst.ImportStar
        ):
            keep = [a for a in node.names if _alias_name(a) not in self.unused]
            if not keep:
                return cst.RemoveFromParent()
            if len(keep) != len(node.names):
                keep[-1] = keep[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
                return updated.with_changes(body=[node.with_changes(names=keep)])
        return updated


@dataclass(frozen=True)
class NewModule:
    """Move our module ``source`` (``sglang_dflash_pp.srt...``) in-tree as ``target``."""

    source: str
    target: Optional[str] = None  # in-tree module name; default: the same path under sglang
    drop: Tuple[str, ...] = ()  # top-level names of plugin glue to leave out
    docstring: Optional[str] = None  # the in-tree module docstring, replacing ours
    values: Tuple[Tuple[str, str], ...] = ()  # (top-level constant, in-tree value), e.g. a name

    @property
    def module(self) -> str:
        return self.target or default_in_tree_name(self.source)

    @property
    def file(self) -> str:
        return in_tree_path(self.module)

    symbol = "<new module>"

    def render(self, moved: Dict[str, str]) -> str:
        """The in-tree text; ``moved`` maps our modules already in-tree (this one included)."""
        with open(our_module_path(self.source)) as f:
            tree = cst.parse_module(f.read())
        before_drop = _used_names(tree)
        body, dropped, valued = [], set(), set()
        values = dict(self.values)
        for stmt in tree.body:
            name = _defined_name(stmt)
            if name in self.drop:
                dropped.add(name)
                continue
            if name in values:
                valued.add(name)
                node = stmt.body[0].with_changes(value=cst.parse_expression(values[name]))
                stmt = stmt.with_changes(body=[node])
            body.append(stmt)
        missing = (set(self.drop) - dropped) | (set(values) - valued)
        if missing:
            raise AnchorError(f"{self.source} defines no top-level {sorted(missing)}")
        tree = tree.with_changes(body=body)
        if self.docstring is not None:
            tree = _with_docstring(tree, self.docstring)
        after_drop = _used_names(tree)
        # imports that only the dropped glue used (PluginHook, ...)
        unused = (before_drop - after_drop) & _imported_names(tree)
        tree = tree.visit(_DropImports(unused))
        tree = rewrite_in_tree(tree, self.source, moved, dropped)
        # one newline at the end, as git likes it (dropped glue may leave a blank line)
        text = tree.code.rstrip("\n") + "\n"
        if OUR_PACKAGE in text:
            raise AnchorError(
                f"the in-tree {self.module} would still name {OUR_PACKAGE}; give it an in-tree "
                "docstring or drop the code that does"
            )
        return text

    def describe(self) -> str:
        drop = f", without {', '.join(self.drop)}" if self.drop else ""
        return f"new module from our `{self.source}`{drop}"


def rewrite_in_tree(tree: cst.Module, source: str, moved: Dict[str, str], dropped: Set[str],
                    hint: str = "") -> cst.Module:
    """``tree`` (our module ``source``, its glue ``dropped``) with its imports of our modules
    rewritten to their in-tree names; refuses one that imports a module no PR up to this one
    moves, or still refers to what was dropped."""
    rewrite = _Rewrite(moved)
    tree = tree.visit(rewrite)
    if rewrite.unmoved:
        raise AnchorError(
            f"{source} imports {sorted(rewrite.unmoved)}, which no PR up to this one moves "
            f"in-tree{hint}"
        )
    still = _dropped_references(tree, dropped)
    if still:
        raise AnchorError(f"{source} still refers to dropped {sorted(still)}")
    return tree


def _imported_names(module: cst.Module) -> Set[str]:
    names: Set[str] = set()
    for stmt in module.body:
        if isinstance(stmt, cst.SimpleStatementLine):
            for node in stmt.body:
                if isinstance(node, (cst.Import, cst.ImportFrom)) and not isinstance(
                    node.names, cst.ImportStar
                ):
                    names |= {_alias_name(a) for a in node.names}
    return names


def _dropped_references(module: cst.Module, dropped: Set[str]):
    return sorted({n.value for n in find_all(module, lambda n: isinstance(n, cst.Name))} & dropped)


def _with_docstring(module: cst.Module, text: str) -> cst.Module:
    doc = cst.SimpleStatementLine(
        body=[cst.Expr(cst.SimpleString('"""' + text.strip("\n") + '\n"""'))]
    )
    body = list(module.body)
    first = body[0] if body else None
    if (
        isinstance(first, cst.SimpleStatementLine)
        and isinstance(first.body[0], cst.Expr)
        and isinstance(first.body[0].value, (cst.SimpleString, cst.ConcatenatedString))
    ):
        body[0] = doc.with_changes(leading_lines=first.leading_lines)
    else:
        body.insert(0, doc)
    return module.with_changes(body=body)
