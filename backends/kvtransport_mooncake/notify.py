"""kvtransport notifications mapped onto Mooncake's own notifications.

What Mooncake has: a ``TransferNotify(name, msg)`` attached to a transfer is sent by the
initiator's engine to the target's hand-shake daemon once the transfer's batch is seen
COMPLETED, and the target drains it with ``get_notifies()``. The Python binding attaches one
only to the *synchronous* calls (``transfer_sync`` / ``batch_transfer_sync``), which block
(spinning, GIL released) until done; there is no standalone send. So:

* a notification is sent by a small :class:`Notifier` thread, after the data transfer it
  belongs to has completed, as a synchronous 1-byte READ of the peer's scratch buffer with
  the notification attached — the data is in place before the message can be seen;
* standalone notifications use the same path; one FIFO thread keeps them in order;
* ``msg`` is a ``std::string`` converted from/to ``str`` by pybind11, so the message travels
  base64-encoded behind a ``kvt1:`` tag.

Authentication: Mooncake's notify RPC carries a self-declared sender name and nothing else;
anyone who reaches an engine's hand-shake port could make it "see" data that never landed.
So each message is sealed exactly as :mod:`kvtransport.notify` seals its frames: with the
*receiver's* random 32-byte key (exported in its agent blob, so only holders of its metadata
can notify it), ``kvtransport.auth.Authenticator`` on channel ``kvtransport-notify-v1``
(encrypted, timestamped, nonce against replay), body ``[version, "n", sender, payload]``. The
sender name used is the one inside the sealed body. Anything else is refused: dropped,
counted (``notification_refusals`` in ``describe()``), logged.

Limit (Mooncake's, documented in docs/MOONCAKE.md): the engine only *logs* a failure of
the notify RPC itself; the 1-byte transfer before it fails visibly when the peer is gone.
"""

from __future__ import annotations

import base64
import binascii
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

import msgspec

from kvtransport.auth import Authenticator, AuthError
from kvtransport.errors import NotificationError
from kvtransport.notify import CHANNEL, KIND_NOTIFY, MAX_PAYLOAD_BYTES

log = logging.getLogger(__name__)

_TAG = "kvt1:"
WIRE_VERSION = 1
_ENC = msgspec.msgpack.Encoder()
_DEC = msgspec.msgpack.Decoder(tuple[int, str, str, bytes])


def authenticator(key: bytes) -> Authenticator:
    return Authenticator(bytes(key), CHANNEL)


def seal(auth: Authenticator, sender: str, payload: bytes) -> str:
    """The ``msg`` of a Mooncake notification carrying ``payload``, sealed for the receiver."""
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise NotificationError(f"notification of {len(payload)} bytes exceeds the {MAX_PAYLOAD_BYTES}-byte "
                                "limit; send a reference to the data instead")
    frame = auth.seal(_ENC.encode((WIRE_VERSION, KIND_NOTIFY, sender, bytes(payload))), direction="req")
    return _TAG + base64.b64encode(frame).decode("ascii")


def open_sealed(auth: Authenticator, msg: str) -> tuple[str, bytes]:
    """(sender, payload) of a message sealed with our key; raises ValueError saying why not."""
    if not msg.startswith(_TAG):
        raise ValueError("not a kvtransport notification")
    try:
        frame = base64.b64decode(msg[len(_TAG):], validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("malformed base64") from None
    try:
        body = auth.open(frame, direction="req")
    except AuthError as exc:
        raise ValueError(str(exc)) from None
    try:
        version, kind, sender, payload = _DEC.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"authentic but malformed notification: {exc}") from None
    if version != WIRE_VERSION or kind != KIND_NOTIFY:
        raise ValueError(f"notification version {version} kind {kind!r} not understood")
    return sender, payload


class NotifyJob:
    """One notification on its way; ``result`` is None while queued, then "" (sent) or why not."""

    __slots__ = ("session", "scratch_remote", "msg", "result")

    def __init__(self, session: str, scratch_remote: int, msg: str) -> None:
        self.session, self.scratch_remote, self.msg = session, scratch_remote, msg  # msg: sealed
        self.result: str | None = None


class Notifier:
    """One thread sending notifications in order through the engine's synchronous path."""

    def __init__(self, engine: Any, me: Any, sender: str, scratch_local: int,
                 on_done: Callable[[], None]) -> None:
        self._engine, self._me, self._sender = engine, me, sender
        self._scratch = scratch_local
        self._on_done = on_done
        self._q: queue.SimpleQueue[NotifyJob | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"kvt-mooncake-notify-{sender}", daemon=True)
        self._thread.start()

    def submit(self, job: NotifyJob) -> NotifyJob:
        self._q.put(job)
        return job

    def _run(self) -> None:
        me = self._me
        while (job := self._q.get()) is not None:
            try:
                rc = self._engine.batch_transfer_sync(
                    job.session, [self._scratch], [job.scratch_remote], [1], me.TransferOpcode.Read,
                    me.TransferNotify(self._sender, job.msg))
                job.result = "" if rc == 0 else f"the notification transfer to {job.session} failed (rc={rc})"
            except Exception as exc:  # keep serving the next notification
                job.result = f"notification to {job.session} failed: {type(exc).__name__}: {exc}"
            if job.result:
                log.warning("mooncake: %s", job.result)
            self._on_done()

    def close(self, timeout: float = 5.0) -> bool:
        """Stop after the queued notifications; True if the thread ended in time."""
        self._q.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            return False
        self._engine = None  # let the engine be destroyed with its last reference
        return True


class Inbox:
    """Our side: opens what Mooncake received, keeps the authentic ones, counts the rest."""

    def __init__(self, key: bytes, name: str) -> None:
        self._auth = authenticator(key)
        self._name = name
        self.refusals = 0

    def drain(self, engine: Any) -> list[tuple[str, bytes]]:
        """Authentic notifications received by ``engine`` so far: (sender, payload), oldest first."""
        out: list[tuple[str, bytes]] = []
        for n in engine.get_notifies():
            try:
                out.append(open_sealed(self._auth, n.msg))
            except ValueError as exc:
                self.refusals += 1
                if self.refusals == 1 or self.refusals % 1000 == 0:
                    log.warning("mooncake agent %s refused a notification claiming to be from %r (%d so far): %s",
                                self._name, n.name, self.refusals, exc)
        return out
