"""One posted NIXL transfer, its state machine, and the poster thread.

Why a poster thread: NIXL's ``transfer()`` (``postXferReq``) returns at once when the
plugin's transport is asynchronous (UCX over tcp or RDMA: the progress thread or the NIC
finishes), but with UCX's cma transport (same host) the kernel copy runs *inside* the call:
a 256 MiB READ blocks the caller for ~90 ms. ``Backend.post`` must not block on the
transfer (it runs under the agent's lock), so transfers above ``inline_post_bytes`` are
handed to one thread per agent that makes that call. Smaller ones are posted inline, where
the copy costs less than the hand-off would.

States (changed only under ``Xfer.lock``)::

    QUEUED --poster--> POSTING --transfer() returns--> IN_FLIGHT | DONE | FAILED
    IN_FLIGHT --check_xfer_state--> DONE | FAILED
    QUEUED --cancel--> FAILED (nothing was posted)

An inline post (``Backend.post`` on the caller's thread) gets its Xfer only after
``transfer()`` returned: IN_FLIGHT or FAILED, or, when NIXL finished it inside the call,
the shared ``DONE_INLINE`` handle. A request in POSTING or IN_FLIGHT may still move bytes;
in DONE or FAILED it cannot (NIXL reports a request finished only when its plugin
completed or failed every operation).
"""

from __future__ import annotations

import enum
import queue
import threading
from collections.abc import Callable
from typing import Any


class Stage(enum.Enum):
    QUEUED = "queued"
    POSTING = "posting"
    IN_FLIGHT = "in_flight"
    DONE = "done"
    FAILED = "failed"


#: NIXL status names -> what they mean for a kvtransport user.
_MEANING = {
    "NIXL_ERR_REMOTE_DISCONNECT": "the peer disconnected or died",
    "NIXL_ERR_NOT_FOUND": "NIXL does not know the peer, memory or request (peer removed or not loaded)",
    "NIXL_ERR_BACKEND": "the NIXL plugin failed the operation",
    "NIXL_ERR_INVALID_PARAM": "NIXL refused the descriptors",
    "NIXL_ERR_NOT_ALLOWED": "NIXL does not allow this operation now",
    "NIXL_ERR_NOT_SUPPORTED": "no configured NIXL plugin supports this",
    "NIXL_ERR_MISMATCH": "the descriptors do not match registered memory",
}


def nixl_error(exc: BaseException, what: str) -> str:
    """``what`` failed, with NIXL's status name and its meaning."""
    status = str(exc).strip() or type(exc).__name__
    meaning = _MEANING.get(status)
    return f"{what}: {status}" + (f" ({meaning})" if meaning else "")


class Xfer:
    """Backend handle of one kvtransport transfer: the NIXL request and where it stands."""

    __slots__ = ("tid", "conn", "handle", "nbytes", "stage", "reason", "lock", "notif", "entry",
                 "__weakref__")

    def __init__(self, tid: int, conn: Any, handle: Any, nbytes: int, notif: bytes = b"",
                 entry: Any = None, *, lock: threading.Lock) -> None:
        self.tid = tid
        self.conn = conn
        self.handle = handle  # nixl_xfer_handle; None once released
        self.nbytes = nbytes
        self.stage = Stage.QUEUED
        self.reason = ""
        #: guards ``stage``: the backend's one lock for all its requests (a new lock per
        #: post costs ~10 µs right after a copy has evicted the caches)
        self.lock = lock
        self.notif = notif  # NIXL message posted with it (b"": none)
        self.entry = entry  # _reuse.Entry the request goes back to when DONE, or None

    @property
    def moving(self) -> bool:
        """Bytes of this transfer may still land (lock held or a racy read for logs)."""
        return self.stage in (Stage.POSTING, Stage.IN_FLIGHT)


def post_now(nx: Any, x: Xfer) -> None:
    """Make NIXL's ``transfer()`` call for ``x`` (may copy inline) and record the outcome."""
    with x.lock:
        if x.stage is not Stage.QUEUED:  # cancelled while queued
            return
        x.stage = Stage.POSTING
    st, reason = transfer(nx, x.handle, x.notif)
    with x.lock:
        apply_state(x, st, reason)


def transfer(nx: Any, handle: Any, notif: bytes) -> tuple[str, str]:
    """NIXL's ``transfer()`` (posting a request; with cma the copy runs inside the call), for
    the poster thread and for inline posts: its status (``DONE``, ``PROC``, ``ERR``) and
    what a failure means (used only when it failed)."""
    try:
        return nx.transfer(handle, notif), "NIXL reported an error posting the transfer"
    except Exception as exc:
        return "ERR", nixl_error(exc, "NIXL refused to post the transfer")


def refresh(nx: Any, x: Xfer) -> None:
    """Ask NIXL how an IN_FLIGHT request stands (``check_xfer_state``); no-op otherwise."""
    if x.stage is not Stage.IN_FLIGHT:
        return  # an unlocked look first: a request leaves IN_FLIGHT only under this lock
    with x.lock:
        if x.stage is not Stage.IN_FLIGHT:
            return
        try:
            st, reason = nx.check_xfer_state(x.handle), ""
        except Exception as exc:
            st, reason = "ERR", nixl_error(exc, "NIXL failed the transfer")
        apply_state(x, st, reason or "NIXL reported the transfer failed (ERR)")


def apply_state(x: Xfer, st: str, reason: str) -> None:
    """Record NIXL's status ``st`` of ``x`` (lock held, or ``x`` not yet shared)."""
    if st == "DONE":
        x.stage = Stage.DONE
    elif st == "PROC":
        x.stage = Stage.IN_FLIGHT
    else:
        x.stage, x.reason = Stage.FAILED, reason


class Poster:
    """One thread that makes NIXL ``transfer()`` calls for large transfers, in order."""

    def __init__(self, nx: Any, name: str, on_done: Callable[[], None]) -> None:
        self._nx = nx
        self._on_done = on_done
        self._q: queue.SimpleQueue[Xfer | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"kvt-nixl-post-{name}", daemon=True)
        self._thread.start()

    def submit(self, x: Xfer) -> None:
        self._q.put(x)

    def _run(self) -> None:
        while True:
            x = self._q.get()
            if x is None:
                return
            post_now(self._nx, x)
            self._on_done()

    def stop(self, timeout: float) -> bool:
        """Ask the thread to end after the queued posts; True once it has."""
        self._q.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()


def _done_handle() -> Xfer:
    x = Xfer(0, None, None, 0, lock=threading.Lock())
    x.stage = Stage.DONE
    return x


#: The handle of every inline post NIXL finished inside ``transfer()``: nothing to track.
DONE_INLINE = _done_handle()
