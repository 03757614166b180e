"""House rule 8: imports inside the package run one way (cli -> tools -> srt hooks -> pure
modules). Walks every ``import`` of ``python/sglang_dflash_pp`` (module level and lazy, inside
functions) and asserts the graph has no cycle."""

from __future__ import annotations

import ast
import os

PACKAGE_ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python")


def _modules():
    mods = {}
    for d, _, files in os.walk(os.path.join(PACKAGE_ROOT, "sglang_dflash_pp")):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                name = os.path.relpath(path, PACKAGE_ROOT)[:-3].replace(os.sep, ".")
                mods[name[: -len(".__init__")] if name.endswith(".__init__") else name] = path
    return mods


def import_graph():
    mods = _modules()
    graph = {m: set() for m in mods}
    for m, path in mods.items():
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.ImportFrom) and node.level:
                raise AssertionError(f"{path}: relative import; the package imports absolutely")
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            graph[m].update(n for n in names if n in mods and n != m)
    return graph


def cycles(graph):
    state, stack, found = {}, [], []

    def visit(u):
        state[u] = "open"
        stack.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == "open":
                found.append(stack[stack.index(v):] + [v])
            elif v not in state:
                visit(v)
        stack.pop()
        state[u] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return found


def test_the_package_import_graph_has_no_cycle():
    graph = import_graph()
    assert len(graph) > 40 and any(graph.values())  # the walk found the package and its imports
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c", "a"]]
