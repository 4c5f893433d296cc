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
* ``msg`` is a ``std::string`` converted from/to ``str`` by pybind11, so the payload
  travels base64-encoded behind a ``kvt1:`` tag (foreign messages are dropped, logged).

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

log = logging.getLogger(__name__)

_TAG = "kvt1:"


def encode(payload: bytes) -> str:
    return _TAG + base64.b64encode(payload).decode("ascii")


def decode(msg: str) -> bytes | None:
    if not msg.startswith(_TAG):
        return None
    try:
        return base64.b64decode(msg[len(_TAG):], validate=True)
    except (binascii.Error, ValueError):
        return None


class NotifyJob:
    """One notification on its way; ``result`` is None while queued, then "" (sent) or why not."""

    __slots__ = ("session", "scratch_remote", "payload", "result")

    def __init__(self, session: str, scratch_remote: int, payload: bytes) -> None:
        self.session, self.scratch_remote, self.payload = session, scratch_remote, payload
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
                    me.TransferNotify(self._sender, encode(job.payload)))
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


def drain(engine: Any) -> list[tuple[str, bytes]]:
    """Notifications received by ``engine`` so far: (sender agent name, payload), oldest first."""
    out: list[tuple[str, bytes]] = []
    for n in engine.get_notifies():
        payload = decode(n.msg)
        if payload is None:
            log.warning("mooncake: dropped a notification not sent by kvtransport (from %r)", n.name)
            continue
        out.append((n.name, payload))
    return out
