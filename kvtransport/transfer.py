"""Transfer handles, their state machine, and what they need from their agent.

``PENDING -> DONE | FAILED(reason, quiesced)``. The terminal state is set once (T1);
the owning agent's polling sets it by the deadline at the latest (T2). A FAILED
transfer may still have bytes in flight until ``quiesced`` turns True (T3).

A :class:`Transfer` and the agent that posted it talk through two small, explicit
interfaces instead of each other's private members:

* :class:`TransferOwner` — what a Transfer asks of its agent (poll me, let me sleep
  until the backend signals progress, release me);
* the *owner side* of :class:`Transfer` (``set_terminal``, ``set_quiesced``,
  ``mark_released``, ``backend_handle``, ``last_status``) — what only the owner calls,
  in the manner of ``concurrent.futures.Future.set_result``, which is public but meant
  for executors.

:class:`FinishedTransfers` is the agent's queue behind ``Agent.progress()``; see its
docstring for why a transfer whose end the caller has already seen is not kept.
"""

from __future__ import annotations

import enum
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from .errors import TransferFailedError
from .spi import Op, PostRequest

if TYPE_CHECKING:
    from .peer import Peer

__all__ = ["State", "TransferStatus", "Transfer", "TransferOwner", "PreparedTransfer",
           "FinishedTransfers", "wait_any"]


class State(str, enum.Enum):
    PENDING = "PENDING"
    DONE = "DONE"
    FAILED = "FAILED"


@dataclass(frozen=True)
class TransferStatus:
    state: State
    reason: str = ""
    #: For FAILED: True once no more bytes of the transfer can land in either buffer.
    quiesced: bool = True

    @property
    def done(self) -> bool:
        return self.state is not State.PENDING

    @property
    def ok(self) -> bool:
        return self.state is State.DONE


_PENDING = TransferStatus(State.PENDING)
#: The one DONE status (immutable, so shared): made once, not per transfer.
DONE_STATUS = TransferStatus(State.DONE)
#: Longest sleep of ``Transfer.wait()`` while the backend has promised to signal the
#: transfer's next change (``PollResult.will_signal``): what a backend that broke that
#: promise costs a waiter per transfer, instead of a transfer stranded until its deadline.
SIGNALLED_WAIT_CAP_S = 0.05
#: A poll that finds the same transfer (or agent) pending again less than this after the
#: previous pending answer is a *fast* poll. Longer than a spinning loop's turn (a few us),
#: shorter than ``wait()``'s first nap (50 us).
SPIN_POLL_GAP_S = 5e-5
#: The caller is taken to be spinning (``while not t.done: pass``, as NIXL users poll
#: ``check_xfer_state``) once this many pending answers in a row were each a fast poll after
#: the one before; from then on each pending answer first yields the GIL (:func:`yield_gil`).
#: A spinning loop gets there within ~100 us. An engine step's hooks poll in a short burst
#: (vLLM 0.32, after the forward: ``start_load_kv``, ``wait_for_save``, then
#: ``get_transfer_results``, each advancing the connector once: a few fast polls of the agent
#: and of each posted transfer), which must not pay for a yield.
SPIN_POLLS_BEFORE_YIELD = 16


def yield_gil() -> None:
    """Let this process's other Python threads run: ``time.sleep(0)`` drops the GIL.

    Why: a backend moves bytes on its own threads (loopback's copy threads, ucx's progress
    threads), and each needs the GIL between its native calls. A caller polling a pending
    transfer in a tight loop takes the GIL back at once every time, so those threads wait
    for it: measured two processes, 16 MiB WRITEs back to back, a loop on ``status()``
    against ``wait()``: loopback 1.4 against 18-20 GB/s, ucx tcp 0.6-0.7 against 2.3-2.6,
    ucx shm 0.9-14 against 13-15; the same loop with this yield: 20, 2.7-3.1, 16-18.
    Why a sleep: it lasts the kernel's timer slack (~70 us here), long enough for a thread
    woken on another core to take the GIL, and the scheduler does not penalise it.
    ``os.sched_yield()`` (0.6 us) moved as many bytes in the same bench, but the EEVDF
    scheduler charges a yielding thread a whole time slice, which starved vLLM's processes
    for seconds (docs/vllm/USAGE.md, "Busy-wait yield"). A spinning caller sees the end of a
    transfer at most one sleep late.
    """
    time.sleep(0)


