"""ZMQ side channel: hand-shake and control messages between connector workers.

One ROUTER socket per worker (TP rank r binds ``port + r``), served by a daemon thread
that decodes each request, hands it to the worker's handler and sends the reply. Peers
talk to it through a DEALER (:class:`SideChannelClient`), never blocking: the worker
sends and later collects replies in its per-step progress, so a dead peer can never
stall vLLM's engine loop.

Confidentiality and authentication: the Welcome reply carries this agent's metadata
(addresses and, for RDMA backends, remote keys); whoever reads it can read or write our KV
cache. So every request and every reply is sealed with the cluster secret
(:class:`kvtransport.auth.Authenticator`: AES-256-GCM under a per-message key derived from
the secret; channel, direction, timestamp and nonce authenticated; replays and stale
messages refused): a tap on the path sees ciphertext only. Each request is sealed for
the worker it addresses, named by its side-channel endpoint (:func:`endpoint_name`: the
advertised host and the port, which is the worker's DP and TP rank, docs/vllm/USAGE.md); a
server opens only requests sealed for one of its own names (:class:`OwnNames`, in
:mod:`.side_channel_names`), so a request captured on its way to one worker and
replayed to another is refused and counted (``misdirected``, also in ``auth``). Each
reply names the same worker and is bound to the nonce of the request it answers; the client keeps the nonces of its
unanswered requests (bounded) and accepts a reply only as the answer to one of them,
once: a reply reaches only the requester that sealed that nonce. A request that
fails authentication never reaches the handler: it gets at most a short unsealed
``Error(code="auth")`` naming the fix (a hint, never acted upon), and once failures
exceed ``auth_fail_rate`` per second (token bucket) not even that: it is dropped.

Hostile input: ZMQ drops frames over ``max_message_bytes`` (``MAXMSGSIZE``) before they
are read; bodies are decoded strictly (unknown tags, fields, wrong types refused); the
version is checked before the body is interpreted; handler exceptions become ``Error``
replies and never kill the thread.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

import msgspec
import zmq

from kvtransport.auth import AuthError, Authenticator, AuthVersionError, MisdirectedError, StaleMessageError

from .messages import PROTOCOL_VERSION, Error, Msg, decode, encode, peek_version
from .side_channel_names import NamesSeenFrom, OwnNames, endpoint_name

log = logging.getLogger(__name__)

__all__ = ["SideChannelServer", "SideChannelClient", "SideChannelError", "TokenBucket", "OwnNames", "endpoint_name",
           "Transmit", "send_sealed"]


class SideChannelError(RuntimeError):
    """The side channel could not start (port in use, bad host)."""


def _endpoint(host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


class TokenBucket:
    """``rate`` events per second, bursts of ``burst``: :meth:`take` says whether one more fits."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate, self.burst = float(rate), float(burst)
        self._tokens = float(burst)
        self._t = time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self._tokens = min(self.burst, self._tokens + (now - self._t) * self.rate)
        self._t = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False


