"""Tells a WRITE's consumer "written" the moment the write ends, not at the producer's next step.

Why: the engine thread advances holds only between forwards. Under load a producer's step
is a long prefill forward, so a write that ended early in it was announced only after it:
the decode engine waited for the producer's step on top of the transfer (measured at
concurrency 8 on KV of Llama-3-70B's size, docs/bench/E2E_LATENCY.md: 17 ms of a load's
25 ms of connector time). This thread waits on the agent's progress signals for any
posted write to end, makes the hold's POSTED -> NOTIFY step (:meth:`Producer.write_ended`,
made once by whichever thread sees the end first) and sends "written" at once.

Nothing of the hold protocol changes: the same transition under the worker lock, the same
message, the same resending by the engine thread every 50 ms until the consumer acks. The
thread owns its side-channel clients (a DEALER socket serves one thread) and reads the
acks to its own messages, handing them to :meth:`Producer.on_reply` as the engine thread
does with its own.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import kvtransport as kvt

from .transfer_watcher import TransferWatcher

if TYPE_CHECKING:
    from collections.abc import Callable

    from .producer import Producer
    from .side_channel import SideChannelClient

__all__ = ["WrittenNotifier"]

#: longest sleep while writes are in flight: bounds how late the end of a write posted while
#: the thread waited on others is seen (a backend's progress signal usually wakes it sooner)
_IN_FLIGHT_NAP_S = 0.002
#: longest sleep with nothing in flight (a new post wakes the thread at once)
_IDLE_NAP_S = 0.05
#: how long after sending "written" its ack is looked for, and how often. Not as it comes: a
#: wait on sockets and an event together polls (side_channel.wait_for_any), which costs the
#: engine's CPU; an ack only frees the producer's blocks, so 5 ms late is harmless (the
#: engine thread sends again after 50 ms and reads the ack to that)
_ACK_WAIT_S = 0.05
_ACK_NAP_S = 0.005


class WrittenNotifier(TransferWatcher):
    """One thread per WRITE-mode producer worker; started on construction, ended by :meth:`close`."""

    def __init__(self, producer: Producer, new_client: Callable[[str, int], SideChannelClient], name: str) -> None:
        super().__init__(producer.posted, new_client, f"kvt-written-{name}",
                         '"written" is now sent at each step')
        self._producer = producer
        self._acks_due = 0.0  # until when acks to our "written" are awaited
        self._start()

    def _step(self) -> None:
        producer = self._producer
        producer.posted.clear()  # before looking: a post after the look wakes the wait below
        for h in producer.posted_holds():
            if producer.write_ended(h) and producer.tell_written(h, self._client_to):
                self._acks_due = time.monotonic() + _ACK_WAIT_S
        for c in list(self._clients.values()):
            for msg in c.poll():
                producer.on_reply(msg)
        posted = producer.posted_holds()
        pending = [h.write for h in posted if h.write is not None
                   and h.write.last_status.state is kvt.State.PENDING]
        if pending:
            kvt.wait_any(pending, _IN_FLIGHT_NAP_S)
        elif posted:  # failed, bytes may still land (T3): look again shortly
            self._stop.wait(_IN_FLIGHT_NAP_S)
        elif time.monotonic() < self._acks_due:  # acks to what we sent: looked for every 5 ms
            producer.posted.wait(_ACK_NAP_S)
        else:
            producer.posted.wait(_IDLE_NAP_S)
