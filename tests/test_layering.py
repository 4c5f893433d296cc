"""Layering and module size of the production packages.

The core names no floor above it: no module of ``kvtransport/`` (its ``testing``
helpers included) imports a backend package, the vLLM connector, the bench job or vLLM,
at module level or inside a function. Backends and commands reach the core through entry
points (``kvtransport.backends``, ``kvtransport.commands``) instead.

Within each production package (``kvtransport/``, each ``backends/*/``,
``vllm_adapter/kvtransport_vllm/``, each package under ``tools/``) no two modules import
each other, directly or through others, and no module is over :data:`MAX_LINES` lines: a
module has one job, and a cycle means two modules share one.

What counts as an import for the cycle check: every ``import``/``from ... import`` that
runs when the module is imported or type-checked — at module level, including those under
``if``/``try`` and ``if TYPE_CHECKING:`` (a type-only import is still a dependency of the
design) and in class bodies — and not those inside a function body, the usual way to
defer a dependency to call time. Relative imports are resolved against the importing
module. ``from pkg import name`` is an edge to the submodule ``pkg.name`` when that module
exists, else to ``pkg`` (its ``__init__``); importing a submodule is not counted as an
import of its parent packages' ``__init__``.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORE = ROOT / "kvtransport"

#: top-level packages above the core
ABOVE = ("kvtransport_", "vllm")

#: longest a production module may be, in lines
MAX_LINES = 500


def _imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
    return out


def test_core_imports_nothing_above_it() -> None:
    modules = sorted(CORE.rglob("*.py"))
    assert len(modules) > 10  # the walk found the package
    upward = [f"{p.relative_to(CORE.parent)}:{line}: import {name}"
              for p in modules for line, name in _imports(p)
              if name.split(".")[0].startswith(ABOVE)]
    assert upward == [], "\n".join(upward)


def _production_packages() -> list[Path]:
    """The directory of each top-level production package."""
    dirs = [CORE, ROOT / "vllm_adapter" / "kvtransport_vllm"]
    dirs += sorted(p.parent for p in ROOT.glob("backends/*/__init__.py"))
    dirs += sorted(p.parent for p in ROOT.glob("tools/*/__init__.py"))
    return dirs


def _module_names(package: Path) -> dict[str, Path]:
    """Dotted name -> file of every module of ``package`` (subpackages included)."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _load_time_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Import statements outside function bodies (see the module docstring)."""
    found: list[ast.Import | ast.ImportFrom] = []
    todo: list[ast.AST] = [tree]
    while todo:
        node = todo.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append(child)
            todo.append(child)
    return found


def _edges(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Modules of the same package that module ``name`` imports at load time."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in _load_time_imports(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            if node.level:
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            targets = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in modules else prefix for a in node.names]
        out.update(t for t in targets if t in modules and t != name)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
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
                    work.append((child, iter(sorted(graph[child]))))
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
                    out.append(sorted(component))
    return out


def test_the_cycle_finder_finds_cycles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"f"}, "f": {"e"}, "g": set()}
    assert sorted(_cycles(graph)) == [["a", "b", "c"], ["e", "f"]]


def test_no_import_cycle_within_a_production_package() -> None:
    packages = _production_packages()
    assert len(packages) >= 8  # core, connector, five backends, the bench job
    found = []
    for package in packages:
        modules = _module_names(package)
        graph = {name: _edges(name, path, modules) for name, path in modules.items()}
        found += [" <-> ".join(c) for c in _cycles(graph)]
    assert found == [], "import cycles:\n" + "\n".join(found)


def test_no_production_module_is_over_the_line_limit() -> None:
    long = [f"{p.relative_to(ROOT)}: {n} lines"
            for package in _production_packages() for p in sorted(package.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert long == [], f"modules over {MAX_LINES} lines:\n" + "\n".join(long)
