"""The agent blob a ``mooncake`` agent exports, decoded strictly (msgspec, typed fields).

Region addresses travel in kvtransport's own metadata (``RemoteRegion.addr``): Mooncake's
TCP and RDMA transports address remote memory by absolute address inside the peer's
registered buffers, so regions need no per-region blob.
"""

from __future__ import annotations

import re

import msgspec

from kvtransport.errors import IncompatiblePeerError, PeerMetadataError
from kvtransport.notify import KEY_BYTES

WIRE_VERSION = 1
_SESSION_RE = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):([0-9]{1,5})$")


class Export(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    v: int
    #: Mooncake session id ``host:rpc_port``: where the peer's hand-shake daemon listens.
    session: str
    protocol: str
    #: Address of the peer's registered 8-byte scratch buffer (target of the 1-byte
    #: transfer that carries a notification, see ``notify.py``).
    scratch_addr: int
    #: Who the peer is, for the same-host liveness check.
    pid: int
    start_time: int
    boot_id: str
    pid_ns: str
    #: The receiver's notification key: senders seal their notifications with it.
    notify_key: bytes


_ENC = msgspec.msgpack.Encoder()
_DEC = msgspec.msgpack.Decoder(Export)


def encode(exp: Export) -> bytes:
    return _ENC.encode(exp)


def decode(peer_name: str, blob: bytes, protocol: str) -> Export:
    """Our blob from ``peer_name``, or a typed error naming what is wrong with it."""
    try:
        exp = _DEC.decode(blob)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise PeerMetadataError(f"mooncake blob of peer {peer_name!r} is malformed: {exc}") from None
    if exp.v != WIRE_VERSION:
        raise PeerMetadataError(f"mooncake blob of peer {peer_name!r} has version {exp.v}, expected {WIRE_VERSION}")
    m = _SESSION_RE.match(exp.session)
    if m is None or not 0 < int(m.group(2)) < 65536:
        raise PeerMetadataError(f"mooncake blob of peer {peer_name!r} has an invalid session id {exp.session!r}")
    if exp.scratch_addr <= 0 or exp.pid <= 0 or len(exp.notify_key) != KEY_BYTES:
        raise PeerMetadataError(f"mooncake blob of peer {peer_name!r} has invalid fields")
    if exp.protocol != protocol:
        raise IncompatiblePeerError(f"peer {peer_name!r} runs Mooncake protocol {exp.protocol!r}, this agent "
                                    f"{protocol!r}; open both with the same protocol= option")
    return exp
