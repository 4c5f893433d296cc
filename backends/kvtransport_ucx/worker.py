"""One UCP context, its workers ("lanes"), and the progress thread that drives them.

Threading model: every worker is created in ``UCS_THREAD_MODE_SERIALIZED`` and each has its
own lock, taken around every call on that worker; :attr:`UcpWorker.lock` guards the owner's
state. Lock order: the state lock, then at most one lane lock. Copies (which run inside
``ucp_worker_progress`` with cma) hold only their lane's lock, so checking on a transfer never
stops a copy on another lane. Each lane has a progress thread that holds the lane's lock only while it
calls ``ucp_worker_progress`` and friends; it sleeps in ``epoll`` on the lane's event fd (armed
with ``ucp_worker_arm``) plus a wake-up pipe, so an idle agent costs no CPU. ``progress="busy"`` spins instead (lowest latency, one core burnt). Over tcp UCX emulates
RMA with active messages that the *target's* progress thread serves, so the thread is also
what lets peers read and write our memory without any call from the application.

Why more than one lane: a UCP worker is serial, and with cma the copy itself runs inside
``ucp_worker_progress``. Two workers let two threads copy the two halves of a large transfer
on two cores (the posting thread posts and starts lane 0's share inline, lane 1's thread
posts and copies the other half; over tcp the two threads send at once). Every lane's
address is exported; a peer connects its lane k to our lane k (modulo our lane count), and
notifications always travel lane 0 to lane 0.
"""

from __future__ import annotations

import ctypes
import logging
import os
import select
import threading
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any
from ctypes import byref, c_int, c_size_t, c_void_p

from . import ucp as U

_log = logging.getLogger("kvtransport.ucx")

#: Active message id carrying notifications (header = sender agent name, data = payload).
AM_NOTIFY = 0x6B76  # "kv"


class Lane:
    """One UCP worker of the context, with its lock, event fd and job queue."""

    __slots__ = ("index", "worker", "lock", "efd", "jobs")

    def __init__(self, index: int, worker: c_void_p, lock: Any, efd: int) -> None:
        self.index = index
        self.worker = worker
        self.lock = lock
        self.efd = efd
        #: Work handed to this lane's progress thread (see :meth:`UcpWorker.submit`).
        self.jobs: deque[Callable[[], None]] = deque()


