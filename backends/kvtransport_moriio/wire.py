"""The agent-level blob a moriio agent exports, and its strict decoding.

The core wraps this blob in its own versioned metadata (agent name, regions with their
per-region blobs = packed mori ``MemoryDesc``). Here we only carry what mori needs to reach
this agent (its packed ``EngineDesc``: engine key, host, port) and where to send
notifications (address and the receiver's key), inside the core's envelope
(:mod:`kvtransport.blob`: version and exporting process). Decoding is strict: a blob we
cannot use raises ``PeerMetadataError`` naming what is wrong, never a bare msgspec or
pybind11 error.
"""

from __future__ import annotations

from kvtransport.blob import AgentBlob, BlobCodec
from kvtransport.errors import PeerMetadataError

__all__ = ["WIRE_VERSION", "CODEC", "MoriioBlob", "encode_agent_blob", "decode_agent_blob"]

#: Version 2: the envelope of kvtransport.blob (version 1 was a bare array).
WIRE_VERSION = 2
MAX_BLOB_BYTES = 64 * 1024


class MoriioBlob(AgentBlob, frozen=True):
    engine_key: str
    engine_desc: bytes  # mori EngineDesc.pack()
    notify_address: str  # tcp://host:port of the agent's notification PULL socket
    transport: str  # "rdma" | "xgmi"
    #: Key of the agent's notification receiver (kvtransport.notify); senders seal with it.
    #: Defaulted so a blob without one decodes and is then refused at connect with a message
    #: saying so.
    notify_key: bytes = b""


CODEC = BlobCodec("moriio", WIRE_VERSION, MoriioBlob, max_bytes=MAX_BLOB_BYTES)


def encode_agent_blob(blob: MoriioBlob) -> bytes:
    return CODEC.encode(blob)


def decode_agent_blob(data: bytes, peer_name: str) -> MoriioBlob:
    blob = CODEC.decode(data, peer_name)
    if not blob.notify_address.startswith("tcp://"):
        raise PeerMetadataError(f"moriio blob of peer {peer_name!r} has a bad notify address {blob.notify_address!r}")
    return blob
