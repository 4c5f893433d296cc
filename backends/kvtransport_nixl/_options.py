"""Backend options of ``kvt.open("nixl", **options)`` and how they map to NIXL settings.

NIXL configures an agent in three places: ``nixl_agent_config`` (progress thread, thread
count), each plugin's init parameters (``create_backend(name, params)``: for UCX
``ucx_error_handling_mode``, ``num_workers``, ``ucx_devices``) and, for the UCX plugin, the
``UCX_*`` environment read when the plugin creates its UCP context. The first two are
checked here by type; plugin names and parameter names are checked against what the
installed NIXL reports (``_probe.plugin_info``) when the agent is created.

Device memory: NIXL's UCX plugin registers VRAM in a UCP context, and UCX closes the CUDA
memory domain when the transport list leaves out its cuda transports (``UCX_TLS=tcp``), so
``device_memory`` adds UCX's ``cuda`` alias to an explicit list exactly as the ``ucx``
backend does (``kvtransport_ucx._options.device_tls``): ``"auto"`` (default) where this host
has an NVIDIA GPU (the condition under which the agent offers VRAM), ``"cuda"`` always,
``"none"`` never.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvtransport.errors import BackendOptionError
from kvtransport_ucx._options import device_tls

from . import _probe

#: Friendly names for ``tls`` (same as the ``ucx`` backend's); anything else goes to UCX_TLS.
TLS_ALIASES = {
    "tcp": "tcp",
    "shm": "sysv,posix,cma",
    "cma+tcp": "cma,tcp",
}
#: Transports without UCX peer-failure reports: NIXL's UCX plugin must run with
#: ``ucx_error_handling_mode=none`` on them (a same-host peer is then watched by pid).
_NO_PEER_FAILURE = {"sm", "shm", "sysv", "posix", "mm", "self", "knem", "xpmem", "cma"}
_TLS_RE = re.compile(r"^\^?[a-z0-9_]+(,[a-z0-9_]+)*$")
_KEY_RE = re.compile(r"^[A-Z0-9_]+$")

KNOWN = ("backends", "progress_thread", "num_threads", "plugin_params", "tls", "ucx_config",
         "liveness_interval_s", "inline_post_bytes", "close_grace_s", "device_memory")
#: ``device_memory`` values: NIXL moves CUDA device memory (VRAM) only.
DEVICE_MEMORY = ("auto", "none", "cuda")


def gpu_kinds_here() -> frozenset[str]:
    """Device kinds this host has: cuda where an NVIDIA GPU is found (``_probe.has_gpu``)."""
    return frozenset({"cuda"}) if _probe.has_gpu() else frozenset()


@dataclass(frozen=True)
class NixlOptions:
    #: NIXL plugins the agent instantiates, in order (NIXL picks one per transfer).
    backends: tuple[str, ...] = ("UCX",)
    #: NIXL's own progress thread (completes asynchronous transfers without our polling).
    progress_thread: bool = True
    #: ``nixl_agent_config.num_threads`` (worker threads of multi-threaded plugins; 0 = default).
    num_threads: int = 0
    #: Init parameters per plugin, e.g. ``{"UCX": {"num_workers": "2"}}``.
    plugin_params: dict[str, dict[str, str]] = field(default_factory=dict)
    #: UCX settings (``UCX_`` prefix optional) applied while the UCX plugin starts.
    ucx_env: dict[str, str] = field(default_factory=dict)
    #: How often a same-host peer's process is checked while transfers to it are pending.
    liveness_interval_s: float = 0.2
    #: Transfers up to this many bytes are posted on the caller's thread; larger ones on
    #: the backend's poster thread (NIXL's UCX plugin copies inline with cma, see backend.py).
    inline_post_bytes: int = 16 << 20
    #: How long ``close`` waits for in-flight transfers to end before destroying the agent.
    close_grace_s: float = 2.0
    #: The ``device_memory`` option as given; ``ucx_env["TLS"]`` already holds what it added.
    device_memory: str = "auto"

    def params_for(self, plugin: str) -> dict[str, str]:
        return dict(self.plugin_params.get(plugin, {}))


def _err(msg: str) -> BackendOptionError:
    return BackendOptionError(f"nixl backend: {msg}")


def _number(options: Mapping[str, Any], key: str, default: float, ok) -> float:
    v = options.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not ok(float(v)):
        raise _err(f"{key} has an invalid value {v!r}")
    return float(v)


def parse_options(options: Mapping[str, Any], environ: Mapping[str, str] = os.environ,
                  kinds_here: Callable[[], frozenset[str]] = gpu_kinds_here) -> NixlOptions:
    """Type-check the caller's options; unknown keys are refused, naming the known ones.

    ``environ`` is where NIXL's UCX reads ``UCX_TLS`` from when no list is given;
    ``kinds_here`` answers which device kinds this host has (``device_memory='auto'``)."""
    unknown = sorted(set(options) - set(KNOWN))
    if unknown:
        raise _err(f"unknown option(s) {unknown}; known options are {list(KNOWN)}")
    backends = options.get("backends", ["UCX"])
    if isinstance(backends, str):
        backends = [backends]
    if (not isinstance(backends, (list, tuple)) or not backends
            or not all(isinstance(b, str) and b for b in backends)):
        raise _err(f"backends must be a non-empty list of NIXL plugin names such as ['UCX'], got {backends!r}")
    pt = options.get("progress_thread", True)
    if not isinstance(pt, bool):
        raise _err(f"progress_thread must be True or False, got {pt!r}")
    nt = options.get("num_threads", 0)
    if isinstance(nt, bool) or not isinstance(nt, int) or not 0 <= nt <= 256:
        raise _err(f"num_threads must be an integer from 0 to 256, got {nt!r}")
    pp_in = options.get("plugin_params") or {}
    if not isinstance(pp_in, Mapping):
        raise _err(f"plugin_params must map a plugin name to its init parameters, got {pp_in!r}")
    pp: dict[str, dict[str, str]] = {}
    for plugin, params in pp_in.items():
        if plugin not in backends:
            raise _err(f"plugin_params names plugin {plugin!r}, which is not in backends {list(backends)}")
        if not isinstance(params, Mapping):
            raise _err(f"plugin_params[{plugin!r}] must be a mapping of parameter -> value, got {params!r}")
        pp[plugin] = {str(k): str(v).lower() if isinstance(v, bool) else str(v) for k, v in params.items()}
    env = _ucx_env(options)
    if env.get("TLS") and "UCX" in backends:
        listed = set(env["TLS"].lstrip("^").split(",")) - {""}
        if not env["TLS"].startswith("^") and listed <= _NO_PEER_FAILURE:
            # These transports cannot report a dead peer; the UCX plugin refuses its default
            # "peer" error handling on them. Same-host peers are watched by pid instead.
            pp.setdefault("UCX", {}).setdefault("ucx_error_handling_mode", "none")
    device = options.get("device_memory", "auto")
    if device not in DEVICE_MEMORY:
        raise _err(f"device_memory must be one of {list(DEVICE_MEMORY)} (the device memory this agent will "
                   f"register: UCX's cuda transports are added to an explicit tls list), got {device!r}")
    if "UCX" in backends:  # after the error-mode choice above: cuda transports report no peer failure
        tls = device_tls(env.get("TLS"), "tls", device, environ, kinds_here, backend="nixl")
        if tls is not None:
            env["TLS"] = tls
    live = _number(options, "liveness_interval_s", 0.2, lambda v: v > 0)
    grace = _number(options, "close_grace_s", 2.0, lambda v: v >= 0)
    inline = options.get("inline_post_bytes", 16 << 20)
    if isinstance(inline, bool) or not isinstance(inline, int) or inline < 0:
        raise _err(f"inline_post_bytes must be a non-negative integer, got {inline!r}")
    return NixlOptions(tuple(backends), pt, nt, pp, env, live, inline, grace, device)


def _ucx_env(options: Mapping[str, Any]) -> dict[str, str]:
    env: dict[str, str] = {}
    extra = options.get("ucx_config") or {}
    if not isinstance(extra, Mapping):
        raise _err(f"ucx_config must be a mapping of UCX settings such as {{'TLS': 'tcp'}}, got {extra!r}")
    for k, v in extra.items():
        key = str(k).upper().removeprefix("UCX_")
        if not _KEY_RE.match(key):
            raise _err(f"ucx_config key {k!r} is not a UCX setting name")
        env[key] = str(v)
    tls = options.get("tls")
    if tls is not None:
        if not isinstance(tls, str) or not tls:
            raise _err(f"tls must be a string such as 'tcp', 'shm', 'cma+tcp' or 'sysv,posix,cma', got {tls!r}")
        tls = TLS_ALIASES.get(tls, tls)
        if not _TLS_RE.match(tls):
            raise _err(f"tls={tls!r} is not a comma-separated UCX transport list (e.g. 'tcp', 'cma,tcp')")
        env["TLS"] = tls
    return env
