"""The envelope of every backend's agent blob: which process exported it, in which format.

A backend's agent blob (``Backend.export``) tells a peer how to reach this agent. Besides
the backend's own fields every one of them needs the same things: the exporting process's
:class:`~kvtransport.process_identity.ProcessIdentity` (pid + start time + boot id + pid
namespace), with which a same-host peer checks that the process is still the one that
exported the blob, and a format version, so that a blob of another format is refused with a
typed error naming the problem. Those fields are declared once here: a backend's blob is a
subclass of :class:`AgentBlob` that adds its own fields, and one :class:`BlobCodec` per
backend encodes it and decodes it strictly (msgspec, typed fields, unknown fields refused).
Which backend a blob belongs to is the core metadata's to say (``metadata.py``), not the
blob's.

Layout, a msgpack array: ``[pid, start_time, boot_id, <the backend's fields>..., pid_ns,
v]``. The identity comes first and the trailer (``pid_ns``, ``v``) last, both with defaults,
so the loopback blob of before the envelope (``[pid, start_time, boot_id, notify_addr,
notify_key, pid_ns]``) is the envelope's version 1.

The control message a loopback peer sends to be let in carries a bare identity:
:func:`pack_identity` / :func:`unpack_identity` are its codec.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import msgspec

from kvtransport.errors import PeerMetadataError
from kvtransport.process_identity import ProcessIdentity

__all__ = ["AgentBlob", "BlobCodec", "pack_identity", "unpack_identity"]


class _Trailer(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True, kw_only=True):
    """The envelope fields that follow a backend's own (keyword-only fields go last)."""

    #: The pid namespace ``pid`` is valid in ("" = unknown).
    pid_ns: str = ""
    #: The blob format's version (a blob that does not say is version 1).
    v: int = 1


class AgentBlob(_Trailer, frozen=True):
    """The envelope fields of a backend's agent blob; a backend subclasses it with its own
    (which come between ``boot_id`` and the trailer ``pid_ns``, ``v``)."""

    pid: int
    start_time: int
    boot_id: str

    @property
    def identity(self) -> ProcessIdentity:
        """The process that exported this blob."""
        return ProcessIdentity(self.pid, self.start_time, self.boot_id, self.pid_ns)


B = TypeVar("B", bound=AgentBlob)


class BlobCodec(Generic[B]):
    """Encodes and strictly decodes one backend's agent blob (a subclass of :class:`AgentBlob`).

    Every refusal is a :class:`~kvtransport.errors.PeerMetadataError` whose message names the
    backend, the peer and what is wrong ("malformed ... blob from peer ...", "... has
    version ...")."""

    def __init__(self, backend: str, version: int, blob_type: type[B], max_bytes: int = 4 << 20) -> None:
        self.backend = backend
        self.version = version
        self.max_bytes = max_bytes
        self._type = blob_type
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(blob_type)

    def seal(self, identity: ProcessIdentity | None = None, **fields: Any) -> B:
        """The blob of this process (or of ``identity``) with the backend's ``fields``."""
        i = identity or ProcessIdentity.current()
        return self._type(pid=i.pid, start_time=i.start_time, boot_id=i.boot_id, pid_ns=i.pid_ns, v=self.version,
                          **fields)

    def encode(self, blob: B) -> bytes:
        return self._enc.encode(blob)

    def decode(self, data: bytes, peer_name: str = "?") -> B:
        """The blob ``peer_name`` exported, or a typed error naming what is wrong with it."""
        what = f"{self.backend} blob of peer {peer_name!r}"
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise PeerMetadataError(f"{what} must be bytes, got {type(data).__name__}")
        if len(data) > self.max_bytes:
            raise PeerMetadataError(f"{what} is {len(data)} bytes, over the {self.max_bytes}-byte limit")
        try:
            blob = self._dec.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise PeerMetadataError(f"malformed {self.backend} blob from peer {peer_name!r}: {exc}") from None
        if blob.v != self.version:
            raise PeerMetadataError(f"{what} has version {blob.v}, expected {self.version}; run the same "
                                    "kvtransport version on both sides")
        return blob


class _Identity(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    pid: int
    start_time: int
    boot_id: str
    pid_ns: str


_identity_decoder = msgspec.msgpack.Decoder(_Identity)


def pack_identity(ident: ProcessIdentity) -> bytes:
    """``ident`` as bytes for a control message."""
    return msgspec.msgpack.encode(_Identity(ident.pid, ident.start_time, ident.boot_id, ident.pid_ns))


def unpack_identity(data: bytes) -> ProcessIdentity:
    """The identity :func:`pack_identity` packed (raises ``msgspec.DecodeError`` /
    ``ValidationError`` on anything else)."""
    i = _identity_decoder.decode(data)
    return ProcessIdentity(i.pid, i.start_time, i.boot_id, i.pid_ns)
