"""Posting and completion: how one transfer's bytes move, and when it is DONE.

Data path of one transfer (:meth:`DataPath.post`):

1. its bytes are shared among the lanes (:func:`cut`, below ``lane_split_bytes`` all on
   lane 0); per lane one ``ucp_put_nbx`` / ``ucp_get_nbx`` per merged segment, straight from
   the numpy arrays of the :class:`~kvtransport.spi.PostRequest` (the core already merged
   contiguous runs); the per-op requests are released at once, UCX keeps them until they
   complete. Lane k's share is posted by lane k's progress thread, lane 0's by the caller,
   each holding only its lane's lock: over tcp posting is sending, and this way the shares
   are sent in parallel;
2. one ``ucp_ep_flush_nbx`` per lane used: it completes when every RMA issued before it on
   that endpoint completed *at the target*; the flushes are the only requests a transfer
   tracks;
3. after every flush, the notification (if any) as an active message on lane 0, so a peer
   can never observe a WRITE's notification before its data landed.

An :class:`Xfer` moves ``rma -> notify -> done`` or ends ``failed``; it changes state only
under the state lock. The remote side does no work per transfer: with cma (same host) the
initiator's kernel copies, with RDMA the NIC does; over tcp UCX emulates RMA with active
messages served by the target's progress thread (still no application call on the target).
Connections (endpoints, remote keys, peer failure) are :mod:`.peers`' job.
"""

from __future__ import annotations

import ctypes
import functools
import time
from collections.abc import Callable
from ctypes import byref
from typing import Any

import numpy as np

from kvtransport.errors import KVTransportError
from kvtransport.spi import Op, PollResult, PostRequest

from . import native
from . import ucp as U
from .memory import LocalMemory
from .options import UcxOptions
from .peers import Conn, Peers
from .worker import AM_NOTIFY, Lane, UcpWorker


_Arrays = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def cut(parts: _Arrays, nbytes: int) -> tuple[_Arrays, _Arrays]:
    """Split (local addr, remote addr, length, local region, remote region) after ``nbytes``
    bytes (0 < nbytes < total), cutting at most the one segment that straddles the point."""
    la, ra, ln, lr, rr = parts
    cum = np.cumsum(ln)
    i = int(np.searchsorted(cum, nbytes))  # first segment ending at or after the point
    within = nbytes - (int(cum[i]) - int(ln[i]))  # its bytes that belong to the head, >= 1
    hl = ln[: i + 1].copy()
    hl[i] = within
    head = (la[: i + 1], ra[: i + 1], hl, lr[: i + 1], rr[: i + 1])
    if within == int(ln[i]):
        return head, (la[i + 1 :], ra[i + 1 :], ln[i + 1 :], lr[i + 1 :], rr[i + 1 :])
    tla, tra, tln = la[i:].copy(), ra[i:].copy(), ln[i:].copy()
    tla[0] += within
    tra[0] += within
    tln[0] -= within
    return head, (tla, tra, tln, lr[i:], rr[i:])


class Xfer:
    """Backend handle of one posted transfer."""

    __slots__ = ("tid", "conn", "op", "notify", "stage", "flush", "posting", "am_req", "am_bufs",
                 "reason", "error", "cancel_at")

    def __init__(self, tid: int, conn: Conn, op: Op, notify: bytes | None) -> None:
        self.tid = tid
        self.conn = conn
        self.op = op
        self.notify = notify
        self.stage = "rma"  # rma -> notify -> done | failed
        #: One outstanding flush request per lane the transfer used: (lane, request).
        self.flush: list[tuple[Lane, int]] = []
        #: Lanes whose progress thread has yet to post its share (it may still land).
        self.posting = 0
        self.am_req: int | None = None
        self.am_bufs: Any = None
        self.reason = ""
        self.error: str | None = None  # an RMA op failed to post; fail once flushed
        self.cancel_at: float | None = None

    @property
    def quiesced(self) -> bool:
        """No byte of this transfer can land any more."""
        return not self.posting and (not self.flush or self.conn.dead or self.conn.forced)


