"""Confirms a READ with the producer the moment its bytes land, not at the decode's next step.

Why: a READ load ends with "done with key?" to the producer ("ok" only while its lease
held: the stale-read guard). The engine thread advances loads only between forwards, and
it waits at most 2 ms for the answer before the step ends. Under load a read ends during
a forward, and the answer takes longer on a busy host, so a confirmation cost one or two
whole forwards (measured at concurrency 8 on KV of Llama-3-70B's size,
docs/bench/E2E_LATENCY.md: 1.5 to 5 ms of a load's 4 to 6.5 ms of connector time).

This thread waits in one poll on its sockets and on the agent's progress fd (so an answer
is taken at once even while other reads are in flight), makes the load's READ -> CONFIRM
step (:meth:`Consumer.read_ended`, under the worker lock; while this thread runs the
engine thread leaves that step to it unless it is 50 ms late, since an answer to the
engine thread's own message waits for its next step), sends the confirmation and applies
the answer (:meth:`Consumer.on_reply`), so a load settles during the forward and is
reported at the end of the step it settled in. Nothing of the load protocol changes: the
same transitions under the same lock, the same message; the engine thread still resends
an unanswered confirmation every 50 ms on its own connection and handles every failure.
The thread owns its side-channel clients (a DEALER socket serves one thread).
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

import zmq

import kvtransport as kvt

from .messages import Reply
from .recv import RecvState
from .transfer_watcher import TransferWatcher

if TYPE_CHECKING:
    from collections.abc import Callable

    from .consumer import Consumer
    from .side_channel import SideChannelClient

__all__ = ["ReadConfirmer"]

#: longest sleep while reads or answers are awaited: bounds how late the end of a read
#: posted while the thread waited on others is seen (a progress signal usually wakes it)
_IN_FLIGHT_NAP_S = 0.002
#: the same while a read is in flight on a backend that did not promise to signal its end
_UNSIGNALLED_NAP_S = 0.001
#: longest sleep with nothing in flight (a new post wakes the thread at once)
_IDLE_NAP_S = 0.05
#: how long answers to our confirmations are awaited before the engine thread's resend
#: (every 50 ms, on its own connection) takes over
_ANSWER_WAIT_S = 0.05


class ReadConfirmer(TransferWatcher):
    """One thread per READ-mode consumer worker; started on construction, ended by :meth:`close`."""

    def __init__(self, consumer: Consumer, new_client: Callable[[str, int], SideChannelClient], name: str) -> None:
        super().__init__(consumer.posted, new_client, f"kvt-confirm-{name}", "reads are now confirmed at each step")
        self._consumer = consumer
        self._answers_due = 0.0  # until when answers to our confirmations are awaited
        self._progress = consumer.ctx.agent.open_progress_fd()  # readable when a read may have ended
        self._start()

    def close(self) -> None:
        super().close()
        self._progress.close()  # after the thread stopped polling it

    def _step(self) -> None:
        consumer = self._consumer
        consumer.posted.clear()  # before looking: a post after the look wakes the wait below
        self._progress.clear()  # likewise: a read ending after the look makes the fd readable
        with consumer.ctx.lock:
            reading = [r for r in consumer.recv.values() if r.state is RecvState.READ]
        pending = [pc.transfer for r in reading for pc in r.pieces
                   if pc.transfer is not None and pc.transfer.last_status.state is kvt.State.PENDING]
        for r in reading:
            with consumer.ctx.lock:  # the step and its message at once: the engine thread's
                if consumer.read_ended(r):  # resend times from this send (``last_sent``)
                    consumer.send.confirm(r, time.monotonic(), self._client_to)
                    self._answers_due = time.monotonic() + _ANSWER_WAIT_S
        for c in list(self._clients.values()):
            for msg in c.poll():
                # "ok" only settles a load; any other answer may need a send (a release, a
                # new hand-shake) on the engine thread's sockets: handed over to it
                if isinstance(msg, Reply) and all(v == "ok" for v in msg.status.values()):
                    consumer.on_reply(msg)
                else:
                    consumer.hand_over(msg)
        answers_due = time.monotonic() < self._answers_due
        if pending or answers_due:
            # woken by a read's end or an answer, whichever comes first; a new post is seen
            # within the nap (its end wakes the poll anyway)
            poller = zmq.Poller()
            poller.register(self._progress, zmq.POLLIN)
            for c in self._clients.values():
                poller.register(c.socket, zmq.POLLIN)
            silent = any(not t.awaits_signal for t in pending)  # only polling sees their end
            poller.poll(math.ceil((_UNSIGNALLED_NAP_S if silent else _IN_FLIGHT_NAP_S) * 1000))
        else:
            consumer.posted.wait(_IDLE_NAP_S)
