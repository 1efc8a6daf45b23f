"""Layers without back-arrows, read from the source (every import, also those inside functions):

    specserve.cli, specserve.app  ->  services, specserve.engine  ->  specserve.methods
        ->  specserve.runtime, specserve.glide  ->  specserve.core

core/ is pure: no I/O modules and nothing above it; only the application layer imports `services`; and
importing what the router's process imports never loads torch or transformers.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("specserve", "services")
APP = ("specserve.cli", "specserve.app")
# Modules whose job is files, processes or the network: none of them belongs in the pure core.
IO_MODULES = {"json", "os", "io", "pathlib", "shutil", "subprocess", "socket", "pickle", "tempfile"}
IO_MODULES |= {"safetensors", "requests", "grpc", "redis", "yaml", "numpy"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if not any(part.startswith(".") or part == "__pycache__" for part in path.parts):
                found[_module_name(path)] = path
    return found


@cache
def imports_of(module: str, when_imported: bool = False) -> frozenset[str]:
    """Every module `module` imports, also inside functions and `if TYPE_CHECKING:`; with
    when_imported, only what importing it runs (neither of those). `from a import b` counts a.b when
    that is a module of ours."""
    tree = ast.parse(modules()[module].read_text())
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        if when_imported and isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            return
        if when_imported and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(
                f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules()
            )
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return frozenset(names)


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def violations(owners: tuple[str, ...], forbidden: tuple[str, ...]) -> list[str]:
    return sorted(
        f"{module} imports {name}"
        for module in modules()
        if _within(module, owners)
        for name in imports_of(module)
        if _within(name, forbidden)
    )


def test_the_walk_sees_imports_inside_functions():
    # specserve.cli imports its subcommands lazily, inside functions
    assert "specserve.app.serve" in imports_of("specserve.cli")
    assert len([m for m in modules() if m.startswith("specserve.core.")]) >= 10


def test_core_is_pure():
    upward = ("specserve.engine", "specserve.methods", "specserve.runtime", "specserve.glide")
    upward += ("specserve.drafts", "specserve.models", "specserve.serving", "specserve.bench")
    upward += ("specserve.training", "specserve.client", "specserve.settings", "services", *APP)
    assert violations(("specserve.core",), upward) == []
    io = tuple(sorted(IO_MODULES))
    assert violations(("specserve.core",), io) == []


def test_runtime_and_glide_import_nothing_above_them():
    above = ("specserve.engine", "specserve.methods", "specserve.serving", "specserve.bench")
    above += ("specserve.training", "specserve.client", "services", *APP)
    assert violations(("specserve.runtime", "specserve.glide"), above) == []


def test_the_engine_and_methods_do_not_import_services_or_each_other_both_ways():
    assert violations(("specserve.methods",), ("specserve.engine",)) == []
    assert (
        violations(("specserve.engine", "specserve.methods"), ("services", "specserve.serving", *APP)) == []
    )


def test_only_the_application_layer_imports_services():
    library = tuple(m for m in modules() if m.startswith("specserve.") and not _within(m, APP))
    assert violations(library, ("services",)) == []
    assert violations(("services",), APP) == []


@pytest.mark.parametrize("entry", ["services.router.main", "specserve.client"])
def test_nothing_the_router_can_import_reaches_torch(entry):
    seen, todo = set(), [entry]
    while todo:
        module = todo.pop()
        if module in seen or module not in modules():
            continue
        seen.add(module)
        for name in imports_of(module, when_imported=True):  # importing a.b.c runs a/__init__, a/b/__init__
            parts = name.split(".")
            todo.extend(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    heavy = sorted(
        f"{m} imports {n}"
        for m in seen
        for n in imports_of(m, when_imported=True)
        if _within(n, ("torch", "transformers"))
    )
    assert heavy == []
