"""The layout's rules, read from the import statements of the installed packages (every import counts: module level,
inside functions, and under TYPE_CHECKING): no import circles; the frontend (the api server processes) never reaches
the engine, not even through another module; nothing imports a `__main__`; the scheduler core is pure; protos/ holds
wire contracts only."""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGES = ("protos", "scheduler_service", "executor_service", "client")
Graph = dict[str, set[str]]


def package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.submodule_search_locations, name
    return Path(next(iter(spec.submodule_search_locations)))


def module_files() -> Iterator[tuple[str, Path]]:
    for package in PACKAGES:
        root = package_dir(package)
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(root.parent).with_suffix("").parts
            if "_pb2" in parts[-1]:
                continue
            yield ".".join(parts[:-1] if parts[-1] == "__init__" else parts), path


def imported_names(tree: ast.AST, module: str, is_package: bool, known: set[str] | frozenset[str] = frozenset()
                   ) -> Iterator[str]:
    """Every module an import statement names: `import a.b` names a.b; `from a import b` names a.b when that is a
    known module, else a. (A package's __init__ that runs on the way to its submodule is not an edge: Python
    finds it initialised or initialising, so it cannot form a circle that breaks.)"""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                name = f"{base}.{alias.name}"
                yield name if name in known else base


def import_graph() -> Graph:
    files = dict(module_files())
    graph: Graph = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        names = imported_names(tree, module, path.name == "__init__.py", set(files))
        graph[module] = {name for name in names if name in files and name != module}
    return graph


def strongly_connected(graph: Graph) -> list[list[str]]:
    """Tarjan's components with more than one module: each is an import circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def reachable(graph: Graph, start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for w in graph[todo.pop()] - seen:
            seen.add(w)
            todo.append(w)
    return seen


def under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


@pytest.fixture(scope="module")
def graph() -> Graph:
    return import_graph()


def test_the_graph_is_read_from_the_installed_packages(graph: Graph) -> None:
    assert "scheduler_service.engine.executor_loop" in graph["scheduler_service.engine.pool"]
    assert "scheduler_service.frontend.generation" in graph["scheduler_service.frontend.grpc_server"]
    assert len(graph) > 100


def test_no_import_circles(graph: Graph) -> None:
    assert strongly_connected(graph) == []


def test_the_circle_finder_finds_a_circle() -> None:
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_frontend_module_reaches_the_engine(graph: Graph) -> None:
    frontend = [m for m in graph if under(m, "scheduler_service.frontend")]
    assert frontend
    for module in frontend:
        engine = sorted(m for m in reachable(graph, module) if under(m, "scheduler_service.engine"))
        assert engine == [], f"{module} imports (perhaps through others) {engine}"


def test_no_module_imports_a_main(graph: Graph) -> None:
    for module, targets in graph.items():
        assert not [t for t in targets if t.endswith(".__main__")], module


def test_the_scheduler_core_imports_no_io_or_torch() -> None:
    for module, path in module_files():
        if under(module, "scheduler_service.core"):
            roots = {name.split(".")[0] for name in imported_names(ast.parse(path.read_text()), module, False)}
            assert not roots & {"torch", "grpc", "asyncio", "zmq", "aiohttp", "executor_service"}, module


def test_protos_holds_wire_contracts_only(graph: Graph) -> None:
    for module, targets in graph.items():
        if under(module, "protos"):
            assert all(under(t, "protos") for t in targets), module
