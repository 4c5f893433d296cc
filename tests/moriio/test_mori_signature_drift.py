"""Drift check: the mori.io surface our backend uses, and the FAKE that stands in for it,
against the real amd-mori 1.2.4 wheel.

The wheel is downloaded once per machine (cached under ~/.cache/kvtransport/mori-wheel,
or $KVT_MORI_WHEEL_CACHE) with pip and read with zipfile; nothing is installed. The tests
skip, with pip's error as the reason, only when the download is impossible.

Why ``--platform manylinux_2_39_x86_64``: the cp312 wheel of amd-mori 1.2.4 is tagged
manylinux_2_39; without the flag pip filters it out on hosts with an older glibc
(e.g. Debian 12, glibc 2.36) and reports "no matching distribution".

What is checked:
* every Python-level method the backend calls (``MORI_SURFACE["python_methods"]``) exists
  in the real ``mori/io/engine.py`` and accepts the arguments we pass — including methods
  that forward ``*args`` to a helper, whose real parameters are read from the helper;
* every method the fake implements has the real method's parameter list;
* every mori call recorded while exercising the backend is one of the declared ones, and
  every declared one was exercised (so the declaration cannot go stale);
* the names we import from ``mori.io`` are exported by the real ``mori/io/__init__.py``;
* the attribute names we use on pybind11 objects (TransferStatus methods, config fields,
  PeerFailureEvent fields) occur in the wheel's ``libmori_pybinds.so`` (a string check:
  those bindings have no Python source).
"""

from __future__ import annotations

import ast
import inspect
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from kvtransport.spi import Op, PollState
from kvtransport_moriio.backend import MORI_SURFACE

from . import fake_mori_io
from .conftest import Side
from .fake_mori_io import PeerFailureReason, make_fake_mori_io

MORI_VERSION = "1.2.4"
WHEEL_GLOB = f"amd_mori-{MORI_VERSION}-cp312-cp312-*.whl"
PIP_ARGS = [
    "download", "--no-deps", "--python-version", "3.12", "--platform", "manylinux_2_39_x86_64",
    "--only-binary=:all:", f"amd-mori=={MORI_VERSION}",
]


