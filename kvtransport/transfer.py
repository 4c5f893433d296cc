"""Transfer handles and their state machine.

``NEW -> PENDING -> DONE | FAILED(reason, quiesced)``. The terminal state is set once
(T1); the owning agent's polling sets it by the deadline at the latest (T2). A FAILED
transfer may still have bytes in flight until ``quiesced`` turns True (T3).
"""

from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import TransferFailedError
from .spi import Op

if TYPE_CHECKING:
    from .agent import Agent, Peer

__all__ = ["State", "TransferStatus", "Transfer"]


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
_DONE = TransferStatus(State.DONE)


class Transfer:
    """Handle of one posted READ or WRITE. Created by ``Agent.read`` / ``Agent.write``."""

    def __init__(
        self,
        agent: Agent,
        tid: int,
        op: Op,
        peer: Peer,
        nbytes: int,
        nsegments: int,
        local_regions: np.ndarray,
        deadline: float,
    ):
        self._agent = agent
        self.id = tid
        self.op = op
        self.peer = peer
        self.nbytes = nbytes
        self.nsegments = nsegments
        self.local_regions = local_regions
        self.deadline = deadline
        self.posted_at = time.monotonic()
        self.finished_at: float | None = None
        self._status: TransferStatus = _PENDING
        self._lock = threading.Lock()
        self._handle: Any = None
        self._released = False

    # -- state changes (core only) --------------------------------------------
    def _finish(self, status: TransferStatus) -> bool:
        """Set the terminal state once. Returns True only for the call that set it."""
        with self._lock:
            if self._status.state is not State.PENDING:
                return False
            self._status = status
            self.finished_at = time.monotonic()
            return True

    def _mark_quiesced(self) -> None:
        with self._lock:
            st = self._status
            if st.state is State.FAILED and not st.quiesced:
                self._status = TransferStatus(State.FAILED, st.reason, True)

    # -- public ---------------------------------------------------------------
    def status(self) -> TransferStatus:
        """Current state; drives progress of this transfer (and enforces its deadline)."""
        if self._status.state is State.PENDING or not self._status.quiesced:
            self._agent._progress_transfer(self)
        return self._status

    @property
    def done(self) -> bool:
        return self.status().done

    @property
    def latency_s(self) -> float | None:
        return None if self.finished_at is None else self.finished_at - self.posted_at

    def wait(self, timeout: float | None = None) -> TransferStatus:
        """Block until DONE/FAILED or ``timeout`` seconds pass (the transfer's own
        deadline bounds the wait anyway). Returns the status at that time."""
        limit = time.monotonic() + timeout if timeout is not None else float("inf")
        sleep = 5e-5
        agent = self._agent
        while True:
            gen = agent._progress_gen
            st = self.status()
            if st.done:
                return st
            now = time.monotonic()
            if now >= limit:
                return st
            # Woken at once by a backend that signals progress; otherwise a short back-off
            # (also bounds the wait for a silent backend's deadline, which polling enforces).
            agent._wait_for_progress(gen, min(sleep, limit - now, max(self.deadline - now, 0.0) + 1e-4))
            sleep = min(sleep * 2, 2e-3)

    def result(self, timeout: float | None = None) -> None:
        """Wait, then raise :class:`TransferFailedError` unless DONE."""
        st = self.wait(timeout)
        if st.state is State.FAILED:
            raise TransferFailedError(f"transfer {self.id} to {self.peer.name!r} failed: {st.reason}")
        if st.state is State.PENDING:
            raise TimeoutError(f"transfer {self.id} still pending after {timeout}s")

    def release(self) -> None:
        """Free backend resources. A pending transfer keeps running until it ends."""
        self._agent._release_transfer(self)

    def __repr__(self) -> str:
        st = self._status
        return (
            f"Transfer(id={self.id}, op={self.op.name}, peer={self.peer.name!r}, "
            f"nbytes={self.nbytes}, state={st.state.value}{', ' + st.reason if st.reason else ''})"
        )