class SideChannelServer:
    """Serves ``handler(msg) -> reply`` on a ROUTER socket in a daemon thread."""

    def __init__(
        self,
        host: str,
        port: int,
        handler: Callable[[Msg], Msg],
        *,
        auth: Authenticator | None,
        max_message_bytes: int = 16 * 1024 * 1024,
        bind_host: str | None = None,
        auth_fail_rate: float = 10.0,
        auth_fail_burst: float = 20.0,
    ) -> None:
        """``auth`` is required: pass None only when authentication is explicitly off."""
        self.host, self.port = host, port
        self._handler = handler
        self._auth = auth
        self._fail_bucket = TokenBucket(auth_fail_rate, auth_fail_burst)
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
                "Choose another side_channel_port (DP rank d, TP rank r use port + d * TP size + r) or stop the "
                "process already using it."
            ) from exc
        self._stop = threading.Event()
        #: the names requests may be sealed for: from a peer elsewhere, from this host
        self._names = OwnNames(host, port, bind_host, local_peer=False)
        self._local_names = OwnNames(host, port, bind_host, local_peer=True)
        #: refused requests by reason ("auth", "malformed", "version"), and refusals
        #: dropped without any reply because the failure rate limit was exceeded;
        #: ``misdirected`` (also counted in ``auth``): authentic requests sealed for
        #: another worker (replayed here, or addressed by a name we do not answer to)
        self.counters = {"served": 0, "auth": 0, "misdirected": 0, "malformed": 0, "version": 0, "dropped": 0}
        self._thread = threading.Thread(target=self._run, name=f"kvt-side-channel-{port}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if not dict(poller.poll(50)):
                    continue
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.ZMQError:
                if self._stop.is_set():
                    break
                continue
            if len(frames) < 2:
                continue
            ident, payload = frames[0].bytes, frames[-1].bytes
            out = self._handle(payload, NamesSeenFrom(self._names, self._local_names, frames[-1]))
            if out is None:
                continue
            try:
                self._sock.send_multipart([ident, out], zmq.NOBLOCK)
            except zmq.ZMQError:
                log.debug("side channel: reply to a vanished peer dropped")
        self._sock.close(0)

    def _refuse(self, code: str, message: str, cid: int = 0) -> bytes | None:
        """A refusal reply, unsealed (it carries nothing secret); None once failures
        exceed the rate limit, so a flood costs us no replies."""
        self.counters[code] += 1
        if not self._fail_bucket.take():
            self.counters["dropped"] += 1
            return None
        if self.counters[code] in (1, 10, 100, 1000) or self.counters[code] % 10000 == 0:
            log.warning("side channel %s:%d refused a request (%s, %d so far): %s",
                        self.host, self.port, code, self.counters[code], message)
        return encode(Error(cid=cid, code=code, message=message))

    def _handle(self, payload: bytes, names: NamesSeenFrom) -> bytes | None:
        """Reply bytes for one request frame (None: no reply); ``names``: what it may be
        sealed for, as seen from the connection it came on."""
        body, nonce, dest = payload, None, ""
        if self._auth is not None:
            try:
                body = self._auth.open(payload, "req", to=names)
                nonce, dest = Authenticator.nonce_of(payload), Authenticator.dest_of(payload)
            except MisdirectedError as exc:
                self.counters["misdirected"] += 1
                return self._refuse("auth", f"side-channel request misdirected, refused: {exc}. It was captured on "
                                    "its way to another worker and replayed here, or its sender names this worker "
                                    f"otherwise than it advertises itself: address it as {self._names.advertised} "
                                    "(its side_channel_host and port)")
            except (AuthVersionError, StaleMessageError) as exc:  # the secret is not the problem
                return self._refuse("auth", f"side-channel request not authenticated: {exc}")
            except AuthError as exc:
                return self._refuse("auth", f"side-channel request not authenticated ({exc}); set the same "
                                    "side_channel_secret / KVTRANSPORT_SECRET on both engines")
        v = peek_version(body)
        if v is not None and v != PROTOCOL_VERSION:
            return self._refuse("version", f"side-channel protocol version {v} is not {PROTOCOL_VERSION}; "
                                "run the same kvtransport version on both engines")
        try:
            msg = decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return self._refuse("malformed", f"undecodable side-channel message: {exc}")
        try:
            reply = self._handler(msg)
        except Exception as exc:  # the handler must never kill the thread
            log.exception("side channel handler failed on %s", type(msg).__name__)
            reply = Error(code="internal", message=str(exc))
        self.counters["served"] += 1
        reply.cid = msg.cid
        out = encode(reply)
        return self._auth.seal(out, "rep", to=dest, request_nonce=nonce) if self._auth is not None else out

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)


class _CidOnly(msgspec.Struct):
    cid: int = 0


_CID_DECODER = msgspec.msgpack.Decoder(_CidOnly)


def _cid_of(body: bytes) -> int | None:
    """The ``cid`` of an encoded request body, or None when it carries none."""
    try:
        return _CID_DECODER.decode(body).cid
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def send_sealed(client: SideChannelClient, body: bytes) -> None:
    """Seal one request body and send it: how a client's requests leave by default."""
    client.send_frame(client.seal(body))


#: How a client puts one encoded request body on the wire: ``transmit(client, body)``,
#: built from :meth:`SideChannelClient.seal` and :meth:`SideChannelClient.send_frame`.
#: :func:`send_sealed` by default; a model of a lossy network passes its own (dropping,
#: delaying, or sending a frame twice).
Transmit = Callable[["SideChannelClient", bytes], None]


