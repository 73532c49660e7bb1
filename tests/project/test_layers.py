"""The package's folders are its layers: no import climbs, no import cycle, small route modules.

``core`` (a bucket's parts, collectives, the store) < ``compressors`` < ``exchanges`` < ``hook`` (the bucket's
route) < ``frontends`` (who hands buckets in) < ``integrations`` < ``tools`` (off the hot
path) < the package root (the public facade). A module may import from its own layer
and the ones below. Every import counts, at module level or inside a function.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from support import ROOT

PACKAGE = ROOT / "src" / "gradsift"
LAYERS = ("core", "compressors", "exchanges", "hook", "frontends", "integrations", "tools")
#: The only name taken from the root facade inside the package: the release string, which
#: packaging keeps in ``gradsift/__init__.py``.
ROOT_NAMES_ALLOWED = {"__version__"}
#: Modules of the hook's route: each under this many lines.
ROUTE_LIMIT = 400


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else len(LAYERS)


def imports(module: str) -> set[tuple[str, str | None]]:
    """``(imported module, name taken from it or None)`` for every gradsift import of ``module``."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[tuple[str, str | None]] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {(alias.name, None) for alias in node.names if alias.name.split(".")[0] == "gradsift"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            if base.split(".")[0] != "gradsift":
                continue
            for alias in node.names:
                child = f"{base}.{alias.name}"
                found.add((child, None) if child in MODULES else (base, alias.name))
    return found


GRAPH = {m: {target for target, _ in imports(m) if target in MODULES and target != m} for m in MODULES}


def test_the_layers_are_the_package_folders() -> None:
    folders = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert folders == sorted(LAYERS)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_import_climbs(module: str) -> None:
    climbing = []
    for target, name in imports(module):
        if target == "gradsift" and name in ROOT_NAMES_ALLOWED:
            continue
        if layer(target) > layer(module):
            climbing.append(target if name is None else f"{target}.{name}")
    assert not climbing, f"{module} (layer {layer(module)}) imports from above: {sorted(climbing)}"


def test_no_import_cycle() -> None:
    """Tarjan's strongly connected components over every gradsift import: all singletons."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in GRAPH[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(GRAPH):
        if module not in index:
            visit(module)
    assert not cycles, cycles


def test_the_probe_sees_a_climb_and_a_cycle() -> None:
    """Positive control: the checks above do find what they look for."""
    assert layer("gradsift.core.parts") < layer("gradsift.hook.route") < layer("gradsift.tools.cli")
    assert ("gradsift.core.payload", "Payload") in imports("gradsift.compressors.base")
    assert "gradsift.hook.state" in GRAPH["gradsift.hook.route"]
    assert "gradsift.hook.route" in GRAPH["gradsift.frontends.ddp"]


@pytest.mark.parametrize("module", sorted(m for m in MODULES if layer(m) <= LAYERS.index("hook")))
def test_route_modules_are_small(module: str) -> None:
    lines = MODULES[module].read_text(encoding="utf-8").count("\n")
    assert lines <= ROUTE_LIMIT, f"{module} has {lines} lines"
