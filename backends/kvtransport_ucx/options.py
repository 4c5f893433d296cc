"""Backend options of ``kvt.open("ucx", **options)`` and how they map to UCX configuration.

The options are declared in :data:`SCHEMA` (``kvtransport.options_schema``); the transport
list, the ``ucx_config`` settings and the device transports added for device memory are
resolved with the helpers the ``nixl`` backend uses too (``kvtransport.ucx_config``).

The transport list is applied per UCP context with ``ucp_config_modify`` (not through the
process environment), so two agents in one process may use different transports.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvtransport.options_schema import Option, OptionsSchema, anything, integer, number, one_of, text
from kvtransport.spi import usable_cpus
from kvtransport.ucx_config import DEVICE_TLS_ALIAS, device_tls, reports_peer_failure, tls_setting, ucx_settings

from . import native

#: Default ``lane_split_bytes`` over the network, and to a same-host peer reached with cma
#: (see :meth:`UcxOptions.split_bytes`).
LANE_SPLIT_BYTES = 2 << 20
CMA_LANE_SPLIT_BYTES = 8 << 20
#: UCX settings we change from UCX's defaults (a user's ``ucx_config`` overrides them).
#: RNDV_THRESH=inf: with UCX 1.22 and peer error handling, RMA is otherwise emulated with
#: active messages over tcp even between processes of one host; with it, ``ucp_put/get``
#: use the zero-copy lanes (cma on one host, tcp put_zcopy across hosts). Measured, see
#: docs/UCX.md. It only affects the AM/tag rendezvous protocol, which this backend does not use.
DEFAULT_UCX_CONFIG = {"RNDV_THRESH": "inf"}
#: Tuning applied only when this UCX knows the setting (a system UCX built without cma does
#: not): CMA_TX_QUOTA=16 lets one progress call run up to 16 queued cma copies instead of 1,
#: which cut the per-segment cost of scattered transfers (4096 x 16 KiB: 1.9 -> 2.8 GB/s,
#: measured, docs/UCX.md) while one call still holds the worker for at most ~1 ms.
#: TCP_TX_SEG_SIZE/TCP_RX_SEG_SIZE=1m (UCX: 8k/64k): over tcp UCX emulates a get with
#: active-message replies of at most one TX segment, so an 8 KiB segment made READ cost one
#: message per 8 KiB. Measured two processes over loopback tcp, 5 runs (docs/UCX.md):
#: READ 16 MiB 1.5 -> 3.4 GB/s, 256 MiB 1.6 -> 3.6, 4096 x 16 KiB 1.0 -> 1.8; WRITE level;
#: ~1 MiB more memory per lane. UCX refuses RX < TX, so a user's ``ucx_config`` setting
#: either one drops both of ours.
_TCP_SEGMENTS = {"TCP_TX_SEG_SIZE": "1m", "TCP_RX_SEG_SIZE": "1m"}
OPTIONAL_UCX_CONFIG = {"CMA_TX_QUOTA": "16", **_TCP_SEGMENTS}
DEVICE_MEMORY = ("auto", "none", *DEVICE_TLS_ALIAS)

#: Every option, its default and its check; what spans options is resolved in :func:`parse_options`.
SCHEMA = OptionsSchema(
    "ucx",
    Option("tls"),  # tls_setting (below): also "auto" / "all"
    Option("err_mode", "auto", one_of("auto", "peer", "none")),
    Option("net_devices", None, text(what="a UCX_NET_DEVICES string such as 'eth0' or 'all'", optional=True)),
    Option("progress", "thread", one_of("thread", "busy")),
    Option("ucx_config"),  # ucx_settings (below)
    Option("liveness_interval_s", 0.2, number(gt=0, convert=True), check_default=True),
    Option("cancel_grace_s", 2.0, number(ge=0, convert=True), check_default=True),
    Option("inline_progress_s", 0.005, number(ge=0, le=1.0, convert=True), check_default=True),
    # Default: two lanes, or one when this thread may run on one CPU only (a pinned engine).
    Option("lanes", check=integer(1, 8), default_factory=lambda: min(2, usable_cpus())),
    Option("lane_split_bytes", None, integer(0, optional=True)),
    Option("post", None, anything),  # native.resolve (below)
    Option("device_memory", "auto", one_of(*DEVICE_MEMORY)),
)
KNOWN = SCHEMA.known


@dataclass(frozen=True)
class UcxOptions:
    tls: str | None = None  # resolved UCX_TLS value; None = UCX default / UCX_TLS from env
    err_mode: str = "peer"  # "peer" | "none"
    net_devices: str | None = None
    progress: str = "thread"  # "thread" (sleeps on the worker fd) | "busy" (spins)
    ucx_config: dict[str, str] = field(default_factory=dict)
    liveness_interval_s: float = 0.2
    cancel_grace_s: float = 2.0
    #: How long ``post`` may drive UCX progress on the caller's thread (see backend.py).
    inline_progress_s: float = 0.005
    #: UCP workers per agent; a large transfer is shared among them so that the posting
    #: thread and the progress thread copy in parallel (cma), or use more QPs (RDMA).
    lanes: int = 2
    #: Transfers smaller than this use lane 0 only; None: :meth:`split_bytes` decides.
    lane_split_bytes: int | None = None
    #: Resolved posting path: "native" (one call into the compiled _post.c per lane and
    #: transfer) or "ctypes" (one ctypes call per segment); see _native.py.
    post: str = "ctypes"
    #: The ``device_memory`` option as given ("auto", "none", "cuda", "rocm"); ``tls``
    #: already holds the device transports it added.
    device_memory: str = "auto"

    def may_use_cma(self) -> bool:
        """Whether same-host peers may be reached with cma (the UCX default, ``all``, or a
        transport list naming cma)."""
        if self.tls is None or self.tls == "all":
            return True
        return not self.tls.startswith("^") and "cma" in self.tls.split(",")

    def split_bytes(self, same_host: bool) -> int:
        """The size from which a transfer to a peer is shared among the lanes.

        The option wins when set. Otherwise: ``CMA_LANE_SPLIT_BYTES`` (8 MiB) to a same-host
        peer reached with cma, where the lane thread's hand-off (~0.1 ms) outweighs the copy
        it takes over below that (two processes, one 4 MiB READ: 338 us split, 225 us on one
        lane; 8 MiB even; 16 MiB 852 against 1112 us); ``LANE_SPLIT_BYTES`` (2 MiB) over the
        network, where a tcp READ gains from 4 MiB on (1242 against 1696 us)."""
        if self.lane_split_bytes is not None:
            return self.lane_split_bytes
        return CMA_LANE_SPLIT_BYTES if same_host and self.may_use_cma() else LANE_SPLIT_BYTES

    def optional_ucx_settings(self) -> dict[str, str]:
        """Our tuning defaults that a UCX build may not know (skipped there)."""
        skip = set(self.ucx_config)
        if skip & _TCP_SEGMENTS.keys():
            skip |= _TCP_SEGMENTS.keys()
        return {k: v for k, v in OPTIONAL_UCX_CONFIG.items() if k not in skip}

    def ucx_settings(self) -> dict[str, str]:
        """Settings that must apply (a refusal is a configuration error)."""
        cfg = {**DEFAULT_UCX_CONFIG, **self.ucx_config}
        if self.tls is not None:
            cfg["TLS"] = self.tls
        if self.net_devices is not None:
            cfg["NET_DEVICES"] = self.net_devices
        return cfg


def parse_options(options: Mapping[str, Any], environ: Mapping[str, str] = os.environ,
                  kinds_here: Callable[[], frozenset[str]] | None = None) -> UcxOptions:
    """Check the caller's options and resolve the transport list.

    ``environ`` is where UCX will read ``UCX_TLS`` from; ``kinds_here`` answers which device
    kinds the loaded UCX moves on this host (default: ask UCX, :func:`memory.device_kinds_here`;
    only asked for ``device_memory='auto'`` with an explicit allow list)."""
    o = SCHEMA.parse(options)
    tls = o["tls"]
    if tls in ("auto", "all"):
        tls = None if tls == "auto" else "all"
    elif tls is not None:
        tls = tls_setting(tls, "ucx")
    default_mode = "peer" if reports_peer_failure(tls) else "none"
    err_mode = default_mode if o["err_mode"] == "auto" else o["err_mode"]
    if err_mode == "peer" and default_mode == "none":
        raise SCHEMA.error(f"err_mode='peer' needs a transport that reports peer failure (tcp, verbs); tls={tls!r} "
                           "has none. Use err_mode='auto' (liveness by pid for same-host peers) or tls='cma+tcp'")
    extra = ucx_settings(o["ucx_config"], "ucx")
    post = native.resolve(o["post"])
    device = o["device_memory"]
    if kinds_here is None:
        from .memory import device_kinds_here as kinds_here  # loads libucp: only when needed
    if tls is not None or "TLS" not in extra:
        tls = device_tls(tls, "tls", device, environ, kinds_here)
    else:  # the list came in ucx_config: add to it there
        extra["TLS"] = device_tls(extra["TLS"], "ucx_config TLS", device, environ, kinds_here)
    return UcxOptions(tls, err_mode, o["net_devices"], o["progress"], extra, o["liveness_interval_s"],
                      o["cancel_grace_s"], o["inline_progress_s"], o["lanes"], o["lane_split_bytes"], post, device)