class SideChannelClient:
    """Non-blocking request/reply to one peer's server (DEALER socket, main thread only).

    With authentication on, every request is sealed for the worker at ``host:port``
    (:func:`endpoint_name`: peers name a worker by the address it advertises, so a worker
    that does not answer to that name refuses it, naming both) and remembered (its nonce
    and cid) until its reply arrives; a reply is accepted only if it names that worker,
    is bound to one of those nonces, carries that request's cid, and is the first answer
    to it. At most ``max_pending`` unanswered requests are remembered (the oldest is
    forgotten first; a late reply to it is then refused and counted)."""

    _cids = itertools.count(1)

    #: A peer that has sent nothing back for this long while our requests wait is taken as
    #: unreachable: before the next send the socket is replaced, which drops what ZMQ
    #: queued for it. A DEALER queues requests to a peer that is down and delivers them all
    #: when it comes back; a restarted producer would get a burst of requests meant for its
    #: previous incarnation (each refused as stale, with a warning).
    #: The connector re-sends every request it still waits on (hand-shake, confirmation,
    #: cancel, write request, renewal); a dropped release leaves the blocks to the
    #: producer's lease.
    RECONNECT_AFTER_S = 5.0

    def __init__(self, host: str, port: int, *, auth: Authenticator | None,
                 max_message_bytes: int = 16 * 1024 * 1024, max_pending: int = 8192,
                 reconnect_after_s: float | None = None, transmit: Transmit | None = None):
        """``auth`` is required: pass None only when authentication is explicitly off.
        ``transmit``: how requests leave (default :func:`send_sealed`)."""
        self.host, self.port = host, port
        self._transmit: Transmit = send_sealed if transmit is None else transmit
        #: the worker our requests are sealed for
        self.dest = endpoint_name(host, port)
        self._auth = auth
        self._max_message_bytes = int(max_message_bytes)
        self._reconnect_after_s = self.RECONNECT_AFTER_S if reconnect_after_s is None else float(reconnect_after_s)
        #: since when requests have been waiting with no frame from the peer (None: not waiting)
        self._silent_since: float | None = None
        #: how often the socket was replaced because the peer stayed silent
        self.reconnects = 0
        #: replies dropped: not authentic (forged, replayed, bound to no outstanding request
        #: of ours, or the peer refused us), undecodable; ``misbound`` (also counted in
        #: ``auth``): sealed replies that answer no request of ours still waiting for one,
        #: or that name another worker than the one we address
        self.counters = {"auth": 0, "malformed": 0, "misbound": 0}
        self._pending: OrderedDict[bytes, int | None] = OrderedDict()  # request nonce -> cid
        self._max_pending = max(1, int(max_pending))
        self._pending_lock = threading.Lock()
        self._sock = self._open_socket()

    def _open_socket(self) -> zmq.Socket:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self._max_message_bytes)
        sock.setsockopt(zmq.SNDHWM, 10000)
        if ":" in self.host:
            sock.setsockopt(zmq.IPV6, 1)
        sock.connect(_endpoint(self.host, self.port))
        return sock

    def _reconnect_if_silent(self, now: float) -> None:
        """Replace the socket when the peer has answered nothing for ``reconnect_after_s``
        while requests waited (see :attr:`RECONNECT_AFTER_S`). Replies to the dropped
        requests can no longer arrive, so their nonces are forgotten too."""
        if self._silent_since is None:
            self._silent_since = now
            return
        if now - self._silent_since <= self._reconnect_after_s:
            return
        if self._sock.get(zmq.EVENTS) & zmq.POLLIN:
            return  # an answer waits, not yet polled: the peer is there
        self._sock.close(0)
        self._sock = self._open_socket()
        with self._pending_lock:
            self._pending.clear()
        self.reconnects += 1
        self._silent_since = now
        log.info("side channel to %s:%s: no answer for %.1fs, reconnected (queued requests dropped; "
                 "wanted ones are re-sent)", self.host, self.port, self._reconnect_after_s)

    def send(self, msg: Msg) -> int:
        msg.cid = next(self._cids)
        self._reconnect_if_silent(time.monotonic())  # before sealing: a reconnect forgets nonces
        self._transmit(self, encode(msg))
        return msg.cid

    def seal(self, body: bytes) -> bytes:
        """The wire frame of a request body (sealed unless auth is explicitly off); a
        sealed request is remembered as waiting for its reply."""
        if self._auth is None:
            return body
        frame = self._auth.seal(body, "req", to=self.dest)
        with self._pending_lock:
            self._pending[Authenticator.nonce_of(frame)] = _cid_of(body)
            while len(self._pending) > self._max_pending:
                self._pending.popitem(last=False)
        return frame

    @property
    def pending(self) -> int:
        """Sealed requests still waiting for their reply."""
        return len(self._pending)

    def send_frame(self, frame: bytes) -> None:
        try:
            self._sock.send_multipart([frame], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # HWM reached: the peer is not draining
            log.warning("side channel to %s:%s: send dropped (%s)", self.host, self.port, exc)

    @property
    def socket(self) -> zmq.Socket:
        """The DEALER socket, for a caller that polls several clients at once."""
        return self._sock

    def poll(self) -> list[Msg]:
        out: list[Msg] = []
        # Called several times per engine step for every peer: ask the socket whether a frame
        # is waiting (an int option read) instead of paying for a zmq.Again exception per call.
        while self._sock.get(zmq.EVENTS) & zmq.POLLIN:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return out
            self._silent_since = None  # the peer is there
            body = frames[-1]
            if self._auth is not None:
                try:
                    body = self._open_reply(body)
                except AuthError as exc:
                    self._unauthentic(body, exc)
                    continue
            try:
                out.append(decode(body))
            except (msgspec.DecodeError, msgspec.ValidationError):
                self.counters["malformed"] += 1
                log.warning("side channel: undecodable reply from %s:%s dropped", self.host, self.port)
        return out

    def _open_reply(self, frame: bytes) -> bytes:
        """The body of an authentic reply to one of our unanswered requests, which is then
        answered; else AuthError. The request is forgotten only once its reply proved
        authentic, so a forged frame naming a pending nonce cannot cancel the real answer."""
        assert self._auth is not None
        request_nonce = Authenticator.reply_to(frame)
        if request_nonce is None:
            Authenticator.nonce_of(frame)  # not a sealed frame of ours: AuthError says why
            self.counters["misbound"] += 1
            raise AuthError("sealed reply bound to no request; every reply must answer one of ours")
        with self._pending_lock:
            known = request_nonce in self._pending
            cid = self._pending.get(request_nonce)
        if not known:
            self.counters["misbound"] += 1
            raise AuthError("reply to no request of ours still waiting for one (already answered, "
                            "forgotten, or sent to another client): replayed or misdirected")
        try:
            body = self._auth.open(frame, "rep", to=self.dest, request_nonce=request_nonce)
        except MisdirectedError:
            self.counters["misbound"] += 1
            raise
        got = _cid_of(body)
        if cid is not None and got != cid:
            self.counters["misbound"] += 1
            raise AuthError(f"reply carries cid {got}, its request had cid {cid}")
        with self._pending_lock:
            self._pending.pop(request_nonce, None)
        return body

    def _unauthentic(self, frame: bytes, exc: AuthError) -> None:
        """Drop a reply that is not authentic. If it is the server's unsealed refusal, log
        its reason (a hint for the operator only: it is never acted upon)."""
        self.counters["auth"] += 1
        hint = str(exc)
        try:
            msg = decode(frame)
            if isinstance(msg, Error):
                hint = f"peer says: {msg.message[:300]}"
        except (msgspec.DecodeError, msgspec.ValidationError):
            pass
        n = self.counters["auth"]
        if n in (1, 10, 100) or n % 1000 == 0:
            log.warning("side channel to %s:%s: reply not authenticated, dropped (%d so far): %s",
                        self.host, self.port, n, hint)

    def close(self) -> None:
        self._sock.close(0)


def wait_for_any(clients: list[SideChannelClient], event: threading.Event | None, timeout_s: float) -> bool:
    """Block up to ``timeout_s`` until one of ``clients`` has a reply waiting or ``event`` is
    set; True if so. ZMQ sockets and a thread's event cannot be waited on together, so with
    both they are checked in turn every 0.2 ms."""
    give_up = time.monotonic() + timeout_s
    poller = zmq.Poller()
    for c in clients:
        poller.register(c.socket, zmq.POLLIN)
    if event is None:
        return bool(clients) and bool(poller.poll(max(1, math.ceil(timeout_s * 1000))))
    if not clients:
        return event.wait(timeout_s)
    while True:
        if poller.poll(0) or event.is_set():
            return True
        left = give_up - time.monotonic()
        if left <= 0:
            return False
        event.wait(min(left, 0.0002))

