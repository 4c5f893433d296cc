"""The loopback data path: copies with cross-memory attach on a pool of copy threads.

Bytes move with ``process_vm_readv`` / ``process_vm_writev`` (``cma.py``, up to 1024
segments per system call) straight between the two address spaces, or with ``memmove``
between agents of one process when the kernel refuses CMA. A small transfer without a
notification is copied on the posting thread; others are cut into parts (whole segment
ranges, or byte ranges of one big segment) for the copy threads. After a CMA copy the
peer's process is checked again: the copy named it by pid only, so a peer that ended
meanwhile fails the transfer. A notification is sent by the notifier thread
(``peers.py``) only after the data moved.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvtransport.errors import BackendOptionError
from kvtransport.spi import Op, PollResult, PostRequest

from . import cma
from .options import LoopbackOptions
from .peers import Conn, Peers
from .ptrace import PtracerPolicy

__all__ = ["DataPath", "Xfer"]

#: How long a copy refused with EPERM under Yama scope 1 keeps asking the peer to name us.
_GRANT_WAIT_S = 10.0


class Xfer:
    """Backend handle of one posted transfer."""

    __slots__ = ("result", "started", "finished", "cancelled", "parts_left", "error", "lock")

    def __init__(self, parts: int):
        self.result: PollResult = PollResult.pending()
        self.started = False
        self.finished = False
        self.cancelled = False
        self.parts_left = parts
        self.error: str | None = None
        self.lock = threading.Lock()


def _run_on(cpus: tuple[int, ...] | None) -> None:
    """Copy thread start: confine this thread (only) to ``cpus`` when given."""
    if cpus is not None:
        os.sched_setaffinity(0, cpus)  # 0: the calling thread on Linux


def check_cpus(cpus: tuple[int, ...]) -> None:
    """Refuse at open ``copy_cpus`` this process may not run on (a copy thread started
    there would fail to move, silently, onto them)."""
    failure: list[BaseException] = []

    def probe() -> None:
        try:
            _run_on(cpus)
        except (OSError, ValueError, AttributeError) as exc:
            failure.append(exc)

    t = threading.Thread(target=probe, name="kvt-lb-cpu-probe")
    t.start()
    t.join()
    if failure:
        raise BackendOptionError(f"loopback backend: copy_cpus {list(cpus)}: a thread cannot run there "
                                 f"({failure[0]}); name CPUs this process may use (its cpuset) or drop copy_cpus")


class DataPath:
    """post / poll / cancel / quiesced of one loopback agent, and its copy threads."""

    def __init__(self, agent_name: str, opts: LoopbackOptions, cma_ok: bool, ptrace: PtracerPolicy,
                 peers: Peers, signal_progress: Callable[[], None]) -> None:
        self.threads = opts.threads
        self.min_split_bytes = opts.min_split_bytes
        self.inline_bytes = opts.inline_bytes
        self.cma_ok = cma_ok
        self.ptrace = ptrace
        self._peers = peers
        self._signal = signal_progress
        self.copy_cpus = opts.copy_cpus
        if self.copy_cpus is not None:
            check_cpus(self.copy_cpus)
        self.copiers = ThreadPoolExecutor(self.threads, thread_name_prefix=f"kvt-lb-{agent_name}",
                                          initializer=_run_on, initargs=(self.copy_cpus,))
        self.closed = False

    def post(self, req: PostRequest) -> Xfer:
        peer: Conn = req.peer
        if peer.gone:
            raise ConnectionError(f"peer {peer.name!r} was disconnected")
        if not peer.alive():
            peer.gone = True
            raise ConnectionError(f"peer {peer.name!r} (pid {peer.pid}) is gone")
        if req.notify is None and int(req.length.sum()) <= self.inline_bytes:
            job = self._copy_inline(req, peer)
            if job is not None:
                return job
        chunks = self._split(req)
        job = Xfer(len(chunks))
        for sl in chunks:
            self.copiers.submit(self._copy, job, req, peer, sl)
        return job

    def _copy_inline(self, req: PostRequest, peer: Conn) -> Xfer | None:
        """One attempt on the posting thread; None (copy threads take over, with their
        ptrace-grant retries) if it did not go through. Copies are idempotent, so a
        partial attempt is simply redone."""
        try:
            if peer.same_process and not self.cma_ok:
                self._memmove(req.op, req.local_addr, req.remote_addr, req.length)
            else:
                cma.copy_segments("read" if req.op is Op.READ else "write", peer.pid,
                                  req.local_addr, req.remote_addr, req.length)
                if not peer.alive():  # the pid may name another process by now: not DONE
                    return self._ended_job(PollResult.failed(
                        f"peer {peer.name!r} (pid {peer.pid}) ended during the copy", quiesced=True))
        except cma.CmaError as exc:
            if exc.errno == errno.EPERM and self.ptrace.needs_grant and not self.closed:
                self._peers.ask_grant(peer)  # ask for the grant again
            return None
        except Exception:
            return None
        return self._ended_job(PollResult.done())

    @staticmethod
    def _ended_job(result: PollResult) -> Xfer:
        """A job that ended on the posting thread (no part left for the copy threads)."""
        job = Xfer(0)
        job.started = job.finished = True
        job.result = result
        return job

    def _split(self, req: PostRequest) -> list[slice | tuple[int, int, int]]:
        """Work items: whole segment ranges, or byte ranges of one big segment, so that a
        large transfer keeps every copy thread busy."""
        n = int(req.length.size)
        total = int(req.length.sum())
        if self.threads == 1 or total < self.min_split_bytes:
            return [slice(0, n)]
        if n >= self.threads:
            # Balance by bytes: cut where the running byte count crosses k/threads.
            ends = np.cumsum(req.length)
            cuts = np.searchsorted(ends, [total * k // self.threads for k in range(1, self.threads)])
            bounds = [0, *sorted({int(c) + 1 for c in cuts if 0 < int(c) + 1 < n}), n]
            return [slice(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]
        # Fewer segments than threads: cut them in byte ranges (segment index, start, stop).
        return self._byte_chunks(req)

    def _byte_chunks(self, req: PostRequest) -> list[tuple[int, int, int]]:
        out: list[tuple[int, int, int]] = []
        per = -(-int(req.length.sum()) // self.threads)
        for i, ln in enumerate(req.length.tolist()):
            for start in range(0, ln, per):
                out.append((i, start, min(ln, start + per)))
        return out

    def _copy(self, job: Xfer, req: PostRequest, peer: Conn, part: slice | tuple[int, int, int]) -> None:
        with job.lock:
            if self.closed and job.error is None:
                job.error = "the agent was closed before this part was copied"
            skip = job.cancelled or job.error is not None
            if not skip:
                job.started = True
        if skip:  # outside the lock: _part_done takes it again
            return self._part_done(job, req, peer)
        try:
            if isinstance(part, slice):
                la, ra, ln = req.local_addr[part], req.remote_addr[part], req.length[part]
            else:
                i, a, b = part
                la = req.local_addr[i:i + 1] + np.uint64(a)
                ra = req.remote_addr[i:i + 1] + np.uint64(a)
                ln = np.array([b - a], dtype=np.uint64)
            if peer.same_process and not self.cma_ok:
                self._memmove(req.op, la, ra, ln)
            else:
                self._cma_copy(job, req, peer, la, ra, ln)
                # The copy named the peer by pid only: if it ended meanwhile, the pid may
                # be another process's and the bytes are not the peer's (READ) or went to
                # a stranger (WRITE). Alive now means alive throughout: fail otherwise.
                if not peer.alive():
                    raise ConnectionError("ended during the copy")
        except Exception as exc:
            with job.lock:
                job.error = job.error or (
                    f"peer {peer.name!r} (pid {peer.pid}) is gone" if not peer.alive()
                    else f"copy failed: {exc}")
        self._part_done(job, req, peer)

    def _part_done(self, job: Xfer, req: PostRequest, peer: Conn) -> None:
        with job.lock:
            job.parts_left -= 1
            if job.parts_left:
                return
            if job.error is not None or job.cancelled:
                job.result = PollResult.failed(job.error or "cancelled", quiesced=True)
                job.finished = True
                self._signal()
                return
        if req.notify is None:
            job.result = PollResult.done()
            job.finished = True
            self._signal()
        else:
            self._peers.on_notifier(self._notify_then_done, job, peer, req.notify)

    def _cma_copy(self, job: Xfer, req: PostRequest, peer: Conn,
                  la: np.ndarray, ra: np.ndarray, ln: np.ndarray) -> None:
        """CMA copy; under Yama scope 1 an EPERM means the peer names another ptracer (or
        has not handled our request yet): ask again, back off, retry, within bounds."""
        op = "read" if req.op is Op.READ else "write"
        give_up = min(req.deadline, time.monotonic() + _GRANT_WAIT_S)
        pause = 0.001
        while True:
            try:
                cma.copy_segments(op, peer.pid, la, ra, ln, should_stop=lambda: job.cancelled)
                return
            except cma.CmaError as exc:
                if (exc.errno != errno.EPERM or not self.ptrace.needs_grant or job.cancelled
                        or self.closed or time.monotonic() >= give_up):
                    raise
            self._peers.ask_grant(peer)
            time.sleep(pause)
            pause = min(pause * 2, 0.05)

    @staticmethod
    def _memmove(op: Op, la: np.ndarray, ra: np.ndarray, ln: np.ndarray) -> None:
        # Fallback when CMA is refused: one call per merged segment.
        src, dst = (ra, la) if op is Op.READ else (la, ra)
        for d, s, n in zip(dst.tolist(), src.tolist(), ln.tolist()):
            ctypes.memmove(d, s, n)

    def _notify_then_done(self, job: Xfer, peer: Conn, payload: bytes) -> None:
        try:
            if peer.gone or not peer.alive():
                raise ConnectionError(f"peer {peer.name!r} is gone; notification not delivered")
            self._peers.send(peer, payload)
            job.result = PollResult.done()
        except Exception as exc:
            job.result = PollResult.failed(f"data moved but the notification failed: {exc}")
        job.finished = True
        self._signal()

    @staticmethod
    def poll(handle: Xfer) -> PollResult:
        return handle.result

    @staticmethod
    def cancel(handle: Xfer) -> bool:
        with handle.lock:
            handle.cancelled = True
            return handle.finished or not handle.started

    @staticmethod
    def quiesced(handle: Xfer) -> bool:
        return handle.finished or not handle.started

    def close(self) -> None:
        """Stop taking parts; queued parts run, see ``closed`` and end their jobs FAILED
        without copying (not cancel_futures: a dropped part would leave its job PENDING and
        unquiesced for good)."""
        self.closed = True
        self.copiers.shutdown(wait=True)
