"""One UCP context + worker, and the progress thread that drives it.

Threading model: UCX is created in ``UCS_THREAD_MODE_SERIALIZED`` and every UCX call goes
through :attr:`UcpWorker.lock`. The progress thread holds the lock only while it calls
``ucp_worker_progress`` and friends; it sleeps in ``epoll`` on the worker's event fd (armed with
``ucp_worker_arm``) plus a wake-up pipe, so an idle agent costs no CPU. ``progress="busy"``
spins instead (lowest latency, one core burnt). Over tcp UCX emulates RMA with active messages
that the *target's* progress thread serves, so the thread is also what lets peers read and
write our memory without any call from the application.
"""

from __future__ import annotations

import ctypes
import os
import select
import threading
from collections.abc import Callable, Mapping
from ctypes import byref, c_int, c_size_t, c_void_p

from . import _ucp as U

#: Active message id carrying notifications (header = sender agent name, data = payload).
AM_NOTIFY = 0x6B76  # "kv"


class UcpWorker:
    """UCP context and worker with an event-driven progress thread.

    ``on_notify(sender, payload)`` and ``on_ep_error(ep_key, status)`` are called on the
    progress thread with :attr:`lock` held; they must only record what happened.
    ``after_progress()`` is called after each progress round (lock held) so the owner can
    advance its state machines (e.g. send a notification once a flush completed).
    """

    def __init__(
        self,
        name: str,
        config: Mapping[str, str],
        on_notify: Callable[[str, bytes], None],
        on_ep_error: Callable[[int, int], None],
        after_progress: Callable[[], None],
        busy_poll: bool = False,
        idle_timeout_s: float = 0.25,
        optional_config: Mapping[str, str] | None = None,
    ) -> None:
        self.lib = L = U.lib()
        self.ucp = L.ucp
        self.lock = threading.RLock()
        self._on_notify = on_notify
        self._on_ep_error = on_ep_error
        self._after_progress = after_progress
        self._busy = busy_poll
        self._idle_timeout = idle_timeout_s
        self._stop = False
        self.context = self.worker = None
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
            params.field_mask = U.UCP_PARAM_FIELD_FEATURES | U.UCP_PARAM_FIELD_NAME
            params.features = U.UCP_FEATURE_RMA | U.UCP_FEATURE_AM | U.UCP_FEATURE_WAKEUP
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
        w = c_void_p()
        try:
            U.check(self.ucp.ucp_worker_create(self.context, byref(wparams), byref(w)), "ucp_worker_create")
        except Exception:
            self.ucp.ucp_cleanup(self.context)
            raise
        self.worker = w

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

        addr, alen = c_void_p(), c_size_t()
        U.check(self.ucp.ucp_worker_get_address(self.worker, byref(addr), byref(alen)), "ucp_worker_get_address")
        self.address = ctypes.string_at(addr, alen.value)
        self.ucp.ucp_worker_release_address(self.worker, addr)

        efd = c_int(-1)
        U.check(self.ucp.ucp_worker_get_efd(self.worker, byref(efd)), "ucp_worker_get_efd")
        self._efd = efd.value
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._thread = threading.Thread(target=self._run, name=f"kvt-ucx-progress-{name}", daemon=True)
        self._thread.start()

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
            self._on_ep_error(int(arg or 0), int(status))
        except Exception:
            pass

    # -- progress thread ------------------------------------------------------------------
    def wake(self) -> None:
        """Make the progress thread run a round now (after posting, closing, ...)."""
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # pipe full: a wake-up is already pending

    def progress_once(self) -> None:
        with self.lock:
            if self.worker is None:
                return
            while self.ucp.ucp_worker_progress(self.worker):
                pass
            self._after_progress()

    def _run(self) -> None:
        ep = select.epoll()
        ep.register(self._efd, select.EPOLLIN)
        ep.register(self._wake_r, select.EPOLLIN)
        try:
            while not self._stop:
                # Release the lock between progress calls: with cma one call may copy a
                # large fragment, and posting threads must be able to interleave.
                while True:
                    with self.lock:
                        if self.worker is None:
                            return
                        if not self.ucp.ucp_worker_progress(self.worker):
                            break
                with self.lock:
                    if self.worker is None:
                        return
                    self._after_progress()
                    armed = self._busy or self.ucp.ucp_worker_arm(self.worker)
                if self._busy:
                    continue
                if armed == U.UCS_ERR_BUSY:
                    continue  # events arrived while arming: progress again
                events = ep.poll(self._idle_timeout)
                if not events:
                    self.idle_wakeups += 1
                for fd, _ in events:
                    if fd == self._wake_r:
                        try:
                            while os.read(self._wake_r, 4096):
                                pass
                        except BlockingIOError:
                            pass
        finally:
            ep.close()

    # -- operations (caller holds nothing; we take the lock) -------------------------------
    def request_status(self, req: int) -> int:
        return self.ucp.ucp_request_check_status(req)

    def close(self) -> None:
        """Stop the thread and destroy worker and context. The owner must have closed its
        endpoints, rkeys and memory handles first."""
        self._stop = True
        self.wake()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=10)
        with self.lock:
            if self.worker is not None:
                self.ucp.ucp_worker_destroy(self.worker)
                self.worker = None
            if self.context is not None:
                self.ucp.ucp_cleanup(self.context)
                self.context = None
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
