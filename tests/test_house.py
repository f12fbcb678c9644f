"""The shape of the library: no import circles, no package loops, small files and functions, no private imports.

The import graph is built from the source with `ast`, every import counted: those inside functions and
under `TYPE_CHECKING` too, since a lazy import still ties the two modules together. `from pkg import name`
counts as importing `pkg` (its `__init__` runs) and `pkg.name` when that is a module.
"""

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "molt_hpc"
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60
# Functions allowed over MAX_FUNCTION_LINES, by "path:name".
LONG_FUNCTIONS: set[str] = set()


def module_files() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name, for its `__init__.py`)."""
    out = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The dotted name a (possibly relative) `from X import ...` names."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> Iterator[tuple[str, str, int]]:
    """(imported module, name as written, line) for every import of one file that lands in the package."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules:
                    yield alias.name, alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(module, is_package, node)
            if source in modules:
                yield source, source, node.lineno
            for alias in node.names:
                if f"{source}.{alias.name}" in modules:
                    yield f"{source}.{alias.name}", f"{source}.{alias.name}", node.lineno


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of the package it imports (itself excluded)."""
    modules = module_files()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for target, _, _ in imports_of(module, path, modules):
            if target != module:
                graph[module].add(target)
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """The components of more than one node (Tarjan's algorithm, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def package_of(module: str) -> str:
    """The top-level part of the library a module belongs to (`molt_hpc.launch`, or `molt_hpc.cli` itself)."""
    return ".".join(module.split(".")[:2])


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Top-level package -> the top-level packages its modules import."""
    out: dict[str, set[str]] = {}
    for module, targets in graph.items():
        if module == PACKAGE:
            continue
        edges = out.setdefault(package_of(module), set())
        edges.update(package_of(t) for t in targets if t != PACKAGE and package_of(t) != package_of(module))
    return out


def _explain(component: list[str], graph: dict[str, set[str]], group=lambda m: m) -> str:
    members = set(component)
    edges = sorted(f"{m} -> {t}" for m in graph if group(m) in members for t in graph[m] if group(t) in members)
    edges = [e for e in edges if group(e.split(" -> ")[0]) != group(e.split(" -> ")[1])]
    return " <-> ".join(component) + "\n    " + "\n    ".join(edges)


def test_no_module_import_circles():
    graph = import_graph()
    circles = strongly_connected(graph)
    assert not circles, "import circles:\n" + "\n".join(_explain(c, graph) for c in circles)


def test_no_package_loops():
    graph = import_graph()
    loops = strongly_connected(package_graph(graph))
    assert not loops, "package loops:\n" + "\n".join(_explain(c, graph, package_of) for c in loops)


def test_no_file_over_the_limit():
    long_files = []
    for path in module_files().values():
        lines = len(path.read_text().splitlines())
        if lines > MAX_FILE_LINES:
            long_files.append(f"{path.relative_to(ROOT)}: {lines} lines")
    assert not long_files, f"files over {MAX_FILE_LINES} lines: {long_files}"


def test_no_function_over_the_limit():
    long_functions = []
    for path in module_files().values():
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES and f"{rel}:{node.name}" not in LONG_FUNCTIONS:
                    long_functions.append(f"{rel}:{node.lineno} {node.name}: {lines} lines")
    assert not long_functions, f"functions over {MAX_FUNCTION_LINES} lines: {long_functions}"


def test_no_private_names_imported_across_modules():
    modules = module_files()
    found = []
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            source = _absolute(module, path.name == "__init__.py", node)
            if not source.startswith(PACKAGE) or source == module:
                continue
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} from {source} import {alias.name}")
    assert not found, "private names imported from another module:\n" + "\n".join(found)


def packages() -> list[Path]:
    """Every package directory of the library, sub-packages included."""
    return sorted(path.parent for path in (ROOT / PACKAGE).rglob("__init__.py"))


def direct_names(package: Path) -> list[str]:
    """The modules (file stems, `__init__` aside) and sub-packages directly inside one package."""
    modules = [p.stem for p in package.glob("*.py") if p.name != "__init__.py"]
    subpackages = [p.name for p in package.iterdir() if (p / "__init__.py").is_file()]
    return sorted(modules + subpackages)


def unmapped(package: Path) -> list[str]:
    """The direct names a package's `__init__` docstring does not mention as a whole word."""
    init = package / "__init__.py"
    doc = ast.get_docstring(ast.parse(init.read_text(), str(init))) or ""
    return [name for name in direct_names(package) if not re.search(rf"\b{re.escape(name)}\b", doc)]


def test_every_package_docstring_maps_its_files():
    missing = {package.relative_to(ROOT).as_posix(): unmapped(package) for package in packages()}
    missing = {package: names for package, names in missing.items() if names}
    assert not missing, "names missing from the package's __init__ docstring:\n" + "\n".join(
        f"{package}: {', '.join(names)}" for package, names in missing.items()
    )


def test_the_graph_sees_every_kind_of_import(tmp_path):
    """The graph code itself: lazy, TYPE_CHECKING and relative imports all make edges; a circle is found."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from pkg.a import f\n")
    (pkg / "a.py").write_text("def f():\n    from . import b\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.c\n")
    (pkg / "c.py").write_text("from pkg import a\n")
    modules = {"pkg": pkg / "__init__.py", **{f"pkg.{n}": pkg / f"{n}.py" for n in "abc"}}
    graph = {m: {t for t, _, _ in imports_of(m, p, modules) if t != m} for m, p in modules.items()}
    assert graph == {"pkg": {"pkg.a"}, "pkg.a": {"pkg", "pkg.b"}, "pkg.b": {"pkg.c"}, "pkg.c": {"pkg", "pkg.a"}}
    assert strongly_connected(graph) == [["pkg", "pkg.a", "pkg.b", "pkg.c"]]