def note_pending_poll(start: float, last_pending_end: float, fast_polls: int) -> int:
    """Account one poll that began at ``start`` and found work still pending; the previous
    pending answer ended at ``last_pending_end`` after ``fast_polls`` fast polls in a row.
    Yields the GIL once the caller is spinning (``SPIN_POLLS_BEFORE_YIELD``); returns the new
    count of fast polls in a row."""
    fast_polls = fast_polls + 1 if start - last_pending_end < SPIN_POLL_GAP_S else 0
    if fast_polls >= SPIN_POLLS_BEFORE_YIELD - 1:
        yield_gil()
    return fast_polls


class TransferOwner(Protocol):
    """What a :class:`Transfer` needs from the agent that posted it — nothing more.

    The agent's :class:`~kvtransport.inflight.InFlightTransfers` is one; a Transfer never
    touches the agent otherwise, and the agent changes a Transfer only through the
    Transfer's owner side, always under the agent's one lock (so a Transfer needs no lock
    of its own: its state is one attribute, read atomically by ``status``/``repr``).
    """

    def poll_transfer(self, transfer: Transfer) -> TransferStatus:
        """Drive ``transfer`` one step (poll the backend, enforce its deadline, or check
        quiescence of a failed one) and return its status. A terminal status returned
        here counts as *seen by the caller* (see :class:`FinishedTransfers`)."""
        ...

    def progress_token(self) -> int:
        """An opaque counter of backend progress signals, read before polling so that a
        signal between the poll and the sleep is not lost."""
        ...

    def wait_for_progress(self, token: int, timeout: float) -> None:
        """Sleep until a backend signals progress after ``token``, or ``timeout`` s."""
        ...

    def release_transfer(self, transfer: Transfer) -> None:
        """Free the backend's resources of ``transfer`` once it can no longer land bytes."""
        ...


