"""Production modules carry no members that exist only for tests.

A test that needs to perturb or observe production code passes its own collaborator
(a sender, an authenticator, a fault plan) or reads state through objects the code
already exposes; it does not patch a wrapper kept for it, nor read a property kept for
it. So no production module (``kvtransport/`` outside its ``testing`` helpers, the
backends, the vLLM connector, the bench job) may:

* mark a member as a test seam (a ``# seam`` comment);
* say in a comment or docstring that something is read by tests, kept for tests, or is
  "the seam" tests replace;
* read vLLM's private connector registry (``KVConnectorFactory._registry``): the public
  ``register_connector`` is the interface, and its refusal of a known name says whether
  it is registered.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: production source trees, and the parts of them that are test helpers by purpose
PRODUCTION = ("kvtransport", "backends", "vllm_adapter", "tools")
TEST_HELPERS = (ROOT / "kvtransport" / "testing",)

SEAM_MARK = re.compile(r"#\s*seam\b", re.IGNORECASE)
#: what a comment or docstring says of a member kept only for tests
FOR_TESTS = re.compile(r"\bread by tests\b|\bfor tests\b|\bthe (?:[\w-]+ )?seam\b", re.IGNORECASE)


def production_modules(root: Path = ROOT) -> list[Path]:
    helpers = tuple(root / h.relative_to(ROOT) for h in TEST_HELPERS)
    out = []
    for top in PRODUCTION:
        for path in sorted((root / top).rglob("*.py")):
            if not any(path.is_relative_to(h) for h in helpers) and "tests" not in path.parts[len(root.parts):]:
                out.append(path)
    return out


def _comments(source: str) -> list[tuple[int, str]]:
    return [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
            if tok.type == tokenize.COMMENT]


def _docstrings(tree: ast.AST) -> list[tuple[int, str]]:
    """Every string standing alone as a statement: module, class and function docstrings
    and attribute docstrings."""
    return [(node.lineno, node.value.value) for node in ast.walk(tree)
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)]


def _registry_reads(tree: ast.AST) -> list[int]:
    """Lines reading ``KVConnectorFactory._registry``, directly or through getattr."""
    out = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr == "_registry"
                and isinstance(node.value, ast.Name) and node.value.id == "KVConnectorFactory"):
            out.append(node.lineno)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
              and len(node.args) >= 2 and isinstance(node.args[0], ast.Name)
              and node.args[0].id == "KVConnectorFactory"
              and isinstance(node.args[1], ast.Constant) and node.args[1].value == "_registry"):
            out.append(node.lineno)
    return out


def findings(path: Path, root: Path = ROOT) -> list[str]:
    source = path.read_text()
    tree = ast.parse(source, str(path))
    where = path.relative_to(root)
    out = []
    for line, text in _comments(source):
        if SEAM_MARK.search(text):
            out.append(f"{where}:{line}: '# seam' comment: {text.strip()}")
        elif FOR_TESTS.search(text):
            out.append(f"{where}:{line}: comment says a member is for tests: {text.strip()}")
    for line, text in _docstrings(tree):
        m = FOR_TESTS.search(text)
        if m:
            out.append(f"{where}:{line}: docstring says a member is for tests ({m.group(0)!r})")
    for line in _registry_reads(tree):
        out.append(f"{where}:{line}: reads vLLM's private KVConnectorFactory._registry")
    return out


def test_the_scan_sees_every_production_tree() -> None:
    modules = production_modules()
    for top in PRODUCTION:
        assert any(p.is_relative_to(ROOT / top) for p in modules), f"no module found under {top}/"
    assert not any(p.is_relative_to(ROOT / "kvtransport" / "testing") for p in modules)


def test_the_scan_finds_each_kind_of_seam(tmp_path: Path) -> None:
    """Each pattern is caught (so a clean scan below means something)."""
    (tmp_path / "kvtransport").mkdir()
    bad = tmp_path / "kvtransport" / "bad.py"
    bad.write_text('"""Module."""\n'
                   "class A:\n"
                   "    def __init__(self, auth):\n"
                   "        self._open = auth.open  # seam: a test swaps it\n"
                   "    # (read by tests and the soak harness)\n"
                   "    def _send(self):\n"
                   '        """Send one (the seam the soak tests patch)."""\n'
                   "    def _reg(self):\n"
                   '        return getattr(KVConnectorFactory, "_registry", None) or KVConnectorFactory._registry\n')
    got = findings(bad, tmp_path)
    assert len(got) == 5, got
    assert sum("_registry" in f for f in got) == 2, got


def test_no_production_module_keeps_members_for_tests() -> None:
    found = [f for p in production_modules() for f in findings(p)]
    assert found == [], "production code keeps members for tests only (pass a collaborator instead):\n" + \
        "\n".join(found)
