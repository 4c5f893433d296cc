"""Backend discovery through stevedore entry points (group ``kvtransport.backends``).

Backends are found by name and imported only when needed; the core never names a
backend module. One function per loading policy, as in stevedore: ``load_backend_class``
loads exactly one driver by name (``DriverManager``); ``available_backends`` walks every
installed one to report whether it can run here.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata as importlib_metadata

import stevedore
from stevedore.exception import MultipleMatches, NoMatches

from .errors import BackendNotFoundError, BackendUnavailableError, KVTransportError
from .spi import Availability, Backend, Capabilities

__all__ = ["NAMESPACE", "BackendInfo", "installed_backends", "load_backend_class", "available_backends"]

NAMESPACE = "kvtransport.backends"

#: What to install when a backend's import fails, for the built-in ones.
_INSTALL_HINTS = {
    "ucx": "pip install 'kvtransport[ucx]'",
    "moriio": "pip install 'kvtransport[moriio]' on Python 3.10/3.12 with ROCm 7 and an RDMA NIC",
}


@dataclass(frozen=True)
class BackendInfo:
    name: str
    usable: bool
    reason: str
    install_hint: str
    version: str
    capabilities: Capabilities | None
    entry_point: str


def installed_backends() -> list[str]:
    """Names of every backend entry point, without importing any of them."""
    eps = importlib_metadata.entry_points(group=NAMESPACE)
    return sorted({ep.name for ep in eps})


def _entry_point_target(name: str) -> str:
    for ep in importlib_metadata.entry_points(group=NAMESPACE):
        if ep.name == name:
            return ep.value
    return ""


def load_backend_class(name: str) -> type[Backend]:
    """Import the backend registered under ``name``.

    Raises :class:`BackendNotFoundError` (listing installed names) when there is none,
    :class:`BackendUnavailableError` when its module fails to import.
    """
    failures: list[BaseException] = []

    def on_failure(_manager, _ep, exc):  # stevedore swallows import errors by default
        failures.append(exc)

    def driver_manager() -> stevedore.DriverManager:
        return stevedore.DriverManager(
            NAMESPACE, name, invoke_on_load=False, on_load_failure_callback=on_failure
        )

    try:
        try:
            mgr = driver_manager()
        except NoMatches:
            if failures or name not in installed_backends():
                raise
            # Installed after this process first looked: stevedore caches each group
            # for the life of the process. Forget the cached group and look again.
            stevedore.ExtensionManager.ENTRY_POINT_CACHE.pop(NAMESPACE, None)
            mgr = driver_manager()
    except MultipleMatches:
        targets = [ep.value for ep in importlib_metadata.entry_points(group=NAMESPACE) if ep.name == name]
        raise BackendUnavailableError(
            name, f"declared by several installed packages ({', '.join(targets)})",
            "uninstall all but one of them",
        ) from None
    except NoMatches:
        if failures:
            exc = failures[0]
            raise BackendUnavailableError(
                name, f"its module failed to import: {type(exc).__name__}: {exc}",
                _INSTALL_HINTS.get(name, ""),
            ) from exc
        raise BackendNotFoundError(name, installed_backends()) from None
    cls = mgr.driver
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise BackendUnavailableError(
            name, f"entry point {_entry_point_target(name)!r} is not a kvtransport.spi.Backend subclass"
        )
    return cls


def probe_class(cls: type[Backend]) -> Availability:
    try:
        return cls.probe()
    except Exception as exc:  # a probe must not raise; report it as the reason
        return Availability(False, f"probe raised {type(exc).__name__}: {exc}")


def available_backends() -> list[BackendInfo]:
    """Every installed backend, whether it can run here and if not why and how to fix it."""
    infos: list[BackendInfo] = []
    for name in installed_backends():
        target = _entry_point_target(name)
        try:
            cls = load_backend_class(name)
        except BackendUnavailableError as exc:
            infos.append(BackendInfo(name, False, exc.reason, exc.install_hint, "", None, target))
            continue
        except KVTransportError as exc:  # one broken entry must not hide the others
            infos.append(BackendInfo(name, False, str(exc), "", "", None, target))
            continue
        av = probe_class(cls)
        infos.append(
            BackendInfo(name, av.usable, av.reason, av.install_hint, cls.version, cls.capabilities, target)
        )
    return infos


def backends_for_memory_kind(kind: str) -> list[str]:
    """Installed backends whose declared capabilities accept ``kind`` memory.

    Used for the message of a refused ``register``: read from each backend class's
    ``capabilities`` (no backend is imported by the core itself, only through its entry
    point). A backend that declares the kind but cannot run on this host is listed with
    "(not usable here)" so the user sees why switching to it alone would not be enough."""
    out = []
    for info in available_backends():
        if info.capabilities is not None and kind in info.capabilities.memory_kinds:
            out.append(info.name if info.usable else f"{info.name} (not usable here)")
    return out
