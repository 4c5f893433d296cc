"""Where ``mori.io`` comes from, and which part of it this backend touches.

The real module is imported once, lazily (importing it needs ROCm libraries). Tests and
site-specific builds substitute another module through :func:`using_mori_module` (or
the ``mori_module`` option); the substitute wins inside the ``with`` block only.
:data:`MORI_SURFACE` lists every name we use, checked against the real mori sources by
tests/moriio/test_mori_signature_drift.py.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from collections.abc import Iterator
from typing import Any

from .options import RDMA_KNOBS

__all__ = ["MORI_SURFACE", "XGMI_ONLY_ENV", "using_mori_module", "current_override", "import_mori_io",
           "mori_version"]

#: Every piece of the mori.io surface this backend touches, checked against the real
#: ``mori/io/engine.py`` (and the wheel's bindings) by tests/moriio/test_mori_signature_drift.py.
#: Python-level methods: (class in mori/io/engine.py, method, positional args we pass).
MORI_SURFACE: dict[str, Any] = {
    "python_methods": [
        ("IOEngine", "__init__", 2),
        ("IOEngine", "create_backend", 2),
        ("IOEngine", "get_engine_desc", 0),
        ("IOEngine", "register_memory", 4),
        ("IOEngine", "deregister_memory", 1),
        ("IOEngine", "register_remote_engine", 1),
        ("IOEngine", "deregister_remote_engine", 1),
        ("IOEngine", "create_session", 2),
        ("IOEngine", "pop_peer_failure", 0),
        ("IOEngineSession", "allocate_transfer_uid", 0),
        ("IOEngineSession", "batch_read", 4),
        ("IOEngineSession", "batch_write", 4),
    ],
    # Names imported from mori.io.
    "module_names": [
        "IOEngine",
        "IOEngineConfig",
        "BackendType",
        "RdmaBackendConfig",
        "XgmiBackendConfig",
        "PollCqMode",
        "MemoryLocationType",
        "MemoryDesc",
        "EngineDesc",
    ],
    # Attributes of pybind11 objects (defined in libmori_pybinds.so, not in engine.py).
    "binding_names": [
        "Succeeded", "Failed", "InProgress", "Init", "Message", "Code",  # TransferStatus
        "pack", "unpack", "engine_key", "size",  # MemoryDesc / EngineDesc
        "key", "host", "port",  # EngineDesc, IOEngineConfig
        "remote_engine_key", "reason", "detail", "device_name", "qp_num",  # PeerFailureEvent
        "num_streams", "num_events",  # XgmiBackendConfig
        "poll_cq_mode", "POLLING", "EVENT", "RDMA", "XGMI", "CPU", "GPU",
        *RDMA_KNOBS,
    ],
}

#: Set to 1 on a node without an RDMA NIC that uses only transport="xgmi".
XGMI_ONLY_ENV = "KVT_MORIIO_XGMI_ONLY"

_override: list[Any] = []
_override_lock = threading.Lock()


@contextlib.contextmanager
def using_mori_module(module: Any) -> Iterator[None]:
    """Use ``module`` instead of the real ``mori.io`` inside the block (tests, or a
    site-specific build). Nothing global leaks out of the block."""
    with _override_lock:
        _override.append(module)
    try:
        yield
    finally:
        with _override_lock:
            _override.remove(module)


def current_override() -> Any:
    with _override_lock:
        return _override[-1] if _override else None


_import_result: tuple[Any, str] | None = None


def import_mori_io() -> tuple[Any, str]:
    """Import the real ``mori.io`` once; return (module or None, failure reason)."""
    global _import_result
    if _import_result is None:
        try:
            _import_result = (importlib.import_module("mori.io"), "")
        except Exception as exc:  # ImportError, OSError from a missing ROCm library, ...
            _import_result = (None, f"import mori.io failed: {type(exc).__name__}: {exc}")
    return _import_result


def mori_version(module: Any) -> str:
    fake = getattr(module, "FAKE_VERSION", None)
    if fake:
        return str(fake)
    try:
        return str(importlib.import_module("mori").__version__)
    except Exception:
        return "unknown"

