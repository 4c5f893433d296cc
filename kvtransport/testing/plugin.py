"""pytest plugin (entry point ``pytest11``): options and parametrisation of the
conformance suite.

Without options the suite runs every installed backend with each option set the
backend declares in ``Backend.conformance_options``; a backend that cannot run here is
reported as *skipped with its reason*, never as passed. A third-party author runs::

    pytest --pyargs kvtransport.testing.conformance --kvt-backend mybackend
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pytest


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


def _cases(config: pytest.Config) -> list[Any]:
    from kvtransport.errors import KVTransportError
    from kvtransport.registry import installed_backends, load_backend_class, probe_class
    from kvtransport.spi import Scope

    names = config.getoption("--kvt-backend") or installed_backends()
    override = config.getoption("--kvt-backend-options")
    params: list[Any] = []
    for name in names:
        try:
            cls = load_backend_class(name)
        except KVTransportError as exc:
            params.append(pytest.param(BackendCase(name), id=f"{name}-unavailable",
                                       marks=pytest.mark.skip(reason=str(exc))))
            continue
        av = probe_class(cls)
        option_sets = [json.loads(override)] if override else [dict(o) for o in cls.conformance_options]
        for opts in option_sets:
            for topo, scope in (("inproc", Scope.SAME_PROCESS), ("xproc", Scope.SAME_HOST)):
                case = BackendCase(name, opts, topo)
                marks = []
                if not av.usable:
                    marks.append(pytest.mark.skip(
                        reason=f"backend {name!r} cannot run here: {av.reason}"
                        + (f" (fix: {av.install_hint})" if av.install_hint else "")))
                elif scope not in cls.capabilities.scopes:
                    marks.append(pytest.mark.skip(reason=f"backend {name!r} does not support {scope.value}"))
                params.append(pytest.param(case, id=case.id, marks=marks))
    return params


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "kvt_case" in metafunc.fixturenames:
        metafunc.parametrize("kvt_case", _cases(metafunc.config), scope="module")
