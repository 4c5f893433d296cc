"""The agent-level blob a moriio agent exports, and its strict decoding.

The core wraps this blob in its own versioned metadata (agent name, regions with their
per-region blobs = packed mori ``MemoryDesc``). Here we only carry what mori needs to reach
this agent (its packed ``EngineDesc``: engine key, host, port) and where to send
notifications (address and the receiver's key). Decoding is strict: a blob we cannot use raises ``PeerMetadataError``
naming what is wrong, never a bare msgspec or pybind11 error.
"""

from __future__ import annotations

import msgspec

from kvtransport.errors import PeerMetadataError

__all__ = ["WIRE_VERSION", "AgentBlob", "encode_agent_blob", "decode_agent_blob"]

WIRE_VERSION = 1
MAX_BLOB_BYTES = 64 * 1024


class AgentBlob(msgspec.Struct, array_like=True, frozen=True):
    version: int
    engine_key: str
    engine_desc: bytes  # mori EngineDesc.pack()
    notify_address: str  # tcp://host:port of the agent's notification PULL socket
    transport: str  # "rdma" | "xgmi"
    #: Key of the agent's notification receiver (kvtransport.notify); senders seal with it.
    #: Last and defaulted so a blob from before authenticated notifications decodes and is
    #: then refused at connect with a message saying so.
    notify_key: bytes = b""


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(AgentBlob)


def encode_agent_blob(blob: AgentBlob) -> bytes:
    return _enc.encode(blob)


def decode_agent_blob(data: bytes, peer_name: str) -> AgentBlob:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise PeerMetadataError(f"moriio blob of peer {peer_name!r} must be bytes, got {type(data).__name__}")
    if len(data) > MAX_BLOB_BYTES:
        raise PeerMetadataError(
            f"moriio blob of peer {peer_name!r} is {len(data)} bytes, over the {MAX_BLOB_BYTES}-byte limit"
        )
    try:
        blob = _dec.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise PeerMetadataError(
            f"moriio blob of peer {peer_name!r} is not a moriio agent blob ({exc}); "
            "was the metadata produced by a moriio agent of this kvtransport version?"
        ) from None
    if blob.version != WIRE_VERSION:
        raise PeerMetadataError(
            f"moriio blob of peer {peer_name!r} has wire version {blob.version}, expected {WIRE_VERSION}; "
            "upgrade both sides to the same kvtransport version"
        )
    if not blob.notify_address.startswith("tcp://"):
        raise PeerMetadataError(f"moriio blob of peer {peer_name!r} has a bad notify address {blob.notify_address!r}")
    return blob
