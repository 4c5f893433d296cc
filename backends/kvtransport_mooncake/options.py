"""Backend options of ``kvt.open("mooncake", **options)``; unknown or ill-typed ones are refused.

There is no ``rpc_port`` option on purpose: with the peer-to-peer hand-shake
(``P2PHANDSHAKE``) Mooncake always binds its own free RPC port (``findAvailableTcpPort``,
range ``MC_MIN_RPC_PORT``..``MC_MAX_RPC_PORT`` from the environment) and ignores a port in
the local host name; the port it chose is exported in the agent blob.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtransport.errors import BackendOptionError

KNOWN = ("protocol", "device_name", "hostname", "max_inflight_segments", "chunk_segments",
         "liveness_interval_s")
PROTOCOLS = ("tcp", "rdma")
_HOST_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?$")
_DEVICES_RE = re.compile(r"^[A-Za-z0-9_.:-]+(,[A-Za-z0-9_.:-]+)*$")


@dataclass(frozen=True)
class MooncakeOptions:
    #: Mooncake transport: "tcp" (any host) or "rdma" (needs an RDMA NIC and libibverbs).
    protocol: str = "tcp"
    #: RDMA device filter, comma-separated (e.g. "mlx5_0,mlx5_1"); "" = every device found.
    device_name: str = ""
    #: Name or address peers reach this engine at; it becomes the session id host.
    hostname: str = "127.0.0.1"
    #: Segments in flight per peer. Mooncake's TCP transport queues at most 1024 slices per
    #: peer (MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER) and fails what does not fit, so a larger
    #: transfer is fed to it in chunks as earlier ones complete.
    max_inflight_segments: int = 1024
    #: Segments per Mooncake batch (one ``batch_transfer_async_*`` call).
    chunk_segments: int = 512
    #: How often a same-host peer's process is checked while transfers to it are pending.
    liveness_interval_s: float = 0.05


def _err(msg: str) -> BackendOptionError:
    return BackendOptionError(f"mooncake backend: {msg}")


def _int(options: Mapping[str, Any], key: str, default: int, lo: int, hi: int) -> int:
    v = options.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise _err(f"{key} must be an integer from {lo} to {hi}, got {v!r}")
    return v


def _valid_host(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return bool(_HOST_RE.match(host))


def parse_options(options: Mapping[str, Any]) -> MooncakeOptions:
    unknown = sorted(set(options) - set(KNOWN))
    if unknown:
        raise _err(f"unknown option(s) {unknown}; known options are {list(KNOWN)}")
    protocol = options.get("protocol", "tcp")
    if protocol not in PROTOCOLS:
        raise _err(f"protocol must be one of {list(PROTOCOLS)}, got {protocol!r}")
    device = options.get("device_name", "")
    if not isinstance(device, str) or (device and not _DEVICES_RE.match(device)):
        raise _err(f"device_name must be a comma-separated list of RDMA device names such as "
                   f"'mlx5_0', or '' for all, got {device!r}")
    host = options.get("hostname", "127.0.0.1")
    if not isinstance(host, str) or not _valid_host(host):
        raise _err(f"hostname must be an IP address or host name peers can reach (no port), got {host!r}")
    inflight = _int(options, "max_inflight_segments", 1024, 1, 65535)
    chunk = _int(options, "chunk_segments", min(512, inflight), 1, 65535)
    if chunk > inflight:
        raise _err(f"chunk_segments ({chunk}) must not exceed max_inflight_segments ({inflight})")
    live = options.get("liveness_interval_s", 0.05)
    if isinstance(live, bool) or not isinstance(live, (int, float)) or not live > 0:
        raise _err(f"liveness_interval_s must be a number > 0, got {live!r}")
    return MooncakeOptions(protocol, device, host, inflight, chunk, float(live))
