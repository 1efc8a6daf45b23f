"""The static import graph of specserve/ and services/: no import cycle among their modules, and no torch
anywhere the router can reach.

Imports are read from the source (ast), at module level and inside functions alike: an import inside a
function runs when the function is first called, and can then meet a half-imported module or pull torch
into a process just as one at the top can. Imports under `if TYPE_CHECKING:` never run, so they load
nothing (torch included), but they still tie two files together: a module that names another's type
depends on it as much as one that calls it, so they count for cycles.

tests/specserve/serving/test_router_imports_no_torch.py imports the router's entry points and looks at what
got loaded; this file adds what that cannot see, the imports inside functions that have not run yet.
"""

from __future__ import annotations

import ast
import itertools
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("specserve", "services")
ROUTER = "services.router"
NO_TORCH = ("torch",)
ENGINE = "specserve.engine"

# Cycles kept on purpose: the set of modules in the cycle -> why it is harmless. Prefer breaking a cycle
# (move the shared piece into the module that owns it, or into a small module of its own).
ALLOWED_CYCLES: dict[frozenset[str], str] = {}


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    line: int
    in_function: bool
    of_package: bool = False  # not a statement: Python runs a package's __init__ before its submodules
    type_only: bool = False  # under `if TYPE_CHECKING:`: read by the type checker, never run

    def __str__(self) -> str:
        if self.of_package:
            return f"{self.module} is in that package"
        where = ", in a function" if self.in_function else ""
        where += ", under TYPE_CHECKING" if self.type_only else ""
        return f"{self.module} line {self.line}{where}"


@dataclass
class ImportGraph:
    # module -> local module it imports -> where (the first import that runs, else the first at all)
    edges: dict[str, dict[str, Import]]
    # module -> top-level names of what it loads from outside `packages` (torch, grpc, os, ...)
    external: dict[str, dict[str, Import]]

    def reachable(self, starts: Iterable[str]) -> dict[str, tuple[str, Import] | None]:
        """Every local module that importing `starts` may load, each with the module it is first reached
        from and the import (None for a start): what they import and, as Python runs a package's
        __init__ before its submodules, their packages."""
        came_from: dict[str, tuple[str, Import] | None] = dict.fromkeys(starts)
        queue = deque(came_from)
        while queue:
            module = queue.popleft()
            parts = module.split(".")
            packages = {".".join(parts[:i]): Import(module, 0, False, True) for i in range(1, len(parts))}
            runs = {target: where for target, where in self.edges[module].items() if not where.type_only}
            for target, where in {**packages, **runs}.items():
                if target in self.edges and target not in came_from:
                    came_from[target] = (module, where)
                    queue.append(target)
        return came_from


def module_files(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    files = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join(parts)] = path
    return files


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class _Imports(ast.NodeVisitor):
    """(module named, name imported from it or None, where) of every import statement."""

    def __init__(self, module: str, is_package: bool) -> None:
        self.module = module
        self.package = module if is_package else module.rpartition(".")[0]
        self.found: list[tuple[str, str | None, Import]] = []
        self._depth = 0
        self._type_only = 0

    def visit_If(self, node: ast.If) -> None:
        if not _is_type_checking(node.test):
            self.generic_visit(node)
            return
        self.visit(node.test)
        self._type_only += 1
        for statement in node.body:
            self.visit(statement)
        self._type_only -= 1
        for statement in node.orelse:
            self.visit(statement)

    def _where(self, node: ast.stmt) -> Import:
        return Import(self.module, node.lineno, self._depth > 0, type_only=self._type_only > 0)

    def _in_function(self, node: ast.AST) -> None:
        self._depth += 1
        self.generic_visit(node)
        self._depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _in_function

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.found.append((alias.name, None, self._where(node)))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            anchor = self.package.split(".")[: len(self.package.split(".")) - (node.level - 1)]
            base = ".".join([*anchor, *([node.module] if node.module else [])])
        for alias in node.names:
            self.found.append((base, alias.name, self._where(node)))