def _cache_dir() -> Path:
    env = os.environ.get("KVT_MORI_WHEEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "kvtransport" / "mori-wheel"


@pytest.fixture(scope="session")
def mori_wheel() -> zipfile.ZipFile:
    cache = _cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    found = sorted(cache.glob(WHEEL_GLOB))
    if not found:
        proc = subprocess.run(
            [sys.executable, "-m", "pip", *PIP_ARGS, "-d", str(cache)],
            capture_output=True, text=True, timeout=600,
        )
        found = sorted(cache.glob(WHEEL_GLOB))
        if proc.returncode != 0 or not found:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            pytest.skip(f"cannot download the amd-mori {MORI_VERSION} wheel from PyPI: {' | '.join(tail)}")
    zf = zipfile.ZipFile(found[-1])
    yield zf
    zf.close()


@pytest.fixture(scope="session")
def engine_py(mori_wheel) -> ast.Module:
    return ast.parse(mori_wheel.read("mori/io/engine.py").decode(), "mori/io/engine.py")


# --------------------------------------------------------------------------- signatures
_DEFAULT = object()


def _signature(fn: ast.FunctionDef, skip: int = 1) -> inspect.Signature:
    """An inspect.Signature for an ast function, without its first ``skip`` positional params."""
    a = fn.args
    params: list[inspect.Parameter] = []
    positional = [(p, inspect.Parameter.POSITIONAL_ONLY) for p in a.posonlyargs]
    positional += [(p, inspect.Parameter.POSITIONAL_OR_KEYWORD) for p in a.args]
    n_no_default = len(positional) - len(a.defaults)
    for i, (p, kind) in enumerate(positional):
        if i < skip:
            continue
        params.append(inspect.Parameter(p.arg, kind, default=_DEFAULT if i >= n_no_default else inspect.Parameter.empty))
    if a.vararg:
        params.append(inspect.Parameter(a.vararg.arg, inspect.Parameter.VAR_POSITIONAL))
    for p, d in zip(a.kwonlyargs, a.kw_defaults):
        params.append(inspect.Parameter(p.arg, inspect.Parameter.KEYWORD_ONLY,
                                        default=inspect.Parameter.empty if d is None else _DEFAULT))
    if a.kwarg:
        params.append(inspect.Parameter(a.kwarg.arg, inspect.Parameter.VAR_KEYWORD))
    return inspect.Signature(params)


def _classes(tree: ast.Module) -> dict[str, dict[str, ast.FunctionDef]]:
    return {
        c.name: {f.name: f for f in c.body if isinstance(f, ast.FunctionDef)}
        for c in tree.body if isinstance(c, ast.ClassDef)
    }


def effective_signature(tree: ast.Module, cls: str, method: str) -> inspect.Signature:
    """The parameters a caller really has to pass (self excluded).

    mori forwards, e.g. ``def batch_read(self, *args): return
    self._batch_single_side_transfer(self._sess.BatchRead, *args)``; the real parameters are
    then the helper's, minus ``self`` and the arguments the forwarder supplies itself.
    """
    methods = _classes(tree)[cls]
    fn = methods[method]
    a = fn.args
    if a.vararg and len(a.args) == 1 and not a.kwonlyargs and len(fn.body) == 1:
        stmt = fn.body[0]
        call = stmt.value if isinstance(stmt, ast.Return) else None
        if (
            isinstance(call, ast.Call)
            and isinstance(call.func, ast.Attribute)
            and isinstance(call.func.value, ast.Name)
            and call.func.value.id == "self"
            and call.func.attr in methods
            and call.args
            and isinstance(call.args[-1], ast.Starred)
        ):
            supplied = len(call.args) - 1
            return _signature(methods[call.func.attr], skip=1 + supplied)
    return _signature(fn)


# --------------------------------------------------------------------------- tests
def test_engine_py_is_the_wheels_and_declares_the_classes(mori_wheel, engine_py):
    classes = _classes(engine_py)
    assert {"IOEngine", "IOEngineSession"} <= set(classes)
    assert mori_wheel.read("mori/_version.py").decode().count(MORI_VERSION) == 1


@pytest.mark.parametrize("cls, method, npos", MORI_SURFACE["python_methods"],
                         ids=[f"{c}.{m}" for c, m, _ in MORI_SURFACE["python_methods"]])
def test_every_method_the_backend_calls_exists_with_compatible_signature(engine_py, cls, method, npos):
    classes = _classes(engine_py)
    assert method in classes[cls], f"mori {MORI_VERSION} {cls} has no method {method!r}"
    sig = effective_signature(engine_py, cls, method)
    try:
        sig.bind(*range(npos))
    except TypeError as exc:
        pytest.fail(f"backend calls {cls}.{method} with {npos} positional args; real signature {sig}: {exc}")


@pytest.mark.parametrize("cls", ["IOEngine", "IOEngineSession"])
def test_fake_follows_the_real_signatures(engine_py, cls):
    real = _classes(engine_py)[cls]
    fake_cls = getattr(fake_mori_io, cls)
    checked = 0
    for name, member in vars(fake_cls).items():
        if not callable(member) or (name.startswith("_") and name != "__init__"):
            continue
        assert name in real, f"the fake's {cls}.{name} does not exist in mori {MORI_VERSION}"
        real_sig = effective_signature(engine_py, cls, name)
        fake_sig = inspect.signature(member)
        fake_params = list(fake_sig.parameters.values())[1:]  # drop self
        shape = [(p.name, p.kind, p.default is not inspect.Parameter.empty) for p in fake_params]
        want = [(p.name, p.kind, p.default is not inspect.Parameter.empty) for p in real_sig.parameters.values()]
        assert shape == want, f"fake {cls}.{name}{fake_sig} drifted from mori's {real_sig}"
        checked += 1
    assert checked >= 5


def test_module_names_we_use_are_exported_by_mori_io(mori_wheel, engine_py):
    init = ast.parse(mori_wheel.read("mori/io/__init__.py").decode())
    exported: set[str] = set()
    for node in init.body:
        if isinstance(node, ast.ImportFrom):
            if any(a.name == "*" for a in node.names) and node.module == "engine":
                exported |= {c.name for c in engine_py.body if isinstance(c, ast.ClassDef)}
            exported |= {a.asname or a.name for a in node.names if a.name != "*"}
    missing = sorted(set(MORI_SURFACE["module_names"]) - exported)
    assert not missing, f"mori.io {MORI_VERSION} does not export {missing}"


def test_binding_names_we_use_exist_in_the_wheels_pybind_module(mori_wheel):
    data = mori_wheel.read("mori/libmori_pybinds.so")
    missing = [n for n in MORI_SURFACE["binding_names"] if n.encode() + b"\0" not in data]
    assert not missing, f"libmori_pybinds.so of mori {MORI_VERSION} lacks {missing}"


def _exercise_everything(io) -> None:
    """Drive every code path of the backend that touches mori."""
    a = Side("a", io, sizes=(4096, 4096))
    b = Side("b", io, sizes=(4096,), first_id=10)
    peer = a.connect(b)
    b.connect(a)
    from .test_glue_fake_mori import make_req

    for tid, op in ((1, Op.READ), (2, Op.WRITE)):
        h = a.be.post(make_req(op, tid, peer, "b", a, b, [1, 2], [0, 0], [10, 10], [0, 64], [16, 16], notify=b"n"))
        deadline = time.monotonic() + 5
        while a.be.poll(h).state is PollState.PENDING and time.monotonic() < deadline:
            io.fabric.complete_all()
        assert a.be.poll(h).state is PollState.DONE
        a.be.release(h)
    h = a.be.post(make_req(Op.READ, 3, peer, "b", a, b, [1], [0], [10], [0], [8]))
    io.fabric.inject_peer_failure(a.be.describe()["engine_key"], b.be.describe()["engine_key"],
                                  PeerFailureReason.PEER_UNREACHABLE)
    assert a.be.poll(h).state is PollState.FAILED
    with pytest.raises(RuntimeError, match="failed earlier"):
        a.be.post(make_req(Op.READ, 4, peer, "b", a, b, [1], [0], [10], [0], [8]))
    a.be.disconnect(peer)
    a.be.deregister(a.regions[1])
    a.be.close()
    b.be.close()


def test_recorded_mori_calls_match_the_declared_surface():
    io = make_fake_mori_io()
    _exercise_everything(io)
    recorded = io.fabric.methods_called()
    declared = set(MORI_SURFACE["python_methods"])
    assert recorded - declared == set(), "the backend calls mori methods missing from MORI_SURFACE"
    assert declared - recorded == set(), "MORI_SURFACE declares methods the backend never calls"
