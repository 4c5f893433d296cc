"""Notifications next to mori's data path: a ZeroMQ PUSH/PULL side channel.

Why not mori's own mechanism: with ``enable_notification`` the *target* engine can ask
``pop_inbound_transfer_status(remote_key, transfer_uid)`` whether an inbound transfer
with a given id has landed. That is a poll for an id the target must already know, with
no payload, and it exists only for the RDMA backend. kvtransport notifications carry an
arbitrary payload (request id, block list) that the receiver does not know in advance,
for READ as well as WRITE. So each agent binds one PULL socket (its address travels in
the agent blob) and the initiator PUSHes ``(sender, payload)`` to the peer *after* mori
reported the transfer complete, which orders the message after the data.

Wire format: a msgpack array ``[version, sender_name, payload]``. Anything else is
dropped and counted (``malformed``), never raised into the engine.
"""

from __future__ import annotations

import msgspec
import zmq

__all__ = ["NOTIFY_WIRE_VERSION", "NotifyInbox", "NotifyOutbox", "NotifyError"]

NOTIFY_WIRE_VERSION = 1
#: A notification is a small control message; anything larger is refused on both ends.
MAX_NOTIFY_BYTES = 1 << 20

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(tuple[int, str, bytes])


class NotifyError(RuntimeError):
    """A notification could not be queued for sending."""


class NotifyInbox:
    """The PULL socket this agent receives notifications on."""

    def __init__(self, ctx: zmq.Context, host: str) -> None:
        self._sock = ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_NOTIFY_BYTES + 4096)
        port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self.malformed = 0

    def drain(self) -> list[tuple[str, bytes]]:
        out: list[tuple[str, bytes]] = []
        while True:
            try:
                frame = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return out
            try:
                version, sender, payload = _decoder.decode(frame)
            except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
                self.malformed += 1
                continue
            if version != NOTIFY_WIRE_VERSION:
                self.malformed += 1
                continue
            out.append((sender, payload))

    def close(self) -> None:
        self._sock.close(linger=0)


class NotifyOutbox:
    """A PUSH socket to one peer's inbox."""

    def __init__(self, ctx: zmq.Context, address: str, sender: str) -> None:
        self._sock = ctx.socket(zmq.PUSH)
        # Give queued notifications a moment to leave when the peer is forgotten.
        self._sock.setsockopt(zmq.LINGER, 500)
        # Messages queue locally while the peer's socket is not (yet) reachable.
        self._sock.setsockopt(zmq.SNDHWM, 100_000)
        self._sock.connect(address)
        self.address = address
        self._sender = sender

    def send(self, payload: bytes) -> None:
        if len(payload) > MAX_NOTIFY_BYTES:
            raise NotifyError(
                f"notification of {len(payload)} bytes exceeds the {MAX_NOTIFY_BYTES}-byte limit; "
                "send a reference to the data instead"
            )
        try:
            self._sock.send(_encoder.encode((NOTIFY_WIRE_VERSION, self._sender, bytes(payload))), zmq.NOBLOCK)
        except zmq.Again as exc:
            raise NotifyError(f"notification queue to {self.address} is full (peer not draining)") from exc

    def close(self) -> None:
        self._sock.close()
