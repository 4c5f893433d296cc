"""Posting, chunking and completion of transfers on one Mooncake engine.

A posted transfer (:class:`Xfer`) is cut into Mooncake batches of at most ``chunk_segments``
segments, submitted with ``batch_transfer_async_read/write`` (numpy address arrays sliced
and turned into lists in one call each: no Python loop per segment). At most
``max_inflight_segments`` segments per peer are with Mooncake at once: its TCP transport
queues 1024 slices per peer and fails the rest, so the next chunk is submitted when an
earlier one completed. Completion is read with the non-blocking C++ status calls of
:mod:`.abi`.

Everything here runs under the agent lock (the core serialises SPI calls), except the
notifier thread, which only sets ``NotifyJob.result``. Batches are reaped per *peer*, not
per job, so a transfer whose waiter never polls cannot hold another's capacity.

Quiescence: Mooncake cannot cancel a submitted batch, and a batch reported FAILED may still
have tasks moving bytes (its status turns FAILED at the first failed task). A job is
quiescent when every task of every batch it submitted has ended; only then is the batch
freed. Mooncake's TCP transport ends a stalled task itself (status-frame timeout,
``MC_TCP_STATUS_TIMEOUT_SEC``; a dead peer closes the socket at once).
"""

from __future__ import annotations

import enum
import time
from typing import Any

from kvtransport.spi import Op, PollResult, PostRequest

from .abi import EngineStatus, TaskState
from .notify import Notifier, NotifyJob, seal
from .options import MooncakeOptions
from .peers import Conn

#: What ``batch_transfer_async_*`` returns when it could not submit: 0, or -1 wrapped to
#: uint64 when the peer's segment could not be opened.
_BAD_BATCH_IDS = (0, (1 << 64) - 1)


class JobState(enum.Enum):
    MOVING = "moving"  # chunks being submitted / in flight
    NOTIFYING = "notifying"  # data complete; the notification is on its way
    DONE = "done"
    FAILED = "failed"


class Xfer:
    """Backend handle of one posted transfer."""

    def __init__(self, req: PostRequest, conn: Conn) -> None:
        self.req, self.conn = req, conn
        self.n = len(req.length)
        self.next = 0  # first segment not yet submitted
        self.batches: list[tuple[int, int]] = []  # (batch id, tasks) with Mooncake
        self.state = JobState.MOVING
        self.reason = ""
        self.notify: NotifyJob | None = None

    def fail(self, reason: str) -> None:
        if self.state in (JobState.MOVING, JobState.NOTIFYING):
            self.state, self.reason = JobState.FAILED, reason


