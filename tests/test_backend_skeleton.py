"""Every backend under ``backends/`` has the same skeleton, and what they share lives once,
in the core.

* the skeleton: a facade ``backend.py`` and ``options.py``, ``probe.py``, ``wire.py``,
  ``peers.py``, ``datapath.py`` in every backend package, one naming style (no module name
  with a leading underscore; a compiled C binding's source is the one exception);
* the shared concepts are defined only in the core: the UCX transport aliases and setting
  patterns (``kvtransport.ucx_config``), the blob envelope with the process identity
  (``kvtransport.blob``: no backend declares ``pid`` / ``start_time`` / ``boot_id`` /
  ``pid_ns`` fields or builds a ``ProcessIdentity`` from them), the options schema
  (``kvtransport.options_schema``: every ``options.py`` declares a ``SCHEMA``), and the
  peer-liveness helper (``kvtransport.process_identity.peer_alive``: no backend calls
  ``has_exited`` itself);
* no module over 500 lines and no import cycle between the modules of one backend.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BACKENDS = sorted(p for p in (ROOT / "backends").iterdir() if (p / "__init__.py").is_file())
SKELETON = ("backend.py", "options.py", "probe.py", "wire.py", "peers.py", "datapath.py")
MAX_LINES = 500


def _modules(pkg: Path) -> list[Path]:
    return sorted(pkg.glob("*.py"))


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def test_backends_were_found() -> None:
    assert {p.name for p in BACKENDS} >= {"kvtransport_loopback", "kvtransport_ucx", "kvtransport_nixl",
                                          "kvtransport_mooncake", "kvtransport_moriio"}


@pytest.mark.parametrize("pkg", BACKENDS, ids=lambda p: p.name)
def test_every_backend_has_the_skeleton_modules(pkg: Path) -> None:
    missing = [m for m in SKELETON if not (pkg / m).is_file()]
    assert missing == [], f"{pkg.name} lacks {missing}"


@pytest.mark.parametrize("pkg", BACKENDS, ids=lambda p: p.name)
def test_one_naming_style(pkg: Path) -> None:
    private = [p.name for p in _modules(pkg) if p.name.startswith("_") and p.name != "__init__.py"]
    assert private == [], f"{pkg.name}: module names with a leading underscore {private}"


@pytest.mark.parametrize("pkg", BACKENDS, ids=lambda p: p.name)
def test_options_are_declared_with_the_core_schema(pkg: Path) -> None:
    tree = _tree(pkg / "options.py")
    declared = {t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets
                if isinstance(t, ast.Name)}
    assert "SCHEMA" in declared, f"{pkg.name}/options.py declares no SCHEMA (kvtransport.options_schema)"
    assert "options_schema" in (pkg / "options.py").read_text()


@pytest.mark.parametrize("pkg", BACKENDS, ids=lambda p: p.name)
def test_the_blob_is_built_on_the_core_envelope(pkg: Path) -> None:
    text = (pkg / "wire.py").read_text()
    assert "from kvtransport.blob import" in text and "BlobCodec(" in text


_IDENTITY_FIELDS = {"pid", "start_time", "boot_id", "pid_ns"}
#: Defined only in kvtransport/ucx_config.py.
_UCX_CONFIG_NAMES = {"TLS_ALIASES", "_TLS_RE", "_KEY_RE", "_NO_PEER_FAILURE", "DEVICE_TLS_ALIAS"}


def _shared_concepts_in(path: Path) -> list[str]:
    """Where ``path`` re-defines what the core owns (a description per finding)."""
    found = []
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.ClassDef):
            fields = {s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
            if fields & _IDENTITY_FIELDS:
                found.append(f"class {node.name} declares {sorted(fields & _IDENTITY_FIELDS)}")
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = {t.id for t in targets if isinstance(t, ast.Name)}
            if names & _UCX_CONFIG_NAMES:
                found.append(f"defines {sorted(names & _UCX_CONFIG_NAMES)}")
        elif isinstance(node, ast.Call):
            fn = node.func
            name = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else ""
            if name == "ProcessIdentity" and len(node.args) + len(node.keywords) >= 3:
                found.append(f"line {node.lineno}: builds a ProcessIdentity from its fields")
            if name == "has_exited":
                found.append(f"line {node.lineno}: asks has_exited itself (use process_identity.peer_alive)")
    return found


@pytest.mark.parametrize("pkg", BACKENDS, ids=lambda p: p.name)
def test_shared_concepts_exist_only_in_the_core(pkg: Path) -> None:
    found = [f"{p.name}: {what}" for p in _modules(pkg) for what in _shared_concepts_in(p)]
    assert found == []


def test_the_core_defines_the_shared_concepts() -> None:
    from kvtransport import blob, options_schema, process_identity, ucx_config

    assert {"TLS_ALIASES", "_TLS_RE", "_KEY_RE"} <= set(vars(ucx_config))
    assert {"AgentBlob", "BlobCodec"} <= set(vars(blob))
    assert {"OptionsSchema", "Option"} <= set(vars(options_schema))
    assert "peer_alive" in vars(process_identity)


@pytest.mark.parametrize("pkg", BACKENDS, ids=lambda p: p.name)
def test_no_module_over_the_line_limit(pkg: Path) -> None:
    long = {p.name: n for p in _modules(pkg) if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def _local_imports(path: Path, pkg: Path) -> set[str]:
    """Modules of ``pkg`` that ``path`` imports (any import, TYPE_CHECKING ones included)."""
    out = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:
                if node.module:
                    out.add(node.module.split(".")[0])
                else:
                    out |= {a.name for a in node.names}
            elif node.level == 0 and node.module and node.module.split(".")[0] == pkg.name:
                rest = node.module.split(".")[1:]
                out |= {rest[0]} if rest else {a.name for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name.split(".")[1] for a in node.names if a.name.startswith(pkg.name + ".")}
    return {m for m in out if (pkg / f"{m}.py").is_file()} - {path.stem}


@pytest.mark.parametrize("pkg", BACKENDS, ids=lambda p: p.name)
def test_no_import_cycle(pkg: Path) -> None:
    graph = {p.stem: _local_imports(p, pkg) for p in _modules(pkg)}
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(m: str, path: list[str]) -> list[str] | None:
        state[m] = 1
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return [*path, m, n]
            if n not in state and (cycle := visit(n, [*path, m])):
                return cycle
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            assert (cycle := visit(m, [])) is None, f"{pkg.name}: import cycle {' -> '.join(cycle)}"
