"""The project's import structure: imports point down the layers (examples -> services ->
colocate), and no two modules of colocate/ or services/ import each other, directly or
round a longer circle. Imports inside functions count (they still tie the modules at run
time); those under `if TYPE_CHECKING:` do not (type hints only, never run), except in the
stricter check that no modules of colocate/, services/ and examples/rl_loop/ import each
other even for type hints (a Protocol stands in where a type is needed)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("colocate", "services")
HINTED = ("colocate", "services", "examples/rl_loop")  # no circle even through type hints
LAYERS = ("colocate", "services", "examples")  # each imports only those before it


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_imports(path: Path, modules: set[str], hints: bool = False) -> set[str]:
    """The project modules `path` imports (`from a.b import c` counts as a.b.c when c is a
    module, else a.b); with `hints`, those imported under `if TYPE_CHECKING:` too."""
    found = set()
    tree = ast.parse(path.read_text())
    type_only = set() if hints else {id(node) for block in ast.walk(tree)
                                     if _type_checking(block)
                                     for child in block.body for node in ast.walk(child)}
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in modules else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in modules}


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def graph(packages: tuple[str, ...], hints: bool = False) -> dict[str, set[str]]:
    paths = {module_name(p): p for package in packages for p in (ROOT / package).rglob("*.py")}
    return {name: project_imports(path, set(paths), hints) - {name}
            for name, path in paths.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Each strongly connected group of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for after in edges[node]:
            if after not in index:
                visit(after)
                low[node] = min(low[node], low[after])
            elif after in stack:
                low[node] = min(low[node], index[after])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_the_cycle_finder_finds_a_circle_of_three_and_not_a_chain():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


@pytest.mark.parametrize("package", PACKAGES)
def test_no_modules_of_a_package_import_each_other(package):
    edges = graph((package,))
    edges = {m: {i for i in imported if not m.startswith(i + ".")}  # a package's own
             for m, imported in edges.items()}                      # __init__ re-exports
    assert cycles(edges) == []


def test_imports_point_down_the_layers():
    everything = graph(LAYERS)
    upward = [(module, imported) for module, imported_set in everything.items()
              for imported in imported_set
              if LAYERS.index(imported.split(".")[0]) > LAYERS.index(module.split(".")[0])]
    assert upward == []


def test_no_modules_import_each_other_even_for_type_hints():
    assert cycles(graph(HINTED, hints=True)) == []


# Inside colocate/, top to bottom as docs/architecture.md states it: a module imports only
# from its own part, from parts below it, or from the shared base (below every part).
COLOCATE_LAYERS = (
    ("colocate.phases", "colocate.testing"),
    ("colocate.engines", "colocate.resources", "colocate.planning"),
    ("colocate.arbiter",),
    ("colocate.memory", "colocate.shm_files"),
    ("colocate.telemetry",),
)
COLOCATE_BASE = ("colocate.calls", "colocate.checks", "colocate.monarch_compat",
                 "colocate.sync_bridge",
                 "colocate.abortable", "colocate.loading", "colocate.watching")


def colocate_layer(module: str) -> int | None:
    """The index of `module`'s part in COLOCATE_LAYERS (None: the base, or the package)."""
    for index, parts in enumerate(COLOCATE_LAYERS):
        if any(module == part or module.startswith(part + ".") for part in parts):
            return index
    return None


def test_the_parts_of_colocate_import_only_downward():
    upward = []
    for module, imported_set in graph(("colocate",)).items():
        own = colocate_layer(module)
        for imported in imported_set:
            theirs = colocate_layer(imported)
            if own is None and module in COLOCATE_BASE and theirs is not None:
                upward.append((module, imported))  # the base stands below every part
            elif own is not None and theirs is not None and theirs < own:
                upward.append((module, imported))
            elif own is not None and theirs == own and module.split(".")[1] \
                    != imported.split(".")[1]:
                upward.append((module, imported))  # two parts side by side: apart
    assert upward == []
    placed = {m for m in graph(("colocate",)) if colocate_layer(m) is not None}
    loose = set(graph(("colocate",))) - placed - set(COLOCATE_BASE) - {"colocate"}
    assert loose == set(), f"modules in no layer of COLOCATE_LAYERS: {sorted(loose)}"
