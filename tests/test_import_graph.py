"""afm_core's import graph: no cycle between modules, and every import runs down the package order.

Every ``import`` / ``from ... import`` anywhere in a module (top level, inside a function where a cycle would only
surface at run time, under ``if TYPE_CHECKING:``) is an edge to the afm_core module it loads; a package's
``__init__.py`` is a module like any other. The order (bottom first) is :data:`LAYERS`, stated and justified in
docs/architecture.md ("Package order"): a module may import its own package and the packages of lower layers only,
so no two packages import each other.
"""

from __future__ import annotations

import ast
from pathlib import Path

from afm_core.utils.paths import repo_root

#: The package order of afm_core, bottom first (docs/architecture.md); ``jobs/`` sits above the last layer. A module
#: of a package may import that package and the packages of lower layers; packages of one layer do not import each
#: other. A new package gets a place here (and in the doc) before it can pass.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("utils",),
    ("coa",),
    ("rewards",),
    ("data",),
    ("models", "rollout", "tools"),
    ("config",),
    ("engine", "eval"),
    ("distill", "rl", "train"),
    ("launch",),
)


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


def package_of(module: str) -> str:
    """``rl`` for ``afm_core.rl.losses``; ``""`` for the top package ``afm_core`` itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def upward_imports(graph: dict[str, set[str]], layers: tuple[tuple[str, ...], ...] = LAYERS) -> list[str]:
    """Every edge of ``graph`` that breaks the order ``layers``, as ``"a.b -> c.d (b: layer i, d: layer j)"``:
    into a package of the same or a higher layer, from or into a package no layer lists, or out of the top
    package's ``__init__`` (which every import of an afm_core module runs first, so it imports nothing)."""
    layer = {package: i for i, names in enumerate(layers) for package in names}
    broken = []
    for module in sorted(graph):
        for target in sorted(graph[module]):
            source, into = package_of(module), package_of(target)
            if source == into and source:
                continue
            if source == "":
                broken.append(f"{module} -> {target} (the afm_core/__init__.py that every import runs)")
            elif source not in layer or into not in layer:
                unlisted = source if source not in layer else into
                broken.append(f"{module} -> {target} (package {unlisted!r} is in no layer)")
            elif layer[into] >= layer[source]:
                broken.append(f"{module} -> {target} ({source}: layer {layer[source]}, {into}: layer {layer[into]})")
    return broken


def mutual_package_pairs(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """The pairs of packages that import each other (directly), ``(a, b)`` with ``a < b``."""
    edges = {(package_of(m), package_of(t)) for m, targets in graph.items() for t in targets}
    return sorted((a, b) for a, b in edges if a < b and (b, a) in edges)


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


def test_every_import_runs_down_the_package_order():
    graph = import_graph(repo_root())
    packages = {package_of(m) for m in graph} - {""}
    listed = {package for names in LAYERS for package in names}
    assert packages == listed, f"packages not in LAYERS: {sorted(packages - listed)}; gone: {sorted(listed - packages)}"
    broken = upward_imports(graph)
    assert not broken, "imports that run up the package order (docs/architecture.md):\n" + "\n".join(broken)
    assert mutual_package_pairs(graph) == []


def test_the_order_check_names_a_planted_upward_import_at_function_level_type_checking_or_in_an_init(tmp_path):
    pkg = tmp_path / "afm_core"
    for package in ("utils", "coa", "launch", "rl"):
        (pkg / package).mkdir(parents=True)
        (pkg / package / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "launch" / "submit.py").write_text("import submitit\n")
    (pkg / "rl" / "losses.py").write_text("from afm_core.utils import aio\n")  # down: allowed
    (pkg / "utils" / "aio.py").write_text("def f():\n    from afm_core.launch.submit import submit\n")
    (pkg / "utils" / "hints.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from afm_core.rl import losses\n"
    )
    (pkg / "coa" / "__init__.py").write_text("from .. import rl\n")  # a package __init__, relative
    graph = import_graph(tmp_path)
    assert upward_imports(graph) == [
        "afm_core.coa -> afm_core.rl (coa: layer 1, rl: layer 7)",
        "afm_core.utils.aio -> afm_core.launch.submit (utils: layer 0, launch: layer 8)",
        "afm_core.utils.hints -> afm_core.rl.losses (utils: layer 0, rl: layer 7)",
    ]
    assert mutual_package_pairs(graph) == [("rl", "utils")]
    (pkg / "__init__.py").write_text("import afm_core.utils.aio\n")
    (pkg / "newpkg").mkdir()
    (pkg / "newpkg" / "__init__.py").write_text("")
    (pkg / "newpkg" / "x.py").write_text("from afm_core.utils import aio\n")
    broken = upward_imports(import_graph(tmp_path))
    assert "afm_core -> afm_core.utils.aio (the afm_core/__init__.py that every import runs)" in broken
    assert "afm_core.newpkg.x -> afm_core.utils.aio (package 'newpkg' is in no layer)" in broken
