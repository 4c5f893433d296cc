"""The agent's transfers from post to their end: polling, deadlines, quiescence, results.

:class:`InFlightTransfers` keeps every transfer an agent posted in the one state table it
is in, and removes it when it leaves that state:

* *pending* until terminal: polled by ``Agent.progress()`` and by its own
  ``status()``/``wait()``; failed by the core when its deadline passes even if the backend
  is silent (T2), then cancelled in the backend;
* *unquiesced* while FAILED but the backend has not promised that nothing more lands (T3):
  its local regions cannot be deregistered meanwhile;
* *finished* until ``Agent.progress()`` returns it or the caller has seen it end
  (:class:`~kvtransport.transfer.FinishedTransfers`: each at most once, T1).

It is the :class:`~kvtransport.transfer.TransferOwner` of those transfers (the only way a
Transfer reaches its agent), with the agent's progress signal passed in: the agent owns
that signal because backends raise it through the agent's ``progress_callback``.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable

from .spi import Backend, Op, PollState, PostRequest
from .transfer import DONE_STATUS, FinishedTransfers, PreparedTransfer, State, Transfer, TransferStatus, note_pending_poll

__all__ = ["InFlightTransfers"]


class InFlightTransfers:
    """Posted transfers of one agent until nothing of them is left to report or release.

    Changes happen under the agent's lock (passed in, re-entrant), as do the agent's calls
    here. ``stats`` is the agent's counters dict, updated in place."""

    def __init__(self, backend: Backend, lock: threading.RLock, stats: dict[str, int], *,
                 progress_window: int, latency_window: int, wake: Callable[[], None],
                 progress_token: Callable[[], int], wait_for_progress: Callable[[int, float], None]):
        self._backend = backend
        self._backend_name = backend.name
        self._lock = lock
        self._stats = stats
        #: wakes every waiter (the agent's progress signal): a transfer the core failed
        self._wake = wake
        #: TransferOwner: sleeping until a backend signals progress is the agent's signal
        self.progress_token = progress_token
        self.wait_for_progress = wait_for_progress
        self._tids = itertools.count(1)
        self.pending: dict[int, Transfer] = {}
        self.unquiesced: dict[int, Transfer] = {}
        self._finished = FinishedTransfers(progress_window)
        #: latency of each transfer that ended DONE, the latest ``latency_window`` of them
        self.latencies: deque[float] = deque(maxlen=latency_window)
        self._idle_progress_at = 0.0  # when a progress() call that found nothing finished returned
        self._fast_idle_progress = 0  # such calls in a row, each soon after the one before (spinning)
        self._closed = False

    # -- posting --------------------------------------------------------------
    def post(self, p: PreparedTransfer, notify: bytes | None, timeout_s: float) -> Transfer:
        """Post a validated preparation as a new transfer (caller holds the lock)."""
        r = p.request
        req = PostRequest(r.op, next(self._tids), r.peer, r.peer_name, r.local_region,
                          r.local_offset, r.local_addr, r.remote_region, r.remote_offset,
                          r.remote_addr, r.length, notify, time.monotonic() + timeout_s)
        t = Transfer(self, req.transfer_id, p.op, p.peer, p.nbytes, p.nsegments,
                     p.local_region_ids, req.deadline)
        st = self._stats
        st["transfers_posted"] += 1
        st["segments_posted"] += p.caller_segments
        st["segments_merged"] += p.nsegments
        self.pending[t.id] = t
        try:
            t.backend_handle = self._backend.post(req)
        except Exception as exc:  # a backend refusal fails the transfer, once, visibly
            self.fail(t, f"backend {self._backend_name!r} refused the post: "
                         f"{type(exc).__name__}: {exc}", quiesced=True)
            return t
        # One poll now, while everything is in cache: a backend that completed the copy
        # inside post (NIXL and UCX over cma, loopback in one process) is seen DONE at
        # once, instead of by a first status() that pays for evicted caches.
        self._poll_one(t, time.monotonic())
        return t

    # -- state changes --------------------------------------------------------
    def _poll_one(self, t: Transfer, now: float) -> None:
        h = t.backend_handle
        try:
            res = self._backend.poll(h) if h is not None else None
        except Exception as exc:
            self.fail(t, f"backend poll raised {type(exc).__name__}: {exc}")
            return
        if res is None or res.state is PollState.PENDING:
            t.awaits_signal = res is not None and res.will_signal
            if now >= t.deadline:
                self._stats["transfers_timed_out"] += 1
                self.fail(t, f"deadline of {t.deadline - t.posted_at:.3f}s passed "
                             "with no completion from the backend")
            return
        if res.state is PollState.DONE:
            if t.set_terminal(DONE_STATUS):
                self.pending.pop(t.id, None)
                self._stats["transfers_done"] += 1
                self._stats["bytes_read" if t.op is Op.READ else "bytes_written"] += t.nbytes
                self.latencies.append(t.finished_at - t.posted_at)
                self._finished.add(t)
                # seen by this poll, not signalled (e.g. a copy made inside post): waiters
                # on other threads (wait_any, progress fds) learn of it now
                self._wake()
        else:
            self.fail(t, res.reason or "backend reported failure", quiesced=res.quiesced)

    def fail(self, t: Transfer, reason: str, quiesced: bool | None = None) -> None:
        """Fail ``t`` once. Unless the backend already said so, cancel it and learn
        whether anything can still land (T3)."""
        h = t.backend_handle
        if quiesced is None:
            try:
                quiesced = bool(self._backend.cancel(h)) if h is not None else True
            except Exception:
                quiesced = False
        if t.set_terminal(TransferStatus(State.FAILED, reason, quiesced)):
            self.pending.pop(t.id, None)
            self._stats["transfers_failed"] += 1
            if not quiesced:
                self.unquiesced[t.id] = t
            self._finished.add(t)
            # Failed by the core (close, disconnect, deadline) or the backend: wake every
            # waiter now, including one sleeping on a backend's promise to signal.
            self._wake()

    def _check_quiesced(self, t: Transfer) -> None:
        try:
            ok = self._backend.quiesced(t.backend_handle)
        except Exception:
            ok = False
        if ok:
            t.set_quiesced()
            self.unquiesced.pop(t.id, None)

    def fail_peer(self, peer_name: str, reason: str) -> None:
        """Fail every pending transfer to ``peer_name``, also those posted on an earlier
        Peer of that name (the peer restarted or was disconnected)."""
        for t in list(self.pending.values()):
            if t.peer.name == peer_name:
                self.fail(t, reason)

    def close(self, reason: str) -> None:
        """Fail what is pending; polling stops (the backend is about to be closed)."""
        for t in list(self.pending.values()):
            self.fail(t, reason)
        self._closed = True

    def using_region(self, region_id: int) -> list[int]:
        """Ids of the transfers that may still touch local region ``region_id`` (pending, or
        failed and not yet quiesced); asks the backend about the latter first, since a
        caller that only waits never polls them."""
        for t in list(self.unquiesced.values()):
            if (t.local_regions == region_id).any():
                self._check_quiesced(t)
        return [t.id for t in itertools.chain(self.pending.values(), self.unquiesced.values())
                if (t.local_regions == region_id).any()]

    # -- progress -------------------------------------------------------------
    def progress(self) -> list[Transfer]:
        """Poll every pending transfer and check the unquiesced; return those that became
        terminal, in completion order, each at most once (see ``Agent.progress``)."""
        now = time.monotonic()
        with self._lock:
            if not self._closed:
                for t in list(self.pending.values()):
                    self._poll_one(t, now)
                for t in list(self.unquiesced.values()):
                    self._check_quiesced(t)
            finished = self._finished.drain()
        if not finished and self.pending:
            # a caller spinning on progress() lets the backend's threads run
            self._fast_idle_progress = note_pending_poll(now, self._idle_progress_at, self._fast_idle_progress)
            self._idle_progress_at = time.monotonic()
        return finished

    # -- TransferOwner --------------------------------------------------------
    def poll_transfer(self, t: Transfer) -> TransferStatus:
        with self._lock:
            if t.id in self.pending:
                self._poll_one(t, time.monotonic())
            elif t.id in self.unquiesced:
                self._check_quiesced(t)
            st = t.last_status
            if st.state is not State.PENDING:  # the caller sees it end: progress() need not hold it
                self._finished.seen(t)
            return st

    def release_transfer(self, t: Transfer) -> None:
        with self._lock:
            if t.released or t.id in self.pending or t.id in self.unquiesced or self._closed:
                return
            if t.mark_released() and t.backend_handle is not None:
                try:
                    self._backend.release(t.backend_handle)
                except Exception:
                    pass
