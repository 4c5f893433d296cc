"""The agent blob a ``mooncake`` agent exports, decoded strictly.

The core's envelope (:mod:`kvtransport.blob`: version, and the exporting process for the
same-host liveness check) with Mooncake's session id, the scratch buffer that carries
notifications, and the notification key. Region addresses travel in kvtransport's own
metadata (``RemoteRegion.addr``): Mooncake's TCP and RDMA transports address remote memory
by absolute address inside the peer's registered buffers, so regions need no per-region blob.
"""

from __future__ import annotations

import re

from kvtransport.blob import AgentBlob, BlobCodec
from kvtransport.errors import IncompatiblePeerError, PeerMetadataError
from kvtransport.notify import KEY_BYTES

__all__ = ["CODEC", "MooncakeBlob", "decode"]

_SESSION_RE = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):([0-9]{1,5})$")


class MooncakeBlob(AgentBlob, frozen=True):
    #: Mooncake session id ``host:rpc_port``: where the peer's hand-shake daemon listens.
    session: str
    protocol: str
    #: Address of the peer's registered 8-byte scratch buffer (target of the 1-byte
    #: transfer that carries a notification, see ``notify.py``).
    scratch_addr: int
    #: The receiver's notification key: senders seal their notifications with it.
    notify_key: bytes


#: Version 2: the envelope of kvtransport.blob (version 1 had its own identity fields).
CODEC = BlobCodec("mooncake", 2, MooncakeBlob)


def decode(peer_name: str, blob: bytes, protocol: str) -> MooncakeBlob:
    """Our blob from ``peer_name``, or a typed error naming what is wrong with it."""
    exp = CODEC.decode(blob, peer_name)
    m = _SESSION_RE.match(exp.session)
    if m is None or not 0 < int(m.group(2)) < 65536:
        raise PeerMetadataError(f"mooncake blob of peer {peer_name!r} has an invalid session id {exp.session!r}")
    if exp.scratch_addr <= 0 or exp.identity.pid <= 0 or len(exp.notify_key) != KEY_BYTES:
        raise PeerMetadataError(f"mooncake blob of peer {peer_name!r} has invalid fields")
    if exp.protocol != protocol:
        raise IncompatiblePeerError(f"peer {peer_name!r} runs Mooncake protocol {exp.protocol!r}, this agent "
                                    f"{protocol!r}; open both with the same protocol= option")
    return exp
