"""Backend options of ``kvt.open("nixl", **options)`` and how they map to NIXL settings.

NIXL configures an agent in three places: ``nixl_agent_config`` (progress thread, thread
count), each plugin's init parameters (``create_backend(name, params)``: for UCX
``ucx_error_handling_mode``, ``num_workers``, ``ucx_devices``) and, for the UCX plugin, the
``UCX_*`` environment read when the plugin creates its UCP context. The options are
declared in :data:`SCHEMA` (``kvtransport.options_schema``); plugin names and parameter
names are checked against what the installed NIXL reports (:func:`plugin_params`, with
``probe.plugin_info``) when the agent is created.

Device memory: NIXL's UCX plugin registers VRAM in a UCP context, and UCX closes the CUDA
memory domain when the transport list leaves out its cuda transports (``UCX_TLS=tcp``), so
``device_memory`` adds UCX's ``cuda`` alias to an explicit list exactly as the ``ucx``
backend does (``kvtransport.ucx_config.device_tls``): ``"auto"`` (default) where this host
has an NVIDIA GPU (the condition under which the agent offers VRAM), ``"cuda"`` always,
``"none"`` never.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvtransport.options_schema import Option, OptionsSchema, boolean, integer, mapping, number, one_of
from kvtransport.ucx_config import device_tls, reports_peer_failure, tls_setting, ucx_settings

from . import probe

#: ``device_memory`` values: NIXL moves CUDA device memory (VRAM) only.
DEVICE_MEMORY = ("auto", "none", "cuda")
#: Plugins whose init parameter ``num_threads`` is NIXL's thread count (as nixl_agent does).
_THREADED = ("UCX", "OBJ", "LIBFABRIC")
#: NIXL's storage plugins move memory to files, blocks or object stores, not between agents.
_STORAGE = frozenset({"POSIX", "GDS", "GDS_MT", "OBJ", "AZURE_BLOB", "GUSLI", "INFINIA", "HF3FS"})


def _plugin_names(v: Any) -> tuple[str, ...]:
    """a non-empty list of NIXL plugin names such as ['UCX']"""
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, (list, tuple)) or not v or not all(isinstance(b, str) and b for b in v):
        raise ValueError("a non-empty list of NIXL plugin names such as ['UCX']")
    return tuple(v)


#: Every option, its default and its check; what spans options is resolved in :func:`parse_options`.
SCHEMA = OptionsSchema(
    "nixl",
    Option("backends", ("UCX",), _plugin_names, check_default=True),
    Option("progress_thread", True, boolean),
    Option("num_threads", 0, integer(0, 256)),
    Option("plugin_params", {}, mapping("a mapping of plugin name -> its init parameters")),
    Option("tls"),  # tls_setting (below)
    Option("ucx_config"),  # ucx_settings (below)
    Option("liveness_interval_s", 0.2, number(gt=0), check_default=True),
    Option("inline_post_bytes", 16 << 20, integer(0)),
    Option("close_grace_s", 2.0, number(ge=0), check_default=True),
    Option("device_memory", "auto", one_of(*DEVICE_MEMORY)),
    Option("tcp_user_timeout_s", 30.0, number(ge=0), check_default=True),
)
KNOWN = SCHEMA.known


def gpu_kinds_here() -> frozenset[str]:
    """Device kinds this host has: cuda where an NVIDIA GPU is found (``probe.has_gpu``)."""
    return frozenset({"cuda"}) if probe.has_gpu() else frozenset()


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


def parse_options(options: Mapping[str, Any], environ: Mapping[str, str] = os.environ,
                  kinds_here: Callable[[], frozenset[str]] = gpu_kinds_here) -> NixlOptions:
    """Type-check the caller's options; unknown keys are refused, naming the known ones.

    ``environ`` is where NIXL's UCX reads ``UCX_TLS`` from when no list is given;
    ``kinds_here`` answers which device kinds this host has (``device_memory='auto'``)."""
    o = SCHEMA.parse(options)
    backends = o["backends"]
    pp: dict[str, dict[str, str]] = {}
    for plugin, params in o["plugin_params"].items():
        if plugin not in backends:
            raise SCHEMA.error(f"plugin_params names plugin {plugin!r}, which is not in backends {list(backends)}")
        if not isinstance(params, Mapping):
            raise SCHEMA.error(f"plugin_params[{plugin!r}] must be a mapping of parameter -> value, got {params!r}")
        pp[plugin] = {str(k): str(v).lower() if isinstance(v, bool) else str(v) for k, v in params.items()}
    env = ucx_settings(o["ucx_config"], "nixl")
    user_timeout = o["tcp_user_timeout_s"]
    if "UCX" in backends and user_timeout > 0 and "UCX_TCP_USER_TIMEOUT" not in environ:
        # NIXL cannot abort a posted transfer: over tcp a READ or WRITE across a dead link
        # ends only when the kernel gives up on the connection, by default after ~15 min of
        # retransmissions (net.ipv4.tcp_retries2). Unacknowledged data closes the socket
        # after this long instead, so UCX fails the request and the memory is quiesced.
        env.setdefault("TCP_USER_TIMEOUT", f"{int(round(user_timeout * 1000))}ms")
    if o["tls"] is not None:
        env["TLS"] = tls_setting(o["tls"], "nixl")
    if env.get("TLS") and "UCX" in backends and not reports_peer_failure(env["TLS"]):
        # These transports cannot report a dead peer; the UCX plugin refuses its default
        # "peer" error handling on them. Same-host peers are watched by pid instead.
        pp.setdefault("UCX", {}).setdefault("ucx_error_handling_mode", "none")
    device = o["device_memory"]
    if "UCX" in backends:  # after the error-mode choice above: cuda transports report no peer failure
        tls = device_tls(env.get("TLS"), "tls", device, environ, kinds_here, backend="nixl")
        if tls is not None:
            env["TLS"] = tls
    return NixlOptions(backends, o["progress_thread"], o["num_threads"], pp, env, o["liveness_interval_s"],
                       o["inline_post_bytes"], o["close_grace_s"], device)


def plugin_params(opts: NixlOptions, info: probe.PluginInfo, plugin: str) -> dict[str, str]:
    """The init parameters of ``plugin``, checked against what the installed NIXL reports."""
    if plugin not in info.plugins:
        raise SCHEMA.error(f"NIXL has no plugin {plugin!r}; installed plugins: {info.plugins}")
    if plugin in _STORAGE:
        raise SCHEMA.error(f"{plugin!r} is a NIXL storage plugin (memory to files or objects), not a transport "
                           "between agents; use 'UCX' or 'LIBFABRIC'")
    desc = info.describe(plugin)
    if desc is None:
        raise SCHEMA.error(f"NIXL cannot load plugin {plugin!r} here (a missing library or device); usable "
                           "plugins include 'UCX'")
    known, mems = desc
    if "DRAM_SEG" not in mems:
        raise SCHEMA.error(f"plugin {plugin!r} does not move CPU memory between agents (it handles {mems})")
    given = opts.params_for(plugin)
    bad = sorted(set(given) - set(known))
    if bad:
        raise SCHEMA.error(f"plugin {plugin!r} has no parameter(s) {bad}; its parameters are {sorted(known)}")
    if opts.num_threads and plugin in _THREADED:
        given.setdefault("num_threads", str(opts.num_threads))
    return given
