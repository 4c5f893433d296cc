"""pytest plugin (entry point ``pytest11``): options and parametrisation of the
conformance suite.

Without options the suite runs every installed backend with each option set the
backend declares in ``Backend.conformance_options``; a backend that cannot run here is
reported as *skipped with its reason*, never as passed -- unless it is named in
``KVT_REQUIRED_BACKENDS`` (see ``kvtransport.testing.required``): then each of its cases
FAILS with the probe's reason, so a CI run cannot turn green without exercising it. A
required backend that is not even installed is added to the run, and fails the same way.
A third-party author runs::

    pytest --pyargs kvtransport.testing.conformance --kvt-backend mybackend
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pytest

from .required import ENV as REQUIRED_ENV
from .required import required_backends

#: Marks a case whose backend is required but cannot run here; its setup fails.
_UNUSABLE_REQUIRED = "kvt_unusable_required"


@dataclass(frozen=True)
class BackendCase:
    backend: str
    options: dict[str, Any] = field(default_factory=dict, hash=False)
    topology: str = "inproc"  # "inproc": both agents in this process; "xproc": peer in a child

    @property
    def id(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in sorted(self.options.items()))
        return f"{self.backend}{'[' + opts + ']' if opts else ''}-{self.topology}"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvtransport", "kvtransport conformance suite")
    group.addoption("--kvt-backend", action="append", default=[], metavar="NAME",
                    help="run the conformance suite for this backend (repeatable; default: all installed)")
    group.addoption("--kvt-backend-options", default=None, metavar="JSON",
                    help="backend options as a JSON object, replacing the backend's own option sets")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{_UNUSABLE_REQUIRED}(reason): a required backend cannot run "
                            f"here ({REQUIRED_ENV}); the test fails at setup with the reason")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Fail (not skip) a case whose required backend cannot run, before any fixture
    tries to open it."""
    mark = item.get_closest_marker(_UNUSABLE_REQUIRED)
    if mark is not None:
        pytest.fail(mark.args[0], pytrace=False)


def _unusable(name: str, reason: str) -> Any:
    """The mark for a case whose backend cannot run here: skip, or fail if required."""
    if name in required_backends():
        return getattr(pytest.mark, _UNUSABLE_REQUIRED)(
            f"backend {name!r} is required ({REQUIRED_ENV}) but cannot run here: {reason}")
    return pytest.mark.skip(reason=f"backend {name!r} cannot run here: {reason}")


def _cases(config: pytest.Config) -> list[Any]:
    from kvtransport.errors import KVTransportError
    from kvtransport.registry import installed_backends, load_backend_class, probe_class
    from kvtransport.spi import Scope

    # An explicit selection is run as given; otherwise every installed backend plus any
    # required one that is not installed (so that it fails instead of going unnoticed).
    names = config.getoption("--kvt-backend") or sorted(set(installed_backends()) | required_backends())
    override = config.getoption("--kvt-backend-options")
    params: list[Any] = []
    for name in names:
        try:
            cls = load_backend_class(name)
        except KVTransportError as exc:
            params.append(pytest.param(BackendCase(name), id=f"{name}-unavailable",
                                       marks=_unusable(name, str(exc))))
            continue
        av = probe_class(cls)
        option_sets = [json.loads(override)] if override else [dict(o) for o in cls.conformance_options]
        for opts in option_sets:
            for topo, scope in (("inproc", Scope.SAME_PROCESS), ("xproc", Scope.SAME_HOST)):
                case = BackendCase(name, opts, topo)
                marks = []
                if not av.usable:
                    marks.append(_unusable(name, av.reason + (f" (fix: {av.install_hint})" if av.install_hint else "")))
                elif scope not in cls.capabilities.scopes:
                    marks.append(pytest.mark.skip(reason=f"backend {name!r} does not support {scope.value}"))
                params.append(pytest.param(case, id=case.id, marks=marks))
    return params


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "kvt_case" in metafunc.fixturenames:
        metafunc.parametrize("kvt_case", _cases(metafunc.config), scope="module")
