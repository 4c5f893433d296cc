"""Backend discovery by entry point: what is installed, whether it can run here and why
not, and typed errors for every way a third-party entry point can be broken. Broken
plugins are simulated with real ``*.dist-info`` directories on ``sys.path``, the way
pip installs them."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import stevedore

import kvtransport as kvt
from kvtransport import errors
from kvtransport.registry import NAMESPACE, load_backend_class

BUILTIN = {
    "loopback": "kvtransport_loopback.backend:LoopbackBackend",
    "ucx": "kvtransport_ucx.backend:UcxBackend",
    "moriio": "kvtransport_moriio.backend:MoriioBackend",
}


def test_available_backends_lists_builtins_with_reasons():
    infos = {i.name: i for i in kvt.available_backends()}
    assert set(BUILTIN) <= set(infos)
    for name, target in BUILTIN.items():
        assert infos[name].entry_point == target
    lb = infos["loopback"]
    assert lb.usable and lb.version and lb.capabilities is not None
    assert "cpu" in lb.capabilities.memory_kinds
    for i in infos.values():
        if not i.usable:  # never "no" without saying why and how to fix it
            assert i.reason, i
            assert i.install_hint, i
    # moriio needs amd-mori (Python 3.10/3.12, ROCm 7, an RDMA NIC): not on this machine.
    if sys.version_info[:2] not in ((3, 10), (3, 12)):
        assert not infos["moriio"].usable and "3.11" in infos["moriio"].reason


def test_installed_backends_is_sorted_and_imports_nothing():
    names = kvt.installed_backends()
    assert names == sorted(names) and set(BUILTIN) <= set(names)


def test_backend_not_found_lists_installed_names():
    with pytest.raises(errors.BackendNotFoundError) as ei:
        kvt.open("no-such-backend")
    assert isinstance(ei.value, LookupError)
    msg = str(ei.value)
    assert "'no-such-backend'" in msg and "kvtransport.backends" in msg
    for name in BUILTIN:
        assert name in msg
    assert ei.value.installed == sorted(ei.value.installed)


# -- broken third-party entry points --------------------------------------------------------

def _dist(root: Path, dist: str, entry_points: dict[str, str]) -> None:
    d = root / f"{dist}-0.1.dist-info"
    d.mkdir()
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    lines = "".join(f"{k} = {v}\n" for k, v in entry_points.items())
    (d / "entry_points.txt").write_text(f"[{NAMESPACE}]\n{lines}")


MODULES = {
    "kvt_test_raises_at_import": "raise RuntimeError('boom at import')\n",
    "kvt_test_probes": (
        "from kvtransport.spi import Availability, Backend\n"
        "class _Base(Backend):\n"
        "    register = deregister = export = connect = post = poll = notifications = close = None\n"
        "class ProbeRaises(_Base):\n"
        "    name = 'probe-raises'\n"
        "    @classmethod\n"
        "    def probe(cls):\n"
        "        raise OSError('no device')\n"
        "class NotHere(_Base):\n"
        "    name = 'not-here'\n"
        "    @classmethod\n"
        "    def probe(cls):\n"
        "        return Availability(False, 'needs a frobnicator NIC', 'pip install frob')\n"
    ),
}


@pytest.fixture
def plugins(tmp_path):
    """Fake installed distributions declaring broken backends, on ``sys.path`` for one test.

    stevedore caches each namespace's entry points for the life of the process
    (``ExtensionManager.ENTRY_POINT_CACHE``), so it is reset on entry and exit; see
    tests/test_third_party_backend.py for the core bug that causes."""
    for mod, src in MODULES.items():
        (tmp_path / f"{mod}.py").write_text(src)
    _dist(tmp_path, "kvt_test_missing", {"missing-module": "kvt_test_no_such_module:Backend"})
    _dist(tmp_path, "kvt_test_raising", {"raises-at-import": "kvt_test_raises_at_import:Backend"})
    _dist(tmp_path, "kvt_test_notbackend", {"not-a-backend": "os:getcwd"})
    _dist(tmp_path, "kvt_test_probes", {"probe-raises": "kvt_test_probes:ProbeRaises",
                                        "not-here": "kvt_test_probes:NotHere"})
    sys.path.insert(0, str(tmp_path))
    importlib.invalidate_caches()
    stevedore.ExtensionManager.ENTRY_POINT_CACHE.pop(NAMESPACE, None)
    try:
        yield tmp_path
    finally:
        sys.path.remove(str(tmp_path))
        for mod in MODULES:
            sys.modules.pop(mod, None)
        importlib.invalidate_caches()
        stevedore.ExtensionManager.ENTRY_POINT_CACHE.pop(NAMESPACE, None)


@pytest.mark.parametrize("name, what", [
    ("missing-module", "failed to import: ModuleNotFoundError"),
    ("raises-at-import", "failed to import: RuntimeError: boom at import"),
    ("not-a-backend", "'os:getcwd' is not a kvtransport.spi.Backend subclass"),
    ("probe-raises", "probe raised OSError: no device"),
    ("not-here", r"needs a frobnicator NIC \(fix: pip install frob\)"),
])
def test_broken_plugin_is_a_typed_error(plugins, name, what):
    with pytest.raises(errors.BackendUnavailableError, match=what):
        kvt.open(name)


def test_installed_backends_does_not_import_plugins(plugins):
    names = kvt.installed_backends()
    assert {"missing-module", "raises-at-import", "not-a-backend", "probe-raises"} <= set(names)
    assert "kvt_test_raises_at_import" not in sys.modules


def test_available_backends_reports_broken_plugins_and_keeps_listing(plugins):
    infos = {i.name: i for i in kvt.available_backends()}
    assert infos["loopback"].usable
    for name in ("missing-module", "raises-at-import", "not-a-backend", "probe-raises", "not-here"):
        assert not infos[name].usable and infos[name].reason, infos[name]
    assert infos["not-here"].install_hint == "pip install frob"
    assert load_backend_class("loopback").name == "loopback"


def test_two_packages_claiming_one_backend_name(plugins):
    """CORE BUG: two installed packages declaring the same backend name make stevedore's
    DriverManager raise ``stevedore.exception.MultipleMatches``, which the registry does
    not catch: ``kvtransport.open(name)`` raises a non-kvtransport exception and
    ``available_backends()`` — hence ``kvtransport backends`` — crashes for every backend.
    Fix in ``registry.load_backend_class``: catch ``stevedore.exception.MultipleMatches``
    and raise ``BackendUnavailableError(name, "declared by several packages: <targets>;
    uninstall all but one")``; ``available_backends`` already turns that into a row."""
    _dist(plugins, "kvt_test_dup_one", {"dupe": "os:getcwd"})
    _dist(plugins, "kvt_test_dup_two", {"dupe": "os:getpid"})
    importlib.invalidate_caches()
    stevedore.ExtensionManager.ENTRY_POINT_CACHE.pop(NAMESPACE, None)
    with pytest.raises(errors.KVTransportError, match="getcwd.*getpid|getpid.*getcwd"):
        kvt.open("dupe")
    infos = {i.name: i for i in kvt.available_backends()}
    assert not infos["dupe"].usable and infos["loopback"].usable