class Transfer:
    """Handle of one posted READ or WRITE. Created by ``Agent.read`` / ``write`` / ``post``.

    Slotted and lock-free on purpose: one is made per post, right after a copy that may
    have evicted the caches (16 MiB on this machine's 32 MiB L3), where every attribute
    and allocation costs microseconds; its owner serialises every change under its lock.
    """

    __slots__ = ("_owner", "id", "op", "peer", "nbytes", "nsegments", "local_regions", "deadline",
                 "posted_at", "finished_at", "backend_handle", "_status", "_released", "_seen_final",
                 "awaits_signal", "_pending_polled_at", "_fast_polls", "__weakref__")

    def __init__(
        self,
        owner: TransferOwner,
        tid: int,
        op: Op,
        peer: Peer,
        nbytes: int,
        nsegments: int,
        local_regions: np.ndarray,
        deadline: float,
    ):
        self._owner = owner
        self.id = tid
        self.op = op
        self.peer = peer
        self.nbytes = nbytes
        self.nsegments = nsegments
        #: Distinct local region ids the transfer touches (deregistration checks).
        self.local_regions = local_regions
        #: ``time.monotonic()`` value by which the transfer ends (the core fails it then).
        self.deadline = deadline
        self.posted_at = time.monotonic()
        self.finished_at: float | None = None
        #: Set by the owner: what the backend's ``post`` returned (None if it refused).
        self.backend_handle: Any = None
        self._status: TransferStatus = _PENDING
        self._released = False
        self._seen_final = False  # a status() call returned the final (quiesced) state
        #: Set by the owner at each poll: the backend promised to signal this transfer's
        #: next change (``PollResult.will_signal``), so ``wait()`` need not poll meanwhile.
        self.awaits_signal = False
        self._pending_polled_at = 0.0  # when a status() call that found it pending returned
        self._fast_polls = 0  # such calls in a row, each soon after the one before (spinning)

    # -- owner side: called only by the TransferOwner that created the transfer, ------
    # -- under its lock -----------------------------------------------------------------
    def set_terminal(self, status: TransferStatus) -> bool:
        """Set the terminal state once. Returns True only for the call that set it."""
        if self._status.state is not State.PENDING:
            return False
        self.finished_at = time.monotonic()
        self._status = status
        return True

    def set_quiesced(self) -> None:
        """A FAILED transfer can no longer land bytes (T3)."""
        st = self._status
        if st.state is State.FAILED and not st.quiesced:
            self._status = TransferStatus(State.FAILED, st.reason, True)

    def mark_released(self) -> bool:
        """Record that the backend's resources are freed; True only the first time."""
        if self._released:
            return False
        self._released = True
        return True

    @property
    def released(self) -> bool:
        return self._released

    @property
    def last_status(self) -> TransferStatus:
        """The state as last set, without driving progress (for the owner and ``repr``)."""
        return self._status

    # -- public ---------------------------------------------------------------
    def status(self) -> TransferStatus:
        """Current state; drives progress of this transfer (and enforces its deadline).

        Once a call has returned a terminal state, the caller has *seen* the transfer
        end: the agent stops holding it for ``Agent.progress()`` beyond a short window
        (see :class:`FinishedTransfers`)."""
        if self._seen_final:
            return self._status
        start = time.monotonic()
        st = self._owner.poll_transfer(self)
        if st.state is State.PENDING:
            # a caller spinning on this transfer lets the threads that move it run
            self._fast_polls = note_pending_poll(start, self._pending_polled_at, self._fast_polls)
            self._pending_polled_at = time.monotonic()
        elif st.quiesced:
            self._seen_final = True  # nothing can change any more: no need to ask again
        return st

    @property
    def done(self) -> bool:
        return self.status().done

    @property
    def latency_s(self) -> float | None:
        return None if self.finished_at is None else self.finished_at - self.posted_at

    def wait(self, timeout: float | None = None) -> TransferStatus:
        """Block until DONE/FAILED or ``timeout`` seconds pass (the transfer's own
        deadline bounds the wait anyway). Returns the status at that time."""
        wait_any([self], float("inf") if timeout is None else timeout)
        return self._status  # the state the wait ended on (or a later one, set since)

    def result(self, timeout: float | None = None) -> None:
        """Wait, then raise :class:`TransferFailedError` unless DONE."""
        st = self.wait(timeout)
        if st.state is State.FAILED:
            raise TransferFailedError(f"transfer {self.id} to {self.peer.name!r} failed: {st.reason}")
        if st.state is State.PENDING:
            raise TimeoutError(f"transfer {self.id} still pending after {timeout}s")

    def release(self) -> None:
        """Free backend resources. A pending (or failed, not yet quiesced) transfer keeps
        them until it ends. The agent itself keeps nothing of a transfer the caller has
        seen end, so for the core this call is optional; a backend may hold native
        resources (e.g. UCX requests) until it is made."""
        self._owner.release_transfer(self)

    def __repr__(self) -> str:
        st = self._status
        return (
            f"Transfer(id={self.id}, op={self.op.name}, peer={self.peer.name!r}, "
            f"nbytes={self.nbytes}, state={st.state.value}{', ' + st.reason if st.reason else ''})"
        )


def wait_any(transfers: list[Transfer], timeout: float) -> list[Transfer]:
    """Block until at least one of ``transfers`` is no longer PENDING, or ``timeout`` s pass;
    return those that are not (``[]`` on timeout), in the order given.

    Why: a thread that acts on whichever of several transfers ends first (e.g. to tell a
    peer at once that its data has landed) would otherwise sleep on one and notice the
    others late, or spin. All ``transfers`` must come from one agent: its backend's
    progress signals wake the wait, as in :meth:`Transfer.wait`, and the earliest
    deadline among them bounds each sleep (polling is what enforces a deadline)."""
    if not transfers:
        return []
    owner = transfers[0]._owner
    if any(t._owner is not owner for t in transfers):
        raise ValueError("wait_any: the transfers come from different agents; wait on each agent's own")
    limit = time.monotonic() + timeout
    sleep = 5e-5
    while True:
        token = owner.progress_token()  # taken before looking, so no signal is missed
        ended = [t for t in transfers if t.status().state is not State.PENDING]
        now = time.monotonic()
        if ended or now >= limit:
            return ended
        # Woken at once by a backend that signals progress. Otherwise a short back-off (also
        # bounds the wait for a silent backend's deadline, which polling enforces), unless
        # the backend promised a signal for every transfer's next change: then only the
        # deadline or a safety cap ends the sleep.
        nap = SIGNALLED_WAIT_CAP_S if all(t.awaits_signal for t in transfers) else sleep
        deadline = min(t.deadline for t in transfers)
        owner.wait_for_progress(token, min(nap, limit - now, max(deadline - now, 0.0) + 1e-4))
        sleep = min(sleep * 2, 2e-3)


