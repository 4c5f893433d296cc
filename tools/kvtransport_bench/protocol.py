"""The bench's side channel: messages between the decode (client) and prefill (server)
processes, over ZMQ REQ/REP, each sealed with the run's secret by ``kvtransport.auth``.

Decode connects to prefill; they swap agent metadata (``Hello`` -> ``Result``), then per
request: READ -- ``Prepare`` (prefill fills blocks and names them: ``Prepared``), decode
pulls with one batched READ, then ``Confirm`` (prefill saw the read notification);
WRITE -- ``WriteInto`` (decode names its free blocks; prefill fills and pushes them with
one batched WRITE plus a notification, answering ``Result``); ``Bye`` ends the run.

Every reply is bound to the request it answers (``request_nonce``), so a reply cannot be
replayed as the answer to another request.
"""

from __future__ import annotations

from typing import Any

import msgspec
import zmq

from kvtransport.auth import AuthError, Authenticator

__all__ = ["Hello", "Prepare", "Prepared", "Confirm", "WriteInto", "Result", "Bye", "Msg",
           "CHANNEL", "MAX_MESSAGE_BYTES", "Server", "Client"]

#: Channel name mixed into every seal: a bench frame is refused on any other channel.
CHANNEL = "kvtransport-bench"
#: Largest frame a socket accepts (agent metadata of a big cache is the largest message).
MAX_MESSAGE_BYTES = 64 << 20


class Hello(msgspec.Struct, tag=True):
    metadata: bytes


class Prepare(msgspec.Struct, tag=True):  # READ: fill blocks for request, name them
    req: int
    n: int


class Prepared(msgspec.Struct, tag=True):
    blocks: list[int]


class Confirm(msgspec.Struct, tag=True):  # READ: decode read request `req`
    req: int


class WriteInto(msgspec.Struct, tag=True):  # WRITE: push request `req` into these blocks
    req: int
    blocks: list[int]


class Result(msgspec.Struct, tag=True):
    ok: bool
    detail: str = ""
    latency_s: float = 0.0
    metadata: bytes = b""


class Bye(msgspec.Struct, tag=True):
    pass


Msg = Hello | Prepare | Prepared | Confirm | WriteInto | Result | Bye
_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(Msg)


class Server:
    """The prefill side: a REP socket bound on 127.0.0.1, one request at a time."""

    def __init__(self, ctx: zmq.Context, secret: bytes, port: int = 0):
        self._auth = Authenticator(secret, CHANNEL)
        self._sock = ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        if port:
            self._sock.bind(f"tcp://127.0.0.1:{port}")
            self.port = port
        else:
            self.port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self._pending: bytes | None = None  # nonce of the request being answered

    def recv(self) -> Msg | Result:
        """The next request, or, when it cannot be opened or decoded, the refusal to send
        back (a ``Result`` with ``ok=False``): the caller replies with it and goes on."""
        frame = self._sock.recv()
        try:
            self._pending = Authenticator.nonce_of(frame)
        except AuthError:
            self._pending = None
        try:
            return _dec.decode(self._auth.open(frame, "req"))
        except (AuthError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            return Result(False, f"refused: {exc}")

    def reply(self, msg: Any) -> None:
        self._sock.send(self._auth.seal(_enc.encode(msg), "rep", request_nonce=self._pending))
        self._pending = None

    def close(self) -> None:
        self._sock.close(0)


class Client:
    """The decode side: a REQ socket; :meth:`call` sends one request and returns its reply."""

    def __init__(self, ctx: zmq.Context, secret: bytes, port: int, timeout_s: float):
        self._auth = Authenticator(secret, CHANNEL)
        self._sock = ctx.socket(zmq.REQ)
        self._sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self._sock.connect(f"tcp://127.0.0.1:{port}")

    def call(self, msg: Any) -> Any:
        frame = self._auth.seal(_enc.encode(msg), "req")
        self._sock.send(frame)
        reply = self._sock.recv()
        return _dec.decode(self._auth.open(reply, "rep", request_nonce=Authenticator.nonce_of(frame)))

    def close(self) -> None:
        self._sock.close(0)
