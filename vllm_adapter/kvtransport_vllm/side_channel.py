"""ZMQ side channel: hand-shake and control messages between connector workers.

One ROUTER socket per worker (TP rank r binds ``port + r``), served by a daemon thread
that decodes each request, hands it to the worker's handler and sends the reply. Peers
talk to it through a DEALER (:class:`SideChannelClient`), never blocking: the worker
sends and later collects replies in its per-step progress, so a dead peer can never
stall vLLM's engine loop.

Bad input (undecodable, wrong version, wrong token, oversized: ZMQ drops those at
``MAXMSGSIZE``) gets an :class:`~.messages.Error` reply or is dropped, and never reaches
the handler.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable

import msgspec
import zmq

from .messages import PROTOCOL_VERSION, Error, Msg, decode, encode

log = logging.getLogger(__name__)

__all__ = ["SideChannelServer", "SideChannelClient", "SideChannelError"]


class SideChannelError(RuntimeError):
    """The side channel could not start (port in use, bad host)."""


def _endpoint(host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


class SideChannelServer:
    """Serves ``handler(msg) -> reply`` on a ROUTER socket in a daemon thread."""

    def __init__(
        self,
        host: str,
        port: int,
        handler: Callable[[Msg], Msg],
        token: str = "",
        max_message_bytes: int = 16 * 1024 * 1024,
        bind_host: str | None = None,
    ) -> None:
        self.host, self.port = host, port
        self._handler = handler
        self._token = token
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, int(max_message_bytes))
        if ":" in (bind_host or host):
            self._sock.setsockopt(zmq.IPV6, 1)
        try:
            self._sock.bind(_endpoint(bind_host or host, port))
        except zmq.ZMQError as exc:
            self._sock.close(0)
            raise SideChannelError(
                f"kvtransport side channel cannot listen on {host}:{port}: {exc}. "
                "Choose another side_channel_port (TP rank r uses port + r) or stop the "
                "process already using it."
            ) from exc
        self._stop = threading.Event()
        self.rejected = 0
        self._thread = threading.Thread(target=self._run, name=f"kvt-side-channel-{port}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if not dict(poller.poll(50)):
                    continue
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:
                if self._stop.is_set():
                    break
                continue
            if len(frames) < 2:
                continue
            ident, payload = frames[0], frames[-1]
            reply = self._handle(payload)
            try:
                self._sock.send_multipart([ident, encode(reply)], zmq.NOBLOCK)
            except zmq.ZMQError:
                log.debug("side channel: reply to a vanished peer dropped")
        self._sock.close(0)

    def _handle(self, payload: bytes) -> Msg:
        try:
            msg = decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.rejected += 1
            return Error(code="malformed", message=f"undecodable side-channel message: {exc}")
        if msg.v != PROTOCOL_VERSION:
            self.rejected += 1
            return Error(
                cid=msg.cid,
                code="version",
                message=f"side-channel protocol version {msg.v} is not {PROTOCOL_VERSION}; "
                "run the same kvtransport version on both engines",
            )
        if self._token and msg.token != self._token:
            self.rejected += 1
            return Error(cid=msg.cid, code="auth", message="side_channel_token mismatch")
        try:
            reply = self._handler(msg)
        except Exception as exc:  # the handler must never kill the thread
            log.exception("side channel handler failed on %s", type(msg).__name__)
            return Error(cid=msg.cid, code="internal", message=str(exc))
        reply.cid = msg.cid
        return reply

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)


class SideChannelClient:
    """Non-blocking request/reply to one peer's server (DEALER socket, main thread only)."""

    _cids = itertools.count(1)

    def __init__(self, host: str, port: int, token: str = "", max_message_bytes: int = 16 * 1024 * 1024):
        self.host, self.port = host, port
        self._token = token
        self._sock = zmq.Context.instance().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, int(max_message_bytes))
        self._sock.setsockopt(zmq.SNDHWM, 10000)
        if ":" in host:
            self._sock.setsockopt(zmq.IPV6, 1)
        self._sock.connect(_endpoint(host, port))

    def send(self, msg: Msg) -> int:
        msg.cid = next(self._cids)
        msg.token = self._token
        try:
            self._sock.send_multipart([encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # HWM reached: the peer is not draining
            log.warning("side channel to %s:%s: send dropped (%s)", self.host, self.port, exc)
        return msg.cid

    def poll(self) -> list[Msg]:
        out: list[Msg] = []
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return out
            try:
                out.append(decode(frames[-1]))
            except (msgspec.DecodeError, msgspec.ValidationError):
                log.warning("side channel: undecodable reply from %s:%s dropped", self.host, self.port)

    def close(self) -> None:
        self._sock.close(0)