@dataclass(frozen=True, eq=False)
class PreparedTransfer:
    """A transfer validated and merged once by ``Agent.prepare``, posted any number of
    times by ``Agent.post`` — the analogue of NIXL's prepared descriptor lists.

    ``Agent.post`` does not redo the range checks; it re-checks, in O(1) unless a region
    was deregistered, that the preparation still holds: same agent, open, the peer still
    the current connection of its name (a replaced or disconnected peer makes it stale),
    and every local region it uses still registered. Anything else raises
    :class:`~kvtransport.errors.StalePreparedTransferError`: prepare again.
    """

    op: Op
    peer: Peer
    #: Bytes moved per post.
    nbytes: int
    #: Segments the backend sees (after merging runs contiguous on both sides).
    nsegments: int
    #: Segments the caller gave (before merging), for the agent's statistics.
    caller_segments: int
    #: Default ``notify`` / ``timeout`` of each post (``Agent.post`` may override them).
    notify: bytes | None
    timeout_s: float
    #: The validated, merged request; ``transfer_id``, ``notify`` and ``deadline`` are
    #: filled in per post. Its arrays are read-only and shared by every post.
    request: PostRequest = field(repr=False)
    #: Distinct local region ids used (checked again on post if regions changed).
    local_region_ids: np.ndarray = field(repr=False)
    #: Which agent prepared it, and its region generation at the time.
    agent_instance: str = field(repr=False)
    regions_generation: int = field(repr=False)


class _SeenRef(weakref.ref):
    """Weak reference to a finished transfer the caller has seen end, keyed by its id."""

    __slots__ = ("tid",)  # set by FinishedTransfers.seen (no Python __init__: one is made per wait)


class FinishedTransfers:
    """Finished transfers not yet returned by ``Agent.progress()``, oldest first.

    The contract (T1 plus bounded memory):

    * ``progress()`` returns every finished transfer at most once, in completion order.
    * A transfer nobody has seen end (no ``status()``/``wait()`` returned its terminal
      state) is kept until ``progress()`` returns it: fire-and-forget callers who learn
      results only from ``progress()`` never miss one.
    * A transfer whose terminal state the caller has seen is held only *weakly*: it is
      still returned by ``progress()`` while the caller holds its ``Transfer`` (and among
      the latest ``window`` seen ones even if not), and forgotten otherwise. So a caller
      that only ``wait()``s — as the README does — leaves nothing behind per transfer.

    Not thread-safe by itself: the agent calls it under its lock. The weak references'
    callbacks (run when a Transfer is freed, on any thread) only pop from the current
    dict, which ``drain`` swaps out before iterating, so they never disturb a drain.
    """

    def __init__(self, window: int):
        self._items: dict[int, Transfer | _SeenRef] = {}
        self._recent: deque[Transfer] = deque(maxlen=max(0, int(window)))
        self._forget_cb = self._forget  # one bound method, not one per seen transfer

    def __len__(self) -> int:
        return len(self._items)

    def add(self, t: Transfer) -> None:
        """``t`` just became terminal."""
        self._items[t.id] = t

    def seen(self, t: Transfer) -> None:
        """A ``status()``/``wait()`` returned ``t``'s terminal state: hold it weakly."""
        if self._items.get(t.id) is t:
            ref = _SeenRef(t, self._forget_cb)
            ref.tid = t.id
            self._items[t.id] = ref
            self._recent.append(t)

    def _forget(self, ref: _SeenRef) -> None:
        self._items.pop(ref.tid, None)

    def drain(self) -> list[Transfer]:
        """Return and forget what is queued."""
        items, self._items = self._items, {}
        out: list[Transfer] = []
        for v in items.values():
            t = v() if isinstance(v, _SeenRef) else v
            if t is not None:
                out.append(t)
        self._recent.clear()  # only now: it keeps the window's transfers alive until here
        return out
