"""The packages' imports form no cycle (docs/design.md's rule), counting the imports inside functions too."""

import ast

from tests.helpers import ROOT


def import_graph(packages=("ref", "fast", "placement")) -> dict[str, set[str]]:
    """module -> the modules of `packages` it imports anywhere in its file (a package stands for its __init__)."""
    files = {}
    for pkg in packages:
        for f in (ROOT / pkg).rglob("*.py"):
            name = ".".join(f.relative_to(ROOT).with_suffix("").parts)
            files[name.removesuffix(".__init__")] = f

    def module(name):  # the longest prefix that is a module of ours
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name

    graph = {m: set() for m in files}
    for m, f in files.items():
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                named = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                named = [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            graph[m] |= {module(n) for n in named} - {"", m}
    return graph


def cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of graph as its modules in order, or [] where there is none (depth-first search)."""
    state, path = {}, []

    def visit(m):
        state[m] = "open"
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                return path[path.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        state[m] = "done"
        path.pop()
        return []

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return []


def test_the_packages_import_no_cycle():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]  # the search finds one
    assert cycle({"a": {"b"}, "b": set()}) == []
    graph = import_graph()
    assert "ref.common.config" in graph["ref.model"]
    assert cycle(graph) == []
