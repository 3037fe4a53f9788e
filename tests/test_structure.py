"""The package's shape: no import cycle among its files or among its packages taken as wholes, and no file or
function past the size a reader takes in at once.

Imports are read with ``ast`` from every file of ``radixkv/``: top-level ones, ones inside functions (lazy) and
ones under ``if TYPE_CHECKING:`` alike. An import names the deepest ``radixkv`` module it reaches: ``from
radixkv.cache.base import X`` is an edge to ``radixkv.cache.base``; ``from radixkv.cpu import hugepages`` to
the package ``radixkv.cpu`` (its ``__init__``) and to ``radixkv.cpu.hugepages``. A package taken as a whole is
the first level under ``radixkv`` (``radixkv.cache``, ``radixkv.cpu``, ``radixkv.engine``, ...).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_FILE_LINES, MAX_FUNCTION_LINES = 500, 60


def modules() -> dict[str, Path]:
    """Every module of radixkv by dotted name (a package by its own name)."""
    out = {}
    for path in (ROOT / "radixkv").rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the radixkv modules it imports, anywhere in the file."""
    mods = modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, up level - 1
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [base, *(f"{base}.{a.name}" for a in node.names)]
            for target in targets:
                if target.startswith("radixkv") and (found := resolve(target)) and found != name:
                    graph[name].add(found)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle a depth-first walk meets (empty when the graph is acyclic)."""
    found, done = [], set()

    def walk(node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt in path:
                found.append(path[path.index(nxt):] + [nxt])
            elif nxt not in done:
                walk(nxt, path + [nxt])
        done.add(node)

    for node in sorted(graph):
        if node not in done:
            walk(node, [node])
    return found


def unit(module: str) -> str:
    return ".".join(module.split(".")[:2])


def test_no_import_cycle_among_files():
    assert cycles(import_graph()) == []


def test_no_import_cycle_among_packages_taken_as_wholes():
    packages: dict[str, set[str]] = defaultdict(set)
    for a, targets in import_graph().items():
        for b in targets:
            if unit(a) != unit(b):
                packages[unit(a)].add(unit(b))
    assert cycles(packages) == []


def test_the_walk_sees_lazy_and_type_checking_imports(tmp_path):
    """The checker itself: an import inside a function and one under TYPE_CHECKING are edges too."""
    graph = import_graph()
    assert "radixkv.cpu" in graph["radixkv.forward"]  # build_forward imports it inside the function
    assert cycles({"a": {"b"}, "b": {"a"}}) and not cycles({"a": {"b"}, "b": set()})


def test_no_module_imports_another_modules_private_names():
    private = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("radixkv"):
                private += [f"{name}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    assert private == []


def test_no_file_or_function_too_long():
    too_long = []
    for folder in ("radixkv", "experiments"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            text = path.read_text()
            if len(text.splitlines()) > MAX_FILE_LINES:
                too_long.append(f"{path.relative_to(ROOT)}: {len(text.splitlines())} lines")
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_FUNCTION_LINES:
                        too_long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {lines} lines")
    assert too_long == []
