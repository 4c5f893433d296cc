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

from kvtransport.options_schema import Option, OptionsSchema, integer, number, one_of, text

PROTOCOLS = ("tcp", "rdma")
_HOST_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?$")
_DEVICES_RE = r"^[A-Za-z0-9_.:-]+(,[A-Za-z0-9_.:-]+)*$"


def _host(v: Any) -> str:
    """an IP address or host name peers can reach (no port)"""
    if isinstance(v, str):
        try:
            ipaddress.ip_address(v)
            return v
        except ValueError:
            if _HOST_RE.match(v):
                return v
    raise ValueError("an IP address or host name peers can reach (no port)")


#: Every option, its default and its check; chunk against in-flight cap in :func:`parse_options`.
SCHEMA = OptionsSchema(
    "mooncake",
    Option("protocol", "tcp", one_of(*PROTOCOLS)),
    Option("device_name", "", text(_DEVICES_RE, "a comma-separated list of RDMA device names such as 'mlx5_0', "
                                                "or '' for all", empty=True)),
    Option("hostname", "127.0.0.1", _host),
    Option("max_inflight_segments", 1024, integer(1, 65535)),
    Option("chunk_segments", None, integer(1, 65535, optional=True)),  # default: min(512, max_inflight_segments)
    Option("liveness_interval_s", 0.05, number(gt=0), check_default=True),
)
KNOWN = SCHEMA.known


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


def parse_options(options: Mapping[str, Any]) -> MooncakeOptions:
    """The checked options; unknown or ill-typed ones raise ``BackendOptionError``."""
    o = SCHEMA.parse(options)
    inflight = o["max_inflight_segments"]
    chunk = min(512, inflight) if o["chunk_segments"] is None else o["chunk_segments"]
    if chunk > inflight:
        raise SCHEMA.error(f"chunk_segments ({chunk}) must not exceed max_inflight_segments ({inflight})")
    return MooncakeOptions(o["protocol"], o["device_name"], o["hostname"], inflight, chunk, o["liveness_interval_s"])