class DataPath:
    """The data path of one backend instance (one Mooncake engine)."""

    def __init__(self, engine: Any, opts: MooncakeOptions, notifier: Notifier, sender: str) -> None:
        self._engine = engine
        self._sender = sender
        self._status = EngineStatus(engine.get_engine_ptr())
        self._opts = opts
        self._notifier = notifier

    # -- posting --------------------------------------------------------------------------
    def post(self, req: PostRequest, conn: Conn) -> Xfer:
        if conn.gone:
            raise ConnectionError(f"peer {conn.name!r} is gone: {conn.gone}")
        job = Xfer(req, conn)
        conn.jobs.append(job)
        self.pump(conn)
        if job.state is JobState.FAILED and job.next == 0:
            conn.jobs.remove(job)
            raise ConnectionError(job.reason)  # nothing submitted: the core fails it at once
        return job

    def _submit(self, job: Xfer, end: int) -> None:
        r, i = job.req, job.next
        if r.op is Op.READ:
            call = self._engine.batch_transfer_async_read
        else:
            call = self._engine.batch_transfer_async_write
        try:
            bid = call(job.conn.session, r.local_addr[i:end].tolist(), r.remote_addr[i:end].tolist(),
                       r.length[i:end].tolist())
        except Exception as exc:  # the binding raised: this transfer fails, the agent serves on
            job.fail(f"Mooncake could not submit segments {i}..{end}: {type(exc).__name__}: {exc}")
            return
        if bid in _BAD_BATCH_IDS:
            job.fail(f"Mooncake refused to submit segments {i}..{end} to {job.conn.session} "
                     "(peer segment cannot be opened or the transport refused the batch)")
            return
        job.batches.append((bid, end - i))
        job.conn.inflight += end - i
        job.next = end

    # -- progress -------------------------------------------------------------------------
    def pump(self, conn: Conn) -> None:
        """Reap finished batches of every job of ``conn``, check the peer, submit chunks."""
        self._check_peer(conn)
        for job in list(conn.jobs):
            self._reap(job)
        cap, chunk = self._opts.max_inflight_segments, self._opts.chunk_segments
        full = False
        for job in conn.jobs:
            while not full and job.state is JobState.MOVING and job.next < job.n:
                end = min(job.next + chunk, job.n)
                full = conn.inflight > 0 and conn.inflight + (end - job.next) > cap
                if not full:  # FIFO: once full, later jobs wait for capacity too
                    self._submit(job, end)
        for job in list(conn.jobs):
            if job.state is JobState.MOVING and job.next == job.n and not job.batches:
                self._data_complete(job)
            if not job.batches and (job.state is not JobState.MOVING):
                conn.jobs.remove(job)

    def _reap(self, job: Xfer) -> None:
        keep = []
        for bid, ntasks in job.batches:
            st = self._status.batch(bid)
            if st is TaskState.FAILED:
                job.fail(f"Mooncake reported the transfer to {job.conn.session} FAILED"
                         + (f" ({job.conn.gone})" if job.conn.gone else ""))
            finished = st is TaskState.COMPLETED
            if not finished and job.state is JobState.FAILED:  # quiescent once every task ended
                finished = self._status.unfinished_tasks(bid, ntasks) == 0
            if finished and self._status.free(bid):
                job.conn.inflight -= ntasks
                continue
            keep.append((bid, ntasks))
        job.batches = keep

    def _data_complete(self, job: Xfer) -> None:
        if job.req.notify is None:
            job.state = JobState.DONE
            return
        try:
            msg = seal(job.conn.auth, self._sender, job.req.notify)
        except Exception as exc:  # e.g. payload over the notification size limit
            job.state, job.reason = JobState.FAILED, f"notification not sent: {exc}"
            return
        job.state = JobState.NOTIFYING
        job.notify = self._notifier.submit(NotifyJob(job.conn.session, job.conn.exp.scratch_addr, msg))

    def _check_peer(self, conn: Conn) -> None:
        if conn.gone or not conn.watch or not conn.jobs:
            return
        now = time.monotonic()
        if now < conn.next_check:
            return
        conn.next_check = now + self._opts.liveness_interval_s
        if conn.alive() is False:
            self.drop(conn, f"peer {conn.name!r} (pid {conn.ident.pid}) exited")

    def drop(self, conn: Conn, reason: str) -> None:
        """The peer is gone or disconnected: fail its jobs (their batches are still reaped)."""
        conn.gone = conn.gone or reason
        for job in conn.jobs:
            job.fail(reason)

    # -- SPI ------------------------------------------------------------------------------
    def poll(self, job: Xfer) -> PollResult:
        if job.state in (JobState.MOVING, JobState.FAILED) and (job.batches or job in job.conn.jobs):
            self.pump(job.conn)
        if job.state is JobState.NOTIFYING and job.notify is not None and job.notify.result is not None:
            if job.notify.result:
                job.state, job.reason = JobState.FAILED, job.notify.result
            else:
                job.state = JobState.DONE
        if job.state is JobState.DONE:
            return PollResult.done()
        if job.state is JobState.FAILED:
            return PollResult.failed(job.reason, quiesced=not job.batches)
        return PollResult.pending()

    def cancel(self, job: Xfer) -> bool:
        """Mooncake cannot withdraw a submitted batch: stop submitting; True once none runs."""
        job.fail("cancelled")
        self.pump(job.conn)
        return not job.batches

    def quiesced(self, job: Xfer) -> bool:
        if job.batches:
            self.pump(job.conn)
        return not job.batches
