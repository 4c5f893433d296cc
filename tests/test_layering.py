"""The core names no floor above it: no module of ``kvtransport/`` (its ``testing``
helpers included) imports a backend package, the vLLM connector, the bench job or vLLM,
at module level or inside a function. Backends and commands reach the core through entry
points (``kvtransport.backends``, ``kvtransport.commands``) instead."""

from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parent.parent / "kvtransport"

#: top-level packages above the core
ABOVE = ("kvtransport_", "vllm")


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
