"""What a nixl agent exports, and the per-region blob of its device memory.

The agent blob is the core's envelope (:mod:`kvtransport.blob`: version and the exporting
process, for the same-host liveness check) with NIXL's own agent metadata inside as opaque
bytes, which NIXL's deserializer checks when we load it (``add_remote_agent``); a corrupt
one is refused with ``NIXL_ERR_MISMATCH``.
"""

from __future__ import annotations

import struct

from kvtransport.blob import AgentBlob, BlobCodec
from kvtransport.errors import PeerMetadataError
from kvtransport.spi import RemoteRegion

__all__ = ["CODEC", "NixlBlob", "region_blob", "region_device"]


class NixlBlob(AgentBlob, frozen=True):
    """NIXL's agent metadata and the agent's NIXL name and plugins."""

    nixl_name: str
    nixl_md: bytes
    plugins: list[str]


#: Version 2: the envelope of kvtransport.blob (version 1 had its own identity fields).
CODEC = BlobCodec("nixl", 2, NixlBlob)

#: A region's blob: empty for CPU memory (DRAM, device 0); for device memory (VRAM) the
#: device index it was registered on, which NIXL needs in the peer's transfer descriptors
#: (NIXL finds a remote region by device and address).
_DEV = struct.Struct("<I")


def region_blob(kind: str, dev: int) -> bytes:
    return b"" if kind == "DRAM" else _DEV.pack(dev)


def region_device(peer_name: str, r: RemoteRegion) -> int:
    """The NIXL device index of a peer's region, from its blob (strict)."""
    if r.kind == "cpu" and not r.blob:
        return 0
    if r.kind == "cuda" and len(r.blob) == _DEV.size:
        return _DEV.unpack(r.blob)[0]
    raise PeerMetadataError(f"nixl peer {peer_name!r}: region {r.id} ({r.kind}) has a malformed blob "
                            f"({len(r.blob)} bytes)")
