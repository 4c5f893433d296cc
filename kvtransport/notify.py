"""Authenticated notifications: one receiver per agent, one sender per peer.

A notification says "your bytes have landed" (or carries a standalone control message).
Whoever can forge one can make an engine use KV blocks that were never written, so a
notification is accepted only when it proves it comes from someone the receiving agent
trusted with its metadata. Backends (loopback over ``ipc://``, moriio over ``tcp://``)
use this module instead of a bare ZMQ socket; it never imports a backend.

Which key. Every receiver makes a random 32-byte key when it opens
(:func:`new_notification_key`) and the backend puts it in its metadata blob, next to
what already grants memory access (pid for CMA, mori memory descriptors, rkeys). A
sender seals every message with the *receiver's* key. We chose this over the cluster
secret because:

* the library API (``kvt.open("loopback")``) works without any cluster secret, and a
  notification path that silently went unauthenticated without one would be the bug
  this module exists to fix;
* it grants exactly what the metadata already grants: a process that can notify us is
  one we gave our metadata, i.e. one that could already read and write our memory.
  Metadata crosses the network only over the authenticated (and encrypted) side
  channel, so the key does too;
* a restarted agent has a new key: frames captured for the old instance are refused by
  the new one even inside the replay window.

What it does not prove: which of the metadata holders sent a message. The sender name
inside the sealed body is asserted by a key holder, who could also read or write our
memory; that is the trust boundary, and it is the same one the memory keys draw.

Wire: one ZMQ frame, ``Authenticator(key, CHANNEL).seal(body)`` (``kvtransport.auth``:
authenticated and encrypted, with a timestamp and a nonce), where ``body`` is the
msgpack array ``[WIRE_VERSION, kind, sender, payload]``. ``kind`` ``"n"`` is a
notification, delivered by :meth:`NotificationReceiver.drain`; any other kind is a
control message handed to the ``on_control`` callback given to the receiver (loopback
uses one to learn which process to let attach; see its ``ptrace`` module), or refused
when the receiver has none. Anything that does not open (unsealed, wrong key, stale,
replayed nonce) or does not decode is refused: dropped, counted in
:attr:`NotificationReceiver.refusals`, logged (first one, then every 1000th), never
raised into the engine. Backends expose the count as ``notification_refusals`` in
``describe()``. Replay protection is the authenticator's: a nonce seen within its window
(30 s) is refused, a frame older than the window is refused as stale, so the clocks of
sender and receiver must agree within it. A receiver remembers up to 2**18 nonces in
the window (about 8,700 notifications per second sustained); beyond that genuine
messages are refused too, and counted.

Threading: the receiver owns its PULL socket on its own thread, so control messages are
handled even while the engine never calls ``notifications()``, and refusals are counted
as they arrive. Messages from one sender socket keep their order; ZMQ fair-queues
between senders. A :class:`NotificationSender` is a ZMQ socket: use it from one thread.
"""

from __future__ import annotations

import logging
import secrets
import threading
import weakref
from collections import deque
from collections.abc import Callable

import msgspec
import zmq

from .auth import Authenticator, AuthError
from .errors import NotificationError

__all__ = [
    "CHANNEL",
    "KEY_BYTES",
    "KIND_NOTIFY",
    "MAX_PAYLOAD_BYTES",
    "NotificationError",
    "NotificationReceiver",
    "NotificationSender",
    "new_notification_key",
]

log = logging.getLogger(__name__)

CHANNEL = "kvtransport-notify-v1"
WIRE_VERSION = 1
KIND_NOTIFY = "n"
KEY_BYTES = 32
#: A notification is a small control message; anything larger is refused on both ends.
MAX_PAYLOAD_BYTES = 1 << 20
_MAX_FRAME_BYTES = MAX_PAYLOAD_BYTES + 4096
#: Nonces remembered inside the authenticator's replay window (~8,700 notifications/s
#: sustained over its 30 s window before a genuine message would be refused as a flood).
_MAX_NONCES = 1 << 18
#: Undrained notifications kept at most (oldest dropped and counted beyond): an agent whose
#: owner never drains (the vLLM connector does not use notifications) must not grow
#: without bound when a secret holder keeps sending.
MAX_QUEUED_BYTES = 64 << 20
MAX_QUEUED = 1 << 16

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(tuple[int, str, str, bytes])

