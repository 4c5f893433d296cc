"""Agent metadata: the versioned blob one agent hands another to connect.

Decoding is strict and bounded because metadata arrives from the network: a size cap
first, then the protocol version read from a minimal header (so a foreign version gets
a clear error instead of a schema error), then the full schema with unknown fields
forbidden and every integer range-checked.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from .errors import PeerMetadataError

__all__ = [
    "PROTOCOL_VERSION",
    "MAX_METADATA_BYTES",
    "RegionDesc",
    "AgentMetadata",
    "encode_metadata",
    "decode_metadata",
]

PROTOCOL_VERSION = 1
MAGIC = "kvtransport"
#: Default cap on a peer's metadata; ``AgentConfig.max_metadata_bytes`` overrides it.
MAX_METADATA_BYTES = 4 << 20
MAX_REGIONS = 1 << 16

U64 = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
Short = Annotated[str, msgspec.Meta(max_length=64)]


class RegionDesc(msgspec.Struct, array_like=True, forbid_unknown_fields=True, frozen=True):
    id: U64
    addr: U64
    length: Annotated[int, msgspec.Meta(gt=0, le=(1 << 63) - 1)]
    kind: Short
    blob: bytes


class AgentMetadata(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    magic: str
    protocol: int
    agent: Name
    #: Random per ``open``: tells a restarted peer at the same name from the old one.
    instance: Short
    backend: Name
    backend_version: Short
    blob: bytes
    regions: Annotated[list[RegionDesc], msgspec.Meta(max_length=MAX_REGIONS)]
    #: Optional KV layout (block size, dtype, layers, bytes per block) checked on connect.
    layout: dict[Short, str | int] | None = None


class _Header(msgspec.Struct):
    magic: str = ""
    protocol: int = -1


_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(_Header)
_decoder = msgspec.msgpack.Decoder(AgentMetadata)


def encode_metadata(md: AgentMetadata) -> bytes:
    return _encoder.encode(md)


def decode_metadata(data: bytes, max_bytes: int = MAX_METADATA_BYTES) -> AgentMetadata:
    """Decode peer metadata or raise :class:`PeerMetadataError` naming what is wrong."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise PeerMetadataError(f"peer metadata must be bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise PeerMetadataError(
            f"peer metadata is {len(data)} bytes, over the {max_bytes}-byte limit; "
            "raise max_metadata_bytes if the peer really registers that many regions"
        )
    try:
        header = _header_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise PeerMetadataError(f"peer metadata is not kvtransport metadata: {exc}") from None
    if header.magic != MAGIC:
        raise PeerMetadataError("peer metadata is not kvtransport metadata (bad magic)")
    if header.protocol != PROTOCOL_VERSION:
        raise PeerMetadataError(
            f"peer speaks kvtransport metadata protocol {header.protocol}, this agent speaks "
            f"{PROTOCOL_VERSION}; run the same kvtransport version on both sides"
        )
    try:
        md = _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise PeerMetadataError(f"malformed peer metadata: {exc}") from None
    ids = [r.id for r in md.regions]
    if len(set(ids)) != len(ids):
        raise PeerMetadataError("malformed peer metadata: duplicate region ids")
    for r in md.regions:
        if r.addr + r.length > (1 << 63) - 1:
            raise PeerMetadataError(f"malformed peer metadata: region {r.id} ends past the address space")
    return md
