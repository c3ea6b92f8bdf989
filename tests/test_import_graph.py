"""afm_core's import graph has no cycle: every ``import`` / ``from ... import`` anywhere in a module (top level or
inside a function, where a cycle would only surface at run time) is an edge to the afm_core module it loads."""

from __future__ import annotations

import ast
from pathlib import Path

from afm_core.utils.paths import repo_root


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path, package: str = "afm_core") -> dict[str, set[str]]:
    """``{module: the package's modules it imports}`` from the source under ``root / package``."""
    files = {_module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's package, one level up per extra dot
                    anchor = name.split(".") if is_package else name.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base for alias in node.names]
            for target in targets:
                while target and target not in files:  # ``import a.b.c`` of a name inside a module: that module
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges.add(target)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_afm_core_has_no_import_cycle_counting_imports_inside_functions():
    graph = import_graph(repo_root())
    assert len(graph) > 100 and "afm_core.rl.policy_trainer" in graph["afm_core.rl.driver"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_finder_sees_an_import_made_inside_a_function(tmp_path):
    pkg = tmp_path / "afm_core"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from afm_core.b import g\n")
    (pkg / "b.py").write_text("def g():\n    from afm_core import a\n    return a\n")
    graph = import_graph(tmp_path)
    assert graph["afm_core.b"] == {"afm_core.a"}
    assert find_cycle(graph) == ["afm_core.a", "afm_core.b", "afm_core.a"]
