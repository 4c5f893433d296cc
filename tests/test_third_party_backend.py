"""A third-party backend, installed for real, is found by name and passes the shipped
conformance suite with one pytest option.

The package is ``examples/example_backend`` (``kvt_example_backend``, backend
``example-memmove``). It is built and installed with pip into a temporary ``--target``
directory, exactly as a user would install a plugin, and reached only through its
entry point in the ``kvtransport.backends`` group: no kvtransport file names it.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import stevedore

import kvtransport as kvt
from kvtransport import errors
from kvtransport.registry import NAMESPACE
from kvtransport.spi import Scope

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_SRC = ROOT / "examples" / "example_backend"
NAME = "example-memmove"
BUILTIN = ("loopback", "ucx", "moriio")


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    """``pip install --no-deps --no-build-isolation --target <tmp> examples/example_backend``.

    The source is copied first because pip builds in the source tree (``build/``,
    ``*.egg-info``) and the docs directory must stay clean.
    """
    base = tmp_path_factory.mktemp("third_party")
    src, tgt = base / "src", base / "site"
    shutil.copytree(EXAMPLE_SRC, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-input",
         "--disable-pip-version-check", "--target", str(tgt), str(src)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"pip install failed:\n{proc.stdout}\n{proc.stderr}"
    eps = list(tgt.glob("kvt_example_backend-*.dist-info/entry_points.txt"))
    assert eps and f"{NAME} = kvt_example_backend:MemmoveBackend" in eps[0].read_text()
    return tgt


def _forget_stevedore_entry_points() -> None:
    """stevedore keeps each namespace's entry points in a class-level dict for the life of
    the process, so a path added later is invisible to it (see
    ``test_backend_added_to_sys_path_after_first_open_is_found``). Only the test fixtures
    reset it, to leave no trace for other tests."""
    stevedore.ExtensionManager.ENTRY_POINT_CACHE.pop(NAMESPACE, None)


@pytest.fixture
def on_path(target):
    """The target directory on ``sys.path`` of this process for one test, then removed."""
    sys.path.insert(0, str(target))
    importlib.invalidate_caches()
    _forget_stevedore_entry_points()
    try:
        yield target
    finally:
        sys.path.remove(str(target))
        sys.modules.pop("kvt_example_backend", None)
        importlib.invalidate_caches()
        _forget_stevedore_entry_points()


def _env(target: Path, tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(target), *filter(None, [env.get("PYTHONPATH")])])
    # stevedore's on-disk entry-point cache lives under $XDG_CACHE_HOME (keyed on sys.path
    # and mtimes); a private one makes the child independent of the user's cache.
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    env.pop("PYTEST_ADDOPTS", None)
    return env


def test_installed_backends_lists_the_plugin(on_path):
    names = kvt.installed_backends()
    assert NAME in names
    assert set(BUILTIN) <= set(names)
    info = {i.name: i for i in kvt.available_backends()}[NAME]
    assert info.usable, info.reason
    assert info.entry_point == "kvt_example_backend:MemmoveBackend"
    assert info.capabilities.scopes == {Scope.SAME_PROCESS}


def test_open_moves_bytes_exactly_between_two_agents(on_path):
    block, nblocks = 4096, 64
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, block * nblocks, dtype=np.uint8)
    dst = np.zeros_like(src)
    with kvt.open(NAME, name="prefill") as prefill, kvt.open(NAME, name="decode") as decode:
        assert type(prefill._backend).__module__ == "kvt_example_backend"
        rp, rd = prefill.register(src), decode.register(dst)
        peer = decode.connect(prefill.metadata())
        prefill.connect(decode.metadata())
        remote = peer.region(rp.id)
        want_src = rng.permutation(nblocks)[:20]
        want_dst = rng.permutation(nblocks)[:20]
        t = decode.read(peer, kvt.BlockLayout([(rd, 0)], block, nblocks).segments(want_dst),
                        kvt.BlockLayout([(remote, 0)], block, nblocks).segments(want_src), notify=b"pulled")
        assert t.wait(10).ok, t.status()
        got, orig = dst.reshape(nblocks, block), src.reshape(nblocks, block)
        assert np.array_equal(got[want_dst], orig[want_src])
        untouched = np.setdiff1d(np.arange(nblocks), want_dst)
        assert not got[untouched].any()
        assert [(n.peer, n.payload) for n in prefill.notifications()] == [("decode", b"pulled")]
        # The other direction: WRITE of unaligned byte ranges.
        t = decode.write(peer, rd.segments([3, 5000], [7, 1000]), remote.segments([100, 9001], [7, 1000]))
        assert t.wait(10).ok
        assert np.array_equal(src[100:107], dst[3:10]) and np.array_equal(src[9001:10001], dst[5000:6000])
        assert [x.id for x in decode.progress()] == [1, 2]


def test_plugin_options_and_cross_process_peer_refused(on_path, tmp_path):
    with pytest.raises(errors.BackendOptionError, match="takes no options"):
        kvt.open(NAME, threads=4)
    # A peer in another process: the backend declares SAME_PROCESS only and says so.
    code = ("import kvtransport as k, numpy as n, sys; a = k.open('example-memmove', name='far'); "
            "a.register(n.zeros(64, n.uint8)); sys.stdout.write(a.metadata().hex())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=_env(on_path, tmp_path))
    assert out.returncode == 0, out.stderr
    with kvt.open(NAME, name="near") as near:
        with pytest.raises(errors.IncompatiblePeerError, match="another process"):
            near.connect(bytes.fromhex(out.stdout))
        assert near.stats()["peers_refused"] == 1


def test_unknown_backend_error_lists_installed_backends(on_path):
    with pytest.raises(errors.BackendNotFoundError) as ei:
        kvt.open("no-such-backend")
    msg = str(ei.value)
    assert "'no-such-backend'" in msg
    for name in (*BUILTIN, NAME):
        assert name in msg
    assert set(ei.value.installed) >= {*BUILTIN, NAME}


def test_backend_added_to_sys_path_after_first_open_is_found(target):
    """CORE BUG (registry): a backend whose entry point appears on sys.path after the first
    ``kvtransport.open`` in a process is listed by ``installed_backends()`` but
    ``open()`` says it is unknown, with a message that lists it as installed, because
    stevedore caches the namespace's entry points in
    ``ExtensionManager.ENTRY_POINT_CACHE`` forever."""
    _forget_stevedore_entry_points()
    kvt.open("loopback", name="first").close()  # any open: stevedore now caches the group
    sys.path.insert(0, str(target))
    importlib.invalidate_caches()
    try:
        assert NAME in kvt.installed_backends()
        agent = kvt.open(NAME, name="late")
        agent.close()
    finally:
        sys.path.remove(str(target))
        sys.modules.pop("kvt_example_backend", None)
        importlib.invalidate_caches()
        _forget_stevedore_entry_points()


def test_cli_backends_lists_the_plugin(target, tmp_path):
    env = _env(target, tmp_path)
    cli = [sys.executable, "-m", "kvtransport.cli", "backends"]
    js = subprocess.run([*cli, "--json"], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert js.returncode == 0, js.stderr
    rows = {r["name"]: r for r in json.loads(js.stdout)}
    assert {*BUILTIN, NAME} <= set(rows)
    assert rows[NAME]["usable"] is True
    assert rows[NAME]["entry_point"] == "kvt_example_backend:MemmoveBackend"
    table = subprocess.run(cli, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert table.returncode == 0, table.stderr
    assert NAME in table.stdout and "loopback" in table.stdout
    # Without the plugin on the path it is not listed: the listing really comes from the install.
    env.pop("PYTHONPATH")
    bare = subprocess.run([*cli, "--json"], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert NAME not in {r["name"] for r in json.loads(bare.stdout)}


def _summary(output: str) -> dict[str, int]:
    last = [ln for ln in output.strip().splitlines() if re.search(r"\d+ (passed|failed|skipped|error)", ln)]
    assert last, f"no pytest summary line in:\n{output}"
    return {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)", last[-1])}


def test_conformance_suite_runs_on_the_plugin_with_one_option(target, tmp_path):
    """What a backend author runs: ``pytest --pyargs kvtransport.testing.conformance
    --kvt-backend example-memmove``. In-process cases pass; cross-process cases are
    skipped with the reason (the example declares SAME_PROCESS only), never passed."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--pyargs", "kvtransport.testing.conformance",
         "--kvt-backend", NAME, "-v", "-rs", "-p", "no:cacheprovider"],
        capture_output=True, text=True, timeout=600, env=_env(target, tmp_path), cwd=tmp_path,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    counts = _summary(proc.stdout)
    assert counts.get("passed", 0) > 0, out
    assert counts.get("failed", 0) == 0 and counts.get("error", 0) == 0 and counts.get("errors", 0) == 0, out
    assert counts.get("skipped", 0) > 0, out
    assert f"backend '{NAME}' does not support same_host" in out
    # Every passed case is in-process, every skipped one cross-process.
    results = re.findall(rf"::(\w+)\[{re.escape(NAME)}-(inproc|xproc)\] (PASSED|SKIPPED|FAILED|ERROR)", proc.stdout)
    assert len(results) == counts["passed"] + counts["skipped"], out
    assert {(topo, res) for _, topo, res in results} == {("inproc", "PASSED"), ("xproc", "SKIPPED")}, out


def test_backends_doc_points_at_the_tested_example():
    """docs/BACKENDS.md walks a backend author to the example's files (linked, not pasted,
    so the manual cannot drift from the code this file installs and tests; that the links
    resolve is checked by tests/test_docs_links.py)."""
    doc = (ROOT / "docs" / "BACKENDS.md").read_text()
    for rel in ("pyproject.toml", "kvt_example_backend/__init__.py"):
        assert (EXAMPLE_SRC / rel).is_file()
        assert f"(../examples/example_backend/{rel})" in doc, f"docs/BACKENDS.md does not link {rel}"