class UcpWorker:
    """UCP context and worker with an event-driven progress thread.

    ``on_notify(sender, payload)`` is called by whoever progresses lane 0, with lane 0's
    lock held (not the state lock); it must only record what happened. Endpoint errors can fire on any lane, with
    only that lane's lock held, so they are queued: :meth:`take_ep_errors` hands them over.
    ``after_progress()`` is called after each progress round (lock held) so the owner can
    advance its state machines (e.g. send a notification once a flush completed).
    """

    def __init__(
        self,
        name: str,
        config: Mapping[str, str],
        on_notify: Callable[[str, bytes], None],
        after_progress: Callable[[], None],
        busy_poll: bool = False,
        idle_timeout_s: float = 0.25,
        optional_config: Mapping[str, str] | None = None,
        lanes: int = 1,
    ) -> None:
        self.lib = L = U.lib()
        self.ucp = L.ucp
        self.lock = threading.RLock()
        self._on_notify = on_notify
        self._ep_errors: deque[tuple[int, int]] = deque()
        self._after_progress = after_progress
        self._busy = busy_poll
        self._idle_timeout = idle_timeout_s
        self._stop = False
        self.context = self.worker = None
        #: Rounds of the progress threads, and those that ended because the idle timeout
        #: expired (nothing woke the thread). An idle agent's rounds are all idle wake-ups;
        #: a thread that spins shows rounds without idle wake-ups.
        self.rounds = 0
        self.idle_wakeups = 0

        cfg = c_void_p()
        U.check(self.ucp.ucp_config_read(None, None, byref(cfg)), "ucp_config_read")
        try:
            for key, value in config.items():
                st = self.ucp.ucp_config_modify(cfg, key.encode(), str(value).encode())
                if st != U.UCS_OK:
                    raise U.UcxConfigError(f"setting UCX config {key}={value!r}", st)
            for key, value in (optional_config or {}).items():  # tuning this build may not know
                self.ucp.ucp_config_modify(cfg, key.encode(), str(value).encode())
            params = U.ucp_params_t()
            params.field_mask = (U.UCP_PARAM_FIELD_FEATURES | U.UCP_PARAM_FIELD_NAME
                                 | U.UCP_PARAM_FIELD_MT_WORKERS_SHARED)
            params.features = U.UCP_FEATURE_RMA | U.UCP_FEATURE_AM | U.UCP_FEATURE_WAKEUP
            # Workers of this context are driven from different threads at once (lanes, and
            # memory registration while a progress thread runs).
            params.mt_workers_shared = 1
            self._name_buf = name.encode()[:63]
            params.name = self._name_buf
            ctx = c_void_p()
            U.check(self.ucp.ucp_init_version(U.UCP_API_MAJOR, U.UCP_API_MINOR, byref(params), cfg,
                                              byref(ctx)), "ucp_init")
            self.context = ctx
        finally:
            self.ucp.ucp_config_release(cfg)

        wparams = U.ucp_worker_params_t()
        wparams.field_mask = U.UCP_WORKER_PARAM_FIELD_THREAD_MODE | U.UCP_WORKER_PARAM_FIELD_NAME
        wparams.thread_mode = U.UCS_THREAD_MODE_SERIALIZED
        wparams.name = self._name_buf
        self.lanes: list[Lane] = []
        try:
            for i in range(max(1, int(lanes))):
                w = c_void_p()
                U.check(self.ucp.ucp_worker_create(self.context, byref(wparams), byref(w)), "ucp_worker_create")
                efd = c_int(-1)
                self.lanes.append(Lane(i, w, threading.Lock(), -1))
                U.check(self.ucp.ucp_worker_get_efd(w, byref(efd)), "ucp_worker_get_efd")
                self.lanes[-1].efd = efd.value
        except Exception as exc:
            for lane in self.lanes:
                self.ucp.ucp_worker_destroy(lane.worker)
            self.ucp.ucp_cleanup(self.context)
            if isinstance(exc, U.UcxError) and exc.status == U.UCS_ERR_INVALID_PARAM:
                # Each setting was accepted alone, but the transports refuse the combination
                # (e.g. TCP_RX_SEG_SIZE below TCP_TX_SEG_SIZE); UCX logs which one.
                raise U.UcxConfigError(
                    "opening UCX's transports with these settings (each was accepted alone; "
                    "UCX's log line above names the conflict, e.g. TCP_RX_SEG_SIZE must be >= "
                    f"TCP_TX_SEG_SIZE): {dict(config)}", exc.status) from None
            raise
        self.worker = self.lanes[0].worker

        # Callbacks must stay referenced as long as UCX may call them.
        self._am_cb = U.AM_RECV_CB(self._am_recv)
        self._err_cb = U.ERR_HANDLER_CB(self._ep_error)
        self.err_cb_ptr = ctypes.cast(self._err_cb, c_void_p).value
        hp = U.ucp_am_handler_param_t()
        hp.field_mask = (U.UCP_AM_HANDLER_PARAM_FIELD_ID | U.UCP_AM_HANDLER_PARAM_FIELD_FLAGS
                         | U.UCP_AM_HANDLER_PARAM_FIELD_CB)
        hp.id = AM_NOTIFY
        hp.flags = U.UCP_AM_FLAG_WHOLE_MSG
        hp.cb = ctypes.cast(self._am_cb, c_void_p).value
        U.check(self.ucp.ucp_worker_set_am_recv_handler(self.worker, byref(hp)), "ucp_worker_set_am_recv_handler")

        #: Worker address of every lane; peers connect their lane k to our lane k, so over
        #: tcp each of our progress threads serves one share of the peers' RMA.
        self.addresses: list[bytes] = []
        for lane in self.lanes:
            addr, alen = c_void_p(), c_size_t()
            U.check(self.ucp.ucp_worker_get_address(lane.worker, byref(addr), byref(alen)),
                    "ucp_worker_get_address")
            self.addresses.append(ctypes.string_at(addr, alen.value))
            self.ucp.ucp_worker_release_address(lane.worker, addr)
        self.address = self.addresses[0]

        self._pipes: list[tuple[int, int]] = []
        for _ in self.lanes:
            r, w = os.pipe()
            os.set_blocking(r, False)
            os.set_blocking(w, False)
            self._pipes.append((r, w))
        self._threads = [
            threading.Thread(target=self._run, args=(lane,), name=f"kvt-ucx-progress-{name}-{lane.index}",
                             daemon=True)
            for lane in self.lanes
        ]
        for t in self._threads:
            t.start()

    # -- callbacks (progress thread, lock held) -------------------------------------------
    def _am_recv(self, arg, header, header_length, data, length, param):  # noqa: ANN001
        try:
            if param and param.contents.recv_attr & U.UCP_AM_RECV_ATTR_FLAG_RNDV:
                return U.UCS_OK  # never sent by us (we force eager); drop instead of leaking
            sender = ctypes.string_at(header, header_length).decode("utf-8", "replace") if header_length else ""
            payload = ctypes.string_at(data, length) if length else b""
            self._on_notify(sender, payload)
        except Exception:  # never let an exception cross into C
            pass
        return U.UCS_OK

    def _ep_error(self, arg, ep, status):  # noqa: ANN001
        try:
            self._ep_errors.append((int(arg or 0), int(status)))
        except Exception:
            pass

    @property
    def has_ep_errors(self) -> bool:
        return bool(self._ep_errors)

    def take_ep_errors(self) -> list[tuple[int, int]]:
        """Endpoint errors (error-handler argument, status) reported since the last call."""
        out = []
        while self._ep_errors:
            out.append(self._ep_errors.popleft())
        return out

    # -- progress threads (one per lane) ----------------------------------------------------
    def wake(self, lane: int = 0) -> None:
        """Make a lane's progress thread run a round now (after posting, closing, ...)."""
        try:
            os.write(self._pipes[lane][1], b"x")
        except (BlockingIOError, OSError, IndexError):
            pass  # pipe full: a wake-up is already pending

    def submit(self, lane: int, job: Callable[[], None]) -> None:
        """Run ``job()`` on lane ``lane``'s progress thread, before its next drain, with no
        lock held. Why: over tcp posting *is* sending (UCX writes what the socket takes
        inside the post call), so a transfer's shares must be posted by one thread per
        lane to go out in parallel. Jobs still queued when the thread stops run then, so
        each one can account for itself (the owner closed its connections before stopping
        the threads, so a posting job finds nothing to post on)."""
        self.lanes[lane].jobs.append(job)
        self.wake(lane)

    def _run_jobs(self, lane: Lane) -> None:
        jobs = lane.jobs
        while jobs:
            try:
                jobs.popleft()()
            except Exception:  # a dead progress thread would strand every transfer
                _log.exception("ucx progress thread %s: job failed", lane.index)

    def progress_once(self) -> None:
        with self.lock:
            if self.worker is None:
                return
            for lane in self.lanes:
                self._drain(lane)
            self._after_progress()

    def _drain(self, lane: Lane) -> bool:
        """Progress one lane until it reports nothing to do; False once closed."""
        # Release the lock between progress calls: with cma one call may copy a large
        # fragment, and posting threads must be able to interleave.
        progress = self.ucp.ucp_worker_progress
        while True:
            with lane.lock:
                if lane.worker is None:
                    return False
                if not progress(lane.worker):
                    return True

    def _run(self, lane: Lane) -> None:
        """Progress thread of one lane: drain it, let the owner advance its state machines,
        arm the lane's event fd and sleep until UCX or a wake-up needs us."""
        ep = select.epoll()
        wake_r = self._pipes[lane.index][0]
        ep.register(lane.efd, select.EPOLLIN)
        ep.register(wake_r, select.EPOLLIN)
        arm = self.ucp.ucp_worker_arm
        try:
            while not self._stop:
                self.rounds += 1
                self._run_jobs(lane)
                if not self._drain(lane):
                    return
                with self.lock:
                    if self.worker is None:
                        return
                    try:
                        self._after_progress()
                    except Exception:  # a dead progress thread would strand every transfer
                        _log.exception("ucx progress thread %s: after_progress failed", lane.index)
                if self._busy:
                    continue
                with lane.lock:
                    if lane.worker is None:
                        return
                    if arm(lane.worker) == U.UCS_ERR_BUSY:
                        continue  # events arrived while arming: progress again
                events = ep.poll(self._idle_timeout)
                if not events:
                    self.idle_wakeups += 1
                for fd, _ in events:
                    if fd == wake_r:
                        try:
                            while os.read(wake_r, 4096):
                                pass
                        except BlockingIOError:
                            pass
        finally:
            ep.close()
            self._run_jobs(lane)

    # -- operations (caller holds nothing; we take the lock) -------------------------------
    def request_status(self, req: int) -> int:
        return self.ucp.ucp_request_check_status(req)

    def close(self) -> None:
        """Stop the thread and destroy worker and context. The owner must have closed its
        endpoints, rkeys and memory handles first."""
        self._stop = True
        for i in range(len(self.lanes)):
            self.wake(i)
        for t in self._threads:
            if t.is_alive() and threading.current_thread() is not t:
                t.join(timeout=10)
        with self.lock:
            if self.worker is not None:
                self.worker = None
                for lane in self.lanes:
                    with lane.lock:
                        w, lane.worker = lane.worker, None
                        self.ucp.ucp_worker_destroy(w)
            if self.context is not None:
                self.ucp.ucp_cleanup(self.context)
                self.context = None
        for pipe in self._pipes:
            for fd in pipe:
                try:
                    os.close(fd)
                except OSError:
                    pass
