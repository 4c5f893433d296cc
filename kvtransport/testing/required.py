"""Required backends: a test run that must not skip a backend it was meant to prove.

A backend that cannot run on a machine is normally reported *skipped with its reason*
(a developer's laptop has no RDMA NIC; that is not a defect). On CI the same skip would
hide a broken install: the run is green although loopback or ucx was never exercised.
So a run names the backends it requires in the environment variable
``KVT_REQUIRED_BACKENDS`` (comma-separated; ``scripts/dev.sh test`` and ``.ci/run``
set ``loopback,ucx``), and a test that would skip one of them FAILS instead, with the
probe's reason and install hint.

Used by the conformance plugin (``kvtransport.testing.plugin``) and by any test that
needs a particular backend: call :func:`skip_unless_usable` where you would skip.
"""

from __future__ import annotations

import os

import pytest

__all__ = ["ENV", "required_backends", "unusable_reason", "skip_unless_usable", "skip_or_fail"]

#: Environment variable naming the required backends, e.g. ``loopback,ucx``.
ENV = "KVT_REQUIRED_BACKENDS"


def required_backends() -> frozenset[str]:
    """Backend names listed in ``KVT_REQUIRED_BACKENDS`` (empty when unset or blank)."""
    return frozenset(n.strip() for n in os.environ.get(ENV, "").split(",") if n.strip())


def unusable_reason(name: str) -> str:
    """Why backend ``name`` cannot run here ("" when it can): not installed, its module
    fails to import, or its probe says no -- with the install hint when there is one."""
    from kvtransport.errors import KVTransportError
    from kvtransport.registry import load_backend_class, probe_class

    try:
        av = probe_class(load_backend_class(name))
    except KVTransportError as exc:
        return str(exc)
    if av.usable:
        return ""
    return f"{av.reason}" + (f" (fix: {av.install_hint})" if av.install_hint else "")


def skip_or_fail(name: str, reason: str) -> None:
    """Leave the current test: FAIL if ``name`` is a required backend, else skip."""
    msg = f"backend {name!r} cannot run here: {reason}"
    if name in required_backends():
        pytest.fail(f"{msg} -- and it is required ({ENV}={os.environ.get(ENV, '')})", pytrace=False)
    pytest.skip(msg)


def skip_unless_usable(name: str) -> None:
    """Skip the current test unless backend ``name`` can run here; fail instead of
    skipping when it is required (``KVT_REQUIRED_BACKENDS``)."""
    why = unusable_reason(name)
    if why:
        skip_or_fail(name, why)