class DataPath:
    """Posts transfers and standalone notifications and drives them to completion."""

    def __init__(self, w: UcpWorker, opts: UcxOptions, peers: Peers, memory: LocalMemory,
                 signal_progress: Callable[[], None], sender_name: str) -> None:
        self._w = w
        self._ucp = w.ucp
        self._lanes = w.lanes
        self.opts = opts
        self._peers = peers
        self._memory = memory
        self._signal_progress = signal_progress
        self.closed = False  # set by the backend's close (lock held): no more posts
        self.active: set[Xfer] = set()
        self._sends: list[tuple[int, Any]] = []  # standalone AM requests + their buffers
        self.lane_bytes = [0] * len(self._lanes)  # bytes posted per lane (describe())
        #: Split threshold by "peer on this host" (False, True), fixed by the options.
        self._split_bytes = (opts.split_bytes(False), opts.split_bytes(True))
        self._param = U.ucp_request_param_t()  # no callback: requests are polled
        self._am_param = U.ucp_request_param_t()
        self._am_param.op_attr_mask = U.UCP_OP_ATTR_FIELD_FLAGS
        self._am_param.flags = U.UCP_AM_SEND_FLAG_EAGER | U.UCP_AM_SEND_FLAG_COPY_HEADER
        self._am_header = sender_name.encode()
        #: Posts a lane's segment list: compiled loop or ctypes fallback (option ``post``).
        self._poster = native.Poster(self._ucp, memory, self._param, native=opts.post == "native")

    # -- posting ----------------------------------------------------------------------------
    def post(self, req: PostRequest) -> Xfer:
        conn: Conn = req.peer
        if conn.failed:
            raise KVTransportError(conn.failed)
        x = Xfer(req.transfer_id, conn, req.op, req.notify)
        with self._w.lock:
            if self.closed:
                raise KVTransportError("ucx backend is closed")
            if conn.broken:
                self._peers.open(conn)  # our endpoints were force-closed after a stuck cancel
            parts = self.split(req)
            keys = [self._remote_keys(conn, k, rr) for k, _, _, _, _, rr in parts]  # refuse before posting
            conn.xfers.add(x)
            self.active.add(x)
            # Every lane's share is posted holding only that lane's lock: lanes >= 1 by
            # their own progress threads, lane 0 by this thread once the state lock is
            # released. Over tcp a post sends what the socket takes, so the shares go out
            # in parallel; with cma each thread then copies its share (lane 0's inline).
            eps = conn.eps
            x.posting = len(parts)
            for (k, la, ra, ln, lr, _), rks in zip(parts[1:], keys[1:]):
                self._w.submit(k, functools.partial(self._post_share, x, self._lanes[k], eps, la, ra, ln, lr, rks))
        _, la, ra, ln, lr, _ = parts[0]
        lane0 = self._lanes[0]
        outcome, broke = self._post_guarded(x, lane0, eps, la, ra, ln, lr, keys[0], self.opts.inline_progress_s)
        with self._w.lock:
            x.posting -= 1
            self._record(x, lane0, ln, outcome, broke)
            self.advance(x)
            # Wake lane 0's thread only if it has something to finish: a transfer that
            # completed inline (the common cma case) must not pay a thread hand-off, and
            # the other lanes' threads are awake already and advance x when they are done.
            wake = (any(lane.index == 0 for lane, _ in x.flush) or self._sends or self._peers.closing
                    or len(self.active) > 1)
        if wake:
            self._w.wake()
        return x

    def _post_share(self, x: Xfer, lane: Lane, eps: list[int], la: np.ndarray, ra: np.ndarray,
                    ln: np.ndarray, lr: np.ndarray, rks: int | np.ndarray) -> None:
        """Lane ``lane``'s progress thread posts its share of ``x`` (no lock held), then
        records it under the state lock."""
        outcome, broke = self._post_guarded(x, lane, eps, la, ra, ln, lr, rks, 0.0)
        with self._w.lock:
            x.posting -= 1
            self._record(x, lane, ln, outcome, broke)
            self.advance(x)

    def _post_guarded(self, x: Xfer, lane: Lane, eps: list[int], la: np.ndarray, ra: np.ndarray,
                      ln: np.ndarray, lr: np.ndarray, rks: int | np.ndarray,
                      budget_s: float) -> tuple[tuple[int, int | None, int] | None, str]:
        """:meth:`_post_lane`, plus what went wrong if it raised: a share must always be
        accounted for, or its transfer would wait for it forever."""
        try:
            return self._post_lane(x, lane, eps, la, ra, ln, lr, rks, budget_s), ""
        except Exception as exc:  # noqa: BLE001 - reported as the transfer's failure
            return None, f"posting on lane {lane.index} failed: {exc!r}"

    def _post_lane(self, x: Xfer, lane: Lane, eps: list[int], la: np.ndarray, ra: np.ndarray,
                   ln: np.ndarray, lr: np.ndarray, rks: int | np.ndarray,
                   budget_s: float) -> tuple[int, int | None, int] | None:
        """Post one lane's share of a transfer, then its flush, holding only the lane's
        lock, and drive the lane for up to ``budget_s`` while the flush is in progress
        (:meth:`.native.Poster.share`): (status of the first refused RMA post or 0, flush
        request still in progress or None, flush status), or None when nothing was posted.

        Why drive on the posting thread (lane 0's share, ``inline_progress_s``): with cma
        the copy itself runs inside ``ucp_worker_progress``, and doing it here saves the
        hand-off to the progress thread (pipe write, epoll wake-up, lock and GIL
        hand-overs), which cost ~0.5 ms on a 16 MiB transfer, a third of its copy time.
        Driving stops as soon as UCX reports nothing to do (RDMA: the NIC is copying; tcp:
        waiting on the peer), so it never spins idle, and after the budget, so a large
        transfer does not hold the caller long: the progress thread finishes the rest.

        Nothing is posted once the transfer ended, the backend closed, or the connection's
        endpoints changed since ``post`` (``eps`` is the list it saw): endpoints are closed
        only after ``conn.eps`` was replaced (:meth:`.peers.Peers.shut`), each under its
        lane's lock, so an endpoint seen here under that lock is still open."""
        with lane.lock:
            if (x.error or x.stage != "rma" or self.closed or lane.worker is None
                    or x.conn.eps is not eps or x.conn.broken):
                return None
            return self._poster.share(x.op is Op.WRITE, lane.worker, eps[lane.index], la, ra, ln, lr, rks, budget_s)

    def _record(self, x: Xfer, lane: Lane, ln: np.ndarray, outcome: tuple[int, int | None, int] | None,
                broke: str) -> None:
        """Account for one lane's share (state lock held): its flush, or why it was not posted."""
        if outcome is None:
            if x.stage == "rma" and not x.error:
                x.error = broke or f"the endpoint to peer {x.conn.name!r} was closed while posting"
            return
        rma_st, r, st = outcome
        self.lane_bytes[lane.index] += int(ln.sum())
        if rma_st:
            self._rma_failed(x, rma_st)
        if r is not None:
            x.flush.append((lane, r))
        elif st != U.UCS_OK and not x.error:
            x.error = f"RMA to peer {x.conn.name!r} failed: {U.lib().status_string(st)}"

    def _rma_failed(self, x: Xfer, status: int) -> None:
        x.error = (f"{'put' if x.op is Op.WRITE else 'get'} to peer {x.conn.name!r} "
                   f"failed: {U.lib().status_string(status)}")

    def split(self, req: PostRequest) -> list[tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
        """Share a transfer's bytes evenly across the lanes: (lane, local addresses, remote
        addresses, lengths, local regions, remote regions) per lane. Below
        :meth:`.options.UcxOptions.split_bytes` everything goes to lane 0 (a hand-off to the
        progress thread costs more than it saves). At most one segment per boundary is cut in two."""
        rest = (req.local_addr, req.remote_addr, req.length, req.local_region, req.remote_region)
        n = len(self._lanes)
        total = int(req.length.sum())
        if n == 1 or total < self._split_bytes[req.peer.same_host]:
            return [(0, *rest)]
        parts = []
        for k in range(n - 1):
            share = total * (k + 1) // n - total * k // n
            head, rest = cut(rest, share)
            parts.append((k, *head))
        parts.append((n - 1, *rest))
        return parts

    def _remote_keys(self, conn: Conn, lane: int, regions: np.ndarray) -> int | np.ndarray:
        """The remote key on ``lane`` of every segment's region: one key for all (the
        common one-region case) or an array as long as ``regions``."""
        if regions.size and (regions.size == 1 or bool((regions == regions[0]).all())):
            rk = conn.rk_by_id[lane].get(int(regions[0]))  # one region: the common case
            if rk is not None:
                return int(rk)
        else:
            idx = np.searchsorted(conn.rk_ids, regions)
            idx = np.minimum(idx, max(len(conn.rk_ids) - 1, 0))
            if len(conn.rk_ids) and np.array_equal(conn.rk_ids[idx], regions):
                return conn.rk_ptrs[lane][idx]
        raise KVTransportError(f"peer {conn.name!r} exported no remote key for a requested region")

    # -- completion -------------------------------------------------------------------------
    def advance(self, x: Xfer) -> None:
        """Move one transfer through rma -> notify -> done (lock held)."""
        if self._w.has_ep_errors:
            self._peers.absorb_ep_errors()
        if x.stage == "rma":
            if x.posting:  # a lane's thread has yet to post its share
                if x.conn.failed:
                    self.fail(x, x.conn.failed)
                return
            if x.flush:
                for lane, r in x.flush:
                    if self._status(lane, r) == U.UCS_INPROGRESS:
                        if x.conn.failed:
                            self.fail(x, x.conn.failed)
                        return
                check = self._ucp.ucp_request_check_status
                for lane, r in x.flush:
                    with lane.lock:
                        st = check(r)
                        self._ucp.ucp_request_free(r)
                    if st != U.UCS_OK and not x.error:
                        x.error = f"RMA to peer {x.conn.name!r} failed: {U.lib().status_string(st)}"
                x.flush = []
            if not x.error and x.conn.watch_process:
                # UCX may complete the flush of a cma copy that failed half-way because the
                # peer died (seen without peer error handling). A peer that is exiting or
                # gone when the flush completed may have left the copy short: never DONE.
                self._peers.check_alive(x.conn)
            if x.error or x.conn.failed:
                self.fail(x, x.error or x.conn.failed or "")
                return
            if x.notify is None:
                self._finish(x, "done")
                return
            if not x.conn.eps:
                self.fail(x, f"data moved but the endpoint to {x.conn.name!r} was closed before the notification")
                return
            buf = ctypes.create_string_buffer(x.notify, len(x.notify))
            with self._lanes[0].lock:
                r = self._ucp.ucp_am_send_nbx(x.conn.eps[0], AM_NOTIFY, self._am_header, len(self._am_header),
                                              buf, len(x.notify), byref(self._am_param))
            st = U.ptr_status(r)
            if st == U.UCS_INPROGRESS:
                x.am_req, x.am_bufs, x.stage = r, buf, "notify"
                self._w.wake()  # lane 0 must progress for the message to leave
            elif st == U.UCS_OK:
                self._finish(x, "done")
            else:
                self.fail(x, f"data moved but the notification to {x.conn.name!r} failed: "
                             f"{U.lib().status_string(st)}")
        elif x.stage == "notify":
            st = self._status(self._lanes[0], x.am_req)
            if st == U.UCS_INPROGRESS:
                if x.conn.failed:
                    self.fail(x, x.conn.failed)
                return
            with self._lanes[0].lock:
                self._ucp.ucp_request_free(x.am_req)
            x.am_req = x.am_bufs = None
            if st == U.UCS_OK:
                self._finish(x, "done")
            else:
                self.fail(x, f"data moved but the notification to {x.conn.name!r} failed: "
                             f"{U.lib().status_string(st)}")

    def _status(self, lane: Lane, req: int) -> int:
        """A request's status, or UCS_INPROGRESS while its lane is busy (a copy in progress):
        checking never waits for a copy."""
        if not lane.lock.acquire(blocking=False):
            return U.UCS_INPROGRESS
        try:
            return self._ucp.ucp_request_check_status(req)
        finally:
            lane.lock.release()

    def _finish(self, x: Xfer, stage: str) -> None:
        x.stage = stage
        if not x.flush and not x.posting and x.am_req is None:  # else kept until its last request ends
            self.active.discard(x)
            x.conn.xfers.discard(x)
        self._signal_progress()

    def fail(self, x: Xfer, reason: str) -> None:
        """End a transfer FAILED with ``reason`` unless it already ended (lock held)."""
        if x.stage in ("done", "failed"):
            return
        x.reason = reason
        # A notification still being sent keeps its request and payload buffer: UCX reads
        # the buffer until the send ends (freeing the request does not stop it), so the
        # transfer stays in ``active`` and after_progress frees both when it has ended.
        self._finish(x, "failed")

    def fail_transfers(self, conn: Conn, reason: str) -> None:
        """Fail every transfer of a connection that is being dropped (lock held)."""
        for x in list(conn.xfers):
            self.fail(x, reason)

    def forget_all(self) -> None:
        """After the backend destroyed its workers (close, lock held): every request of theirs
        is gone, never to be checked or freed again, and nothing of any transfer can move.
        Every transfer holding a request is in ``active`` until the request is freed, so
        emptying them here leaves nothing for poll/cancel/quiesced/release to touch."""
        for x in list(self.active):
            if x.stage not in ("done", "failed"):
                x.stage, x.reason = "failed", x.reason or "the agent was closed"
            x.flush, x.am_req, x.am_bufs, x.posting = [], None, None, 0
            self.active.discard(x)
            x.conn.xfers.discard(x)
        self._sends = []

    def poll(self, x: Xfer) -> PollResult:
        with self._w.lock:
            if not self.closed:  # after close: absorbing endpoint errors would call into UCX
                self.advance(x)
            if x.stage == "done":
                return PollResult.done()
            if x.stage == "failed":
                return PollResult.failed(x.reason, x.quiesced)
            return PollResult.pending()

    def cancel(self, x: Xfer) -> bool:
        """The core failed ``x`` (deadline, peer failure). RMA in UCX cannot be cancelled one
        by one: we wait for the flush, and if it does not finish within ``cancel_grace_s``
        the endpoint is force-closed (reopened at the next post)."""
        with self._w.lock:
            self.fail(x, "cancelled")
            if x.quiesced:
                self._release_flush(x)
                return True
            x.cancel_at = time.monotonic()
            self.active.add(x)
            self._w.wake()
            return False

    def quiesced(self, x: Xfer) -> bool:
        with self._w.lock:
            self._check_flush(x)
            return x.quiesced

    def release(self, x: Xfer) -> None:
        with self._w.lock:
            if x.stage in ("done", "failed") and x.quiesced:
                self._release_flush(x)

    def _check_flush(self, x: Xfer) -> None:
        if x.am_req is not None and x.stage == "failed":  # a failed transfer's notification
            if self._status(self._lanes[0], x.am_req) != U.UCS_INPROGRESS:
                with self._lanes[0].lock:
                    self._ucp.ucp_request_free(x.am_req)
                x.am_req = x.am_bufs = None
        if x.flush:
            keep = []
            for lane, r in x.flush:
                if self._status(lane, r) == U.UCS_INPROGRESS:
                    keep.append((lane, r))
                else:
                    with lane.lock:
                        self._ucp.ucp_request_free(r)
            x.flush = keep
        if x.quiesced:
            self._release_flush(x)

    def _release_flush(self, x: Xfer) -> None:
        for lane, r in x.flush:  # peer dead / endpoint closed: UCX frees them when they end
            with lane.lock:
                self._ucp.ucp_request_free(r)
        x.flush = []
        if x.am_req is None:  # else its notification's buffer is kept until the send ends
            self.active.discard(x)
            x.conn.xfers.discard(x)

    def after_progress(self, now: float) -> None:
        """Progress-thread round (lock held): advance every live transfer, finish cancelled
        ones (force-closing an endpoint after ``cancel_grace_s``), free sent notifications."""
        for x in list(self.active):
            if x.stage in ("rma", "notify"):
                self.advance(x)
            else:
                self._check_flush(x)
                if (x.flush and x.cancel_at is not None
                        and now - x.cancel_at > self.opts.cancel_grace_s and self.opts.err_mode == "peer"):
                    c = x.conn
                    if c.eps and not c.broken:
                        self._peers.shut(c, force=True)
                    self._release_flush(x)
        if self._sends:
            keep = []
            for r, buf in self._sends:
                if self._status(self._lanes[0], r) == U.UCS_INPROGRESS:
                    keep.append((r, buf))
                else:
                    with self._lanes[0].lock:
                        self._ucp.ucp_request_free(r)
            self._sends = keep

    # -- standalone notifications -------------------------------------------------------------
    def send_notification(self, peer: Conn, payload: bytes) -> None:
        if peer.failed:
            raise KVTransportError(peer.failed)
        with self._w.lock:
            if peer.broken:
                self._peers.open(peer)
            buf = ctypes.create_string_buffer(payload, len(payload))
            with self._lanes[0].lock:
                r = self._ucp.ucp_am_send_nbx(peer.eps[0], AM_NOTIFY, self._am_header, len(self._am_header),
                                              buf, len(payload), byref(self._am_param))
            st = U.ptr_status(r)
            if st == U.UCS_INPROGRESS:
                self._sends.append((r, buf))
            elif st != U.UCS_OK:
                raise KVTransportError(f"notification to {peer.name!r} failed: {U.lib().status_string(st)}")
        self._w.wake()