ControlHandler = Callable[[str, str, bytes], None]


def new_notification_key() -> bytes:
    """A fresh random key for one receiver; it travels only inside agent metadata."""
    return secrets.token_bytes(KEY_BYTES)


def _authenticator(key: bytes) -> Authenticator:
    if not isinstance(key, (bytes, bytearray)) or len(key) != KEY_BYTES:
        raise ValueError(f"a notification key is {KEY_BYTES} random bytes (from new_notification_key())")
    return Authenticator(bytes(key), CHANNEL, max_nonces=_MAX_NONCES)


class NotificationReceiver:
    """A PULL socket bound on ``endpoint`` that delivers only authenticated messages.

    ``endpoint`` is ``ipc:///path`` (bound as is), ``tcp://host`` (a free port is
    chosen) or ``tcp://host:port``; :attr:`address` is what senders connect to. ``key`` is this receiver's
    key (:func:`new_notification_key`), exported in the backend's metadata blob.
    """

    def __init__(self, ctx: zmq.Context, endpoint: str, key: bytes, *, name: str = "",
                 on_control: ControlHandler | None = None) -> None:
        self._auth = _authenticator(key)
        self._on_control = on_control
        self._name = name
        self._queue: deque[tuple[str, bytes]] = deque()
        self._queued_bytes = 0
        self.dropped = 0  # undrained notifications dropped, oldest first, beyond the bounds
        self._count_lock = threading.Lock()
        self.refusals = 0
        self.malformed = 0  # authentic but undecodable or of another wire version (also refusals)
        self.last_refusal = ""
        sock = ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, _MAX_FRAME_BYTES)
        try:
            if endpoint.startswith("tcp://") and not endpoint.rsplit(":", 1)[-1].isdigit():  # no port given
                port = sock.bind_to_random_port(endpoint)
                self.address = f"{endpoint}:{port}"
            else:
                sock.bind(endpoint)
                self.address = endpoint
        except zmq.ZMQError:
            sock.close(0)
            raise
        # An inproc pair wakes the thread at close without a polling timeout.
        self._wake_addr = f"inproc://kvt-notify-wake-{secrets.token_hex(8)}"
        self._wake_rx = ctx.socket(zmq.PAIR)
        self._wake_rx.bind(self._wake_addr)
        self._wake_tx = ctx.socket(zmq.PAIR)
        self._wake_tx.setsockopt(zmq.LINGER, 0)
        self._wake_tx.connect(self._wake_addr)
        self._closed = False
        # The thread holds only a weak reference: a receiver dropped without close() (an
        # agent never closed) still stops its thread, through the finalizer's wake-up.
        self._thread = threading.Thread(target=_receive_loop, args=(weakref.ref(self), sock, self._wake_rx),
                                        name=f"kvt-notify-rx-{name}", daemon=True)
        self._finalizer = weakref.finalize(self, _wake, self._wake_tx)
        self._thread.start()

    def _refuse(self, why: str, malformed: bool = False) -> None:
        with self._count_lock:
            self.refusals += 1
            self.malformed += malformed
            self.last_refusal = why
            n = self.refusals
        if n == 1 or n % 1000 == 0:
            log.warning("notification receiver %s refused a message (%d so far): %s", self._name or self.address, n, why)

    def _handle(self, frames: list[bytes]) -> None:
        if len(frames) != 1:
            return self._refuse(f"{len(frames)}-part message: not a sealed kvtransport notification")
        try:
            body = self._auth.open(frames[0], direction="req")
        except AuthError as exc:
            return self._refuse(str(exc))
        try:
            version, kind, sender, payload = _decoder.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return self._refuse(f"authentic but malformed notification: {exc}", malformed=True)
        if version != WIRE_VERSION:
            return self._refuse(f"notification wire version {version}, expected {WIRE_VERSION}", malformed=True)
        if kind == KIND_NOTIFY:
            self._enqueue(sender, payload)
        elif self._on_control is not None:
            try:
                self._on_control(kind, sender, payload)
            except Exception as exc:  # a control handler must never stop the receiver
                self._refuse(f"control message {kind!r} from {sender!r} not handled: {exc}")
        else:
            self._refuse(f"unknown notification kind {kind!r} from {sender!r}", malformed=True)

    def _enqueue(self, sender: str, payload: bytes) -> None:
        with self._count_lock:
            q = self._queue
            q.append((sender, payload))
            self._queued_bytes += len(payload)
            dropped = 0
            while len(q) > MAX_QUEUED or (self._queued_bytes > MAX_QUEUED_BYTES and len(q) > 1):
                self._queued_bytes -= len(q.popleft()[1])
                dropped += 1
            self.dropped += dropped
            n = self.dropped
        if dropped and (n == dropped or n // 1000 != (n - dropped) // 1000):
            log.warning("notification receiver %s dropped %d undrained notifications so far (kept: %d messages, "
                        "%d bytes at most); drain them with Agent.notifications()", self._name or self.address, n,
                        MAX_QUEUED, MAX_QUEUED_BYTES)

    # -- caller side ----------------------------------------------------------
    def drain(self) -> list[tuple[str, bytes]]:
        """Authenticated ``(sender, payload)`` notifications received so far, oldest first."""
        with self._count_lock:
            out = list(self._queue)
            self._queue.clear()
            self._queued_bytes = 0
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._finalizer()  # wakes the thread, which closes the PULL socket
        self._thread.join(10)


def _wake(wake_tx: zmq.Socket) -> None:
    try:
        wake_tx.send(b"", zmq.NOBLOCK)
    except zmq.ZMQError:
        pass
    wake_tx.close(0)


def _receive_loop(ref: weakref.ref[NotificationReceiver], sock: zmq.Socket, wake_rx: zmq.Socket) -> None:
    """The receiver's thread: owns ``sock`` until woken through ``wake_rx``."""
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(wake_rx, zmq.POLLIN)
    try:
        while True:
            ready = dict(poller.poll())
            if wake_rx in ready:
                return
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                receiver = ref()
                if receiver is None:
                    return
                receiver._handle(frames)
                del receiver
    finally:
        sock.close(0)
        wake_rx.close(0)


class NotificationSender:
    """A PUSH socket to one receiver, sealing every message with that receiver's key."""

    def __init__(self, ctx: zmq.Context, address: str, key: bytes, sender: str, *, linger_ms: int = 1000) -> None:
        self._auth = _authenticator(key)
        self._sock = ctx.socket(zmq.PUSH)
        # Give queued notifications a moment to leave when the peer is forgotten.
        self._sock.setsockopt(zmq.LINGER, linger_ms)
        # Messages queue locally while the peer's socket is not (yet) reachable.
        self._sock.setsockopt(zmq.SNDHWM, 100_000)
        self._sock.connect(address)
        self.address = address
        self.sender = sender

    def send(self, payload: bytes, kind: str = KIND_NOTIFY) -> None:
        if len(payload) > MAX_PAYLOAD_BYTES:
            raise NotificationError(
                f"notification of {len(payload)} bytes exceeds the {MAX_PAYLOAD_BYTES}-byte limit; "
                "send a reference to the data instead")
        frame = self._auth.seal(_encoder.encode((WIRE_VERSION, kind, self.sender, bytes(payload))), direction="req")
        try:
            self._sock.send(frame, zmq.NOBLOCK)
        except zmq.Again as exc:
            raise NotificationError(f"notification queue to {self.address} is full (peer not draining)") from exc
        except zmq.ZMQError as exc:
            raise NotificationError(f"notification to {self.address} could not be queued: {exc}") from exc

    def close(self, linger_ms: int | None = None) -> None:
        self._sock.close(linger_ms)