def import_graph(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> ImportGraph:
    files = module_files(root, packages)
    graph = ImportGraph(edges={m: {} for m in files}, external={m: {} for m in files})
    for module, path in files.items():
        visitor = _Imports(module, path.name == "__init__.py")
        visitor.visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
        for named, name, where in visitor.found:
            if named.split(".")[0] not in packages:
                if not where.type_only:
                    graph.external[module].setdefault(named.split(".")[0], where)
                continue
            if name is not None and f"{named}.{name}" in files:  # `from package import submodule`
                target = f"{named}.{name}"
            else:  # the module itself, or its closest package present (generated code may be missing)
                target = named
                while target not in files and "." in target:
                    target = target.rpartition(".")[0]
            # No edge from a submodule to its package: it runs inside the package's __init__ without
            # reading the half-built namespace, unless it imports a name from it (an edge of its own).
            if target != module and target in files:
                known = graph.edges[module].get(target)
                if known is None or (known.type_only and not where.type_only):
                    graph.edges[module][target] = where
    return graph


def cycles(graph: ImportGraph) -> list[list[str]]:
    """One cycle through each strongly connected group of modules (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []
    for start in graph.edges:
        if start in index:
            continue
        work = [(start, iter(graph.edges[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, targets = work[-1]
            for target in targets:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(graph.edges[target])))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.add(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        groups.append(group)
    return [_cycle_through(graph, group) for group in groups]


def _cycle_through(graph: ImportGraph, group: set[str]) -> list[str]:
    """The shortest cycle from the group's first module (by name) back to it, staying in the group."""
    start = min(group)
    came_from: dict[str, str] = {}
    queue = deque([start])
    while queue:
        module = queue.popleft()
        for target in graph.edges[module]:
            if target == start:
                path = [module]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return [start, *reversed(path[:-1]), start]
            if target in group and target not in came_from:
                came_from[target] = module
                queue.append(target)
    raise AssertionError(f"no cycle through {sorted(group)}")


def describe(graph: ImportGraph, cycle: list[str]) -> str:
    steps = [f"{a} -> {b} ({graph.edges[a][b]})" for a, b in itertools.pairwise(cycle)]
    return "\n  ".join(steps)


@pytest.fixture(scope="module")
def graph() -> ImportGraph:
    return import_graph()


def test_no_import_cycles(graph: ImportGraph) -> None:
    found = [c for c in cycles(graph) if frozenset(c) not in ALLOWED_CYCLES]
    assert not found, "import cycles:\n" + "\n".join(f"  {describe(graph, c)}" for c in found)


def test_allowed_cycles_still_exist(graph: ImportGraph) -> None:
    """An allowance outlives its cycle only by mistake: remove it once the cycle is gone."""
    present = {frozenset(c) for c in cycles(graph)}
    assert not [sorted(c) for c in ALLOWED_CYCLES if c not in present]


def test_nothing_the_router_reaches_imports_torch(graph: ImportGraph) -> None:
    router = [m for m in graph.edges if m == ROUTER or m.startswith(ROUTER + ".")]
    assert f"{ROUTER}.servicer" in router
    came_from = graph.reachable(router)
    problems = []
    for module in came_from:
        for name in NO_TORCH:
            if name in graph.external[module]:
                steps = [f"{module} imports {name} ({graph.external[module][name]})"]
                reached, step = module, came_from[module]
                while step is not None:
                    steps.append(f"{step[0]} -> {reached} ({step[1]})")
                    reached, step = step[0], came_from[step[0]]
                problems.append("\n    ".join(reversed(steps)))
    assert not problems, "the router must not import torch:\n    " + "\n\n    ".join(problems)


def test_the_services_build_on_the_runtime_not_the_in_process_engine(graph: ImportGraph) -> None:
    """The target and draft services load their models through their roles' runtimes
    (runtime/target_runtime.py, runtime/draft_runtime.py); both roles in one process (runtime/models.py)
    and the in-process engine are the CLI's and the benchmark's, never a service's."""
    services = [m for m in graph.edges if m.startswith("services.")]
    assert "services.target.servicer" in services and "services.draft.servicer" in services
    came_from = graph.reachable(services)
    assert "specserve.runtime.target_runtime" in came_from and "specserve.runtime.draft_runtime" in came_from
    for in_process in (ENGINE, "specserve.runtime.models"):
        assert in_process not in came_from, f"{in_process} is reached from {came_from.get(in_process)}"


def test_the_walk_sees_function_and_type_checking_imports(tmp_path: Path) -> None:
    """The checks above see what they claim to: a cycle closed inside a function is one, and so is a cycle
    closed under TYPE_CHECKING; torch imported in a function is loaded, torch under TYPE_CHECKING is not,
    and neither is a module named only for the type checker."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg import b\n")
    (package / "b.py").write_text("def f():\n    from pkg.a import x\n    import torch\n")
    (package / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n    from pkg import d\n"
    )
    (package / "d.py").write_text("from pkg import c\n")
    (package / "e.py").write_text("import pkg.a\n")
    walked = import_graph(tmp_path, ("pkg",))
    assert sorted(cycles(walked)) == [["pkg.a", "pkg.b", "pkg.a"], ["pkg.c", "pkg.d", "pkg.c"]]
    assert walked.edges["pkg.b"]["pkg.a"] == Import("pkg.b", 2, in_function=True)
    assert walked.edges["pkg.c"]["pkg.d"] == Import("pkg.c", 4, in_function=False, type_only=True)
    assert "torch" in walked.external["pkg.b"]
    assert "torch" not in walked.external["pkg.c"]
    assert {"pkg.a", "pkg.b"} <= set(walked.reachable(["pkg.e"]))
    assert "pkg.d" not in walked.reachable(["pkg.c"])
