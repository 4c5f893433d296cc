"""The agent's own settings, apart from backend options, and how ``kvtransport.open``
tells them apart and checks them.

Core settings are few and the same for every backend; everything else given to
``kvtransport.open`` is the backend's, passed to it unchanged. Checking the core's here,
before a backend exists, means a bad value never leaves threads or sockets behind.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from . import metadata as md_mod
from .errors import BackendOptionError
from .faults import FaultPlan, plan_from_options
from .preparation import check_timeout

__all__ = ["AgentConfig", "core_config"]


@dataclass
class AgentConfig:
    """Core settings, kept apart from backend options (which go to the backend as-is)."""

    name: str | None = None
    #: Deadline of a transfer when ``read``/``write`` get no ``timeout``.
    default_timeout_s: float = 30.0
    max_metadata_bytes: int = md_mod.MAX_METADATA_BYTES
    #: Optional KV layout facts; a peer declaring a different layout is refused.
    layout: dict[str, str | int] | None = None
    faults: FaultPlan | None = None
    #: Latency samples kept for percentiles.
    latency_window: int = 4096
    #: Finished transfers whose end a ``status()``/``wait()`` already returned are held
    #: for :meth:`Agent.progress` only weakly; the latest ``progress_window`` of them are
    #: held strongly too, so a caller who waits, drops the handle and drains ``progress()``
    #: soon after still sees them. Memory stays bounded either way.
    progress_window: int = 1024


#: keywords of ``kvtransport.open`` that are core settings, not backend options
CORE_OPTIONS = {"name", "default_timeout_s", "max_metadata_bytes", "layout", "faults", "config",
                "latency_window", "progress_window"}


def core_config(backend: str, name: str | None, config: AgentConfig | None,
                options: dict[str, Any]) -> AgentConfig:
    """The settings of an agent opened on ``backend``: a copy of ``config`` (or the
    defaults) with the core keywords popped from ``options`` (what stays there is the
    backend's) and ``name`` applied; a generated name if none. Typed errors for bad values."""
    cfg = dataclasses.replace(config) if config is not None else AgentConfig()
    core = {k: options.pop(k) for k in list(options) if k in CORE_OPTIONS}
    for k, v in core.items():
        setattr(cfg, k, plan_from_options(v) if k == "faults" else v)
    if name is not None:
        cfg.name = name
    if cfg.name is None:
        cfg.name = f"{backend}-{secrets.token_hex(4)}"
    check_timeout(cfg.default_timeout_s)
    _check_core_config(cfg)
    return cfg


def _check_core_config(cfg: AgentConfig) -> None:
    """Typed errors for bad core settings, before a backend (threads, sockets) exists."""
    if not isinstance(cfg.name, str) or not cfg.name:
        raise BackendOptionError(f"name must be a non-empty string, got {cfg.name!r}")
    for key, low in (("latency_window", 1), ("progress_window", 0), ("max_metadata_bytes", 1)):
        v = getattr(cfg, key)
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise BackendOptionError(f"core option {key} must be an integer >= {low}, got {v!r}")
    if cfg.layout is not None and not isinstance(cfg.layout, Mapping):
        raise BackendOptionError(f"core option layout must be a mapping of layout facts or None, "
                                 f"got {type(cfg.layout).__name__}")
    if cfg.faults is not None and not isinstance(cfg.faults, FaultPlan):
        raise BackendOptionError(f"core option faults must be a FaultPlan, got {type(cfg.faults).__name__}")
