"""The ``loopback`` backend: CPU memory on one host, in one process or across processes.

Bytes move with Linux cross-memory attach (``process_vm_readv`` / ``process_vm_writev``,
up to 1024 segments per system call) straight between the two address spaces — no
staging copy, no work in the peer process. When the kernel refuses CMA, peers in the
same process still work through ``memmove``.

Copies run on a small pool of worker threads (ctypes drops the GIL during the system
call), so ``post`` returns at once and large transfers can use both cores.
Notifications travel over the core's authenticated notification transport
(``kvtransport.notify``) on an ``ipc://`` path: each agent exports a random key in its
blob and accepts only messages sealed with it, so a local process that finds the socket
cannot forge a completion. They are sent by the worker only after the data moved, so a
receiver never sees a notification before its bytes.

Peer failure is detected, not guessed: every post checks that the peer's pid still
runs the process that exported the memory (``kvtransport.process_identity``: pid +
start time + boot id), so a dead or restarted peer fails the transfer at once instead of
at the deadline, and a recycled pid is never written to.

Under Yama ``ptrace_scope=1`` a peer may copy from or into this process only once this
process names it with ``PR_SET_PTRACER``; see ``ptrace.py`` for how a connecting peer
asks and is granted (never ANY unless the ``ptrace_grant="any"`` option says so).
"""

from __future__ import annotations

import ctypes
import errno
import os
import tempfile
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
import numpy as np
import zmq

from kvtransport.errors import BackendOptionError, IncompatiblePeerError, NotificationError, PeerMetadataError
from kvtransport.notify import KEY_BYTES, NotificationReceiver, NotificationSender, new_notification_key
from kvtransport.process_identity import ProcessIdentity, ProcessWatch, process_start_time
from kvtransport.spi import (
    Availability,
    Backend,
    Capabilities,
    LocalRegion,
    Op,
    PollResult,
    PostRequest,
    RemoteRegion,
    Scope,
    usable_cpus,
)

from . import cma
from .ptrace import GRANT_MODES, PtracerPolicy, yama_scope

__all__ = ["LoopbackBackend"]

_OPTIONS = {"threads", "notify_dir", "min_split_bytes", "ptrace_grant", "inline_bytes"}
#: Control message kind: "let me attach" (pid, start time, boot id, pid namespace).
ATTACH = "attach"
#: How long a copy refused with EPERM under Yama scope 1 keeps asking the peer to name us.
_GRANT_WAIT_S = 10.0


class _Export(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    pid: int
    start_time: int
    boot_id: str
    notify_addr: str
    notify_key: bytes = b""  # absent in blobs of kvtransport before authenticated notifications
    pid_ns: str = ""  # the pid namespace ``pid`` is valid in ("" = unknown, or an older blob)


class _Attach(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    pid: int
    start_time: int
    boot_id: str
    pid_ns: str


_export_decoder = msgspec.msgpack.Decoder(_Export)
_attach_decoder = msgspec.msgpack.Decoder(_Attach)


class _Peer:
    def __init__(self, name: str, exp: _Export, same_process: bool):
        self.name = name
        self.pid = exp.pid
        self.identity = ProcessIdentity(exp.pid, exp.start_time, exp.boot_id)
        #: Checked before every copy: the open stat file makes that ~3 us instead of ~14.
        self.watch = ProcessWatch(self.identity) if not same_process else None
        self.notify_addr = exp.notify_addr
        self.notify_key = exp.notify_key
        self.same_process = same_process
        self.sender: NotificationSender | None = None  # created and used only on the notify thread
        self.gone = False

    def alive(self) -> bool:
        if self.watch is None:  # our own process
            return True
        alive = self.watch.is_alive()
        if alive is None:  # boot id unreadable: pid + start time still name the process
            return process_start_time(self.pid) == self.identity.start_time
        return alive


class _Job:
    __slots__ = ("result", "started", "finished", "cancelled", "parts_left", "error", "lock")

    def __init__(self, parts: int):
        self.result: PollResult = PollResult.pending()
        self.started = False
        self.finished = False
        self.cancelled = False
        self.parts_left = parts
        self.error: str | None = None
        self.lock = threading.Lock()


class LoopbackBackend(Backend):
    name = "loopback"
    version = "1"
    capabilities = Capabilities(
        read=True, write=True, notify=True, memory_kinds=frozenset({"cpu"}),
        scopes=frozenset({Scope.SAME_PROCESS, Scope.SAME_HOST}), detects_peer_failure=True,
        # the CPU copies both sides (process_vm_*, memmove), so no peer's device memory
        remote_memory_kinds=frozenset({"cpu"}),
    )

    @classmethod
    def probe(cls) -> Availability:
        ok, reason = cma.cma_available()
        if ok:
            return Availability(True)
        # Still usable between agents of one process; say what is missing.
        return Availability(True, f"in-process only: {reason}")

    def __init__(self, agent_name: str, options: Mapping[str, Any]):
        unknown = set(options) - _OPTIONS
        if unknown:
            raise BackendOptionError(
                f"unknown loopback option(s) {sorted(unknown)}; known: {sorted(_OPTIONS)}")
        super().__init__(agent_name, options)
        # Default: two copy threads, or one when this thread may run on one CPU only.
        self.threads = int(options.get("threads", min(2, usable_cpus())))
        if self.threads < 1:
            raise BackendOptionError("loopback option threads must be >= 1")
        # Below this size a transfer is copied by one thread: splitting costs more than it saves.
        self.min_split_bytes = int(options.get("min_split_bytes", 8 << 20))
        # Up to this size a transfer without notification is copied on the posting thread:
        # a KV load of a few blocks takes tens of microseconds, far less than handing it to a
        # copy thread, which must then win the GIL back (from a busy engine loop) to report.
        self.inline_bytes = int(options.get("inline_bytes", 1 << 20))
        mode = options.get("ptrace_grant", "peer")
        if mode not in GRANT_MODES:
            raise BackendOptionError(f"loopback option ptrace_grant must be one of {GRANT_MODES}, got {mode!r}")
        self.cma_ok, self.cma_reason = cma.cma_available()
        # No prctl at open: a peer is named ptracer when it asks (see ptrace.py).
        self.ptrace = PtracerPolicy(yama_scope(), mode)
        self.identity = ProcessIdentity.current()
        self.pid = self.identity.pid
        self.boot_id = self.identity.boot_id or "unknown-" + os.uname().nodename
        # A private (0700) directory: only this user can connect to the notification
        # socket, and it accepts only messages sealed with our key (kvtransport.notify).
        self._own_dir = None if options.get("notify_dir") else tempfile.mkdtemp(prefix="kvt-lb-")
        ndir = options.get("notify_dir") or self._own_dir
        self._ipc_path = os.path.join(ndir, f"{uuid.uuid4().hex[:16]}.sock")
        self.notify_addr = f"ipc://{self._ipc_path}"
        # The process-wide context: a per-agent context would be terminated by the garbage
        # collector when an agent is dropped without close(), which can block forever.
        self._ctx = zmq.Context.instance()
        self._notify_key = new_notification_key()
        self._rx = NotificationReceiver(self._ctx, self.notify_addr, self._notify_key,
                                        name=agent_name, on_control=self._on_control)
        self._copiers = ThreadPoolExecutor(self.threads, thread_name_prefix=f"kvt-lb-{agent_name}")
        # One thread owns every PUSH socket (ZMQ sockets are single-threaded) and keeps
        # notifications in the order their transfers completed.
        self._notifier = ThreadPoolExecutor(1, thread_name_prefix=f"kvt-lb-notify-{agent_name}")
        self._peers: dict[str, _Peer] = {}
        self._closed = False

    # -- memory: nothing to pin or key; CMA reaches any mapped page -----------
    def register(self, region: LocalRegion) -> bytes:
        return b""

    def deregister(self, region: LocalRegion) -> None:
        pass

    # -- peers ----------------------------------------------------------------
    def export(self) -> bytes:
        return msgspec.msgpack.encode(_Export(self.pid, self.identity.start_time, self.boot_id,
                                              self.notify_addr, self._notify_key, self.identity.pid_ns))

    def connect(self, peer_name: str, blob: bytes, regions: Sequence[RemoteRegion]) -> Any:
        try:
            exp = _export_decoder.decode(blob)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise PeerMetadataError(f"malformed loopback blob from {peer_name!r}: {exc}") from None
        if exp.boot_id != self.boot_id:
            raise IncompatiblePeerError(
                f"peer {peer_name!r} runs on another host (boot id differs); loopback moves bytes "
                "only within one host — use the ucx backend across hosts")
        if not exp.notify_addr.startswith("ipc://"):
            raise PeerMetadataError(f"peer {peer_name!r} sent a non-ipc notify address")
        if len(exp.notify_key) != KEY_BYTES:
            raise PeerMetadataError(
                f"peer {peer_name!r} exported no notification key (a kvtransport from before "
                "authenticated notifications); run the same kvtransport version on both sides")
        mine = self.identity.pid_ns
        if exp.pid_ns and mine and exp.pid_ns != mine:
            # CMA names a process by pid in *our* namespace: the peer's pid would name another
            # process here (two containers' engines are often both pid 1)
            raise IncompatiblePeerError(
                f"peer {peer_name!r} runs in another pid namespace (a container without the host's "
                "pid namespace); loopback reaches a process by its pid, so run both engines in one "
                "pid namespace (docker --pid=host, or one pod with shareProcessNamespace) or use ucx")
        same = exp.pid == self.pid and exp.start_time == self.identity.start_time
        if not same and not self.cma_ok:
            raise IncompatiblePeerError(
                f"peer {peer_name!r} is another process but {self.cma_reason}")
        peer = _Peer(peer_name, exp, same)
        if not peer.alive():
            raise PeerMetadataError(f"peer {peer_name!r} (pid {exp.pid}) is no longer running")
        old = self._peers.get(peer_name)
        self._peers[peer_name] = peer
        if old is not None:
            self._retire(old)
        if not same:
            # Ask the peer to let us copy (it names us ptracer under Yama scope 1 only).
            self._notifier.submit(self._send_attach, peer)
        return peer

    def disconnect(self, peer: _Peer) -> None:
        if self._peers.get(peer.name) is peer:
            del self._peers[peer.name]
        self._retire(peer)

    def peer_alive(self, peer: _Peer) -> bool | None:
        # pid + start time: a recycled pid is not the peer. Gone = every thread of it gone
        # (a thread of a peer whose main thread exited may still be copying into us).
        if peer.watch is None:
            return True
        exited = peer.watch.has_exited()
        return peer.alive() if exited is None else not exited

    def _retire(self, peer: _Peer) -> None:
        peer.gone = True

        def close_sock() -> None:
            if peer.sender is not None:
                peer.sender.close(0)
                peer.sender = None

        self._notifier.submit(close_sock)

    # -- data path ------------------------------------------------------------
    def post(self, req: PostRequest) -> _Job:
        peer: _Peer = req.peer
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
        job = _Job(len(chunks))
        for sl in chunks:
            self._copiers.submit(self._copy, job, req, peer, sl)
        return job

    def _copy_inline(self, req: PostRequest, peer: _Peer) -> _Job | None:
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
            if exc.errno == errno.EPERM and self.ptrace.needs_grant and not self._closed:
                self._notifier.submit(self._send_attach, peer)  # ask for the grant again
            return None
        except Exception:
            return None
        return self._ended_job(PollResult.done())

    @staticmethod
    def _ended_job(result: PollResult) -> _Job:
        """A job that ended on the posting thread (no part left for the copy threads)."""
        job = _Job(0)
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

    def _copy(self, job: _Job, req: PostRequest, peer: _Peer, part: slice | tuple[int, int, int]) -> None:
        with job.lock:
            if self._closed and job.error is None:
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

    def _part_done(self, job: _Job, req: PostRequest, peer: _Peer) -> None:
        with job.lock:
            job.parts_left -= 1
            if job.parts_left:
                return
            if job.error is not None or job.cancelled:
                job.result = PollResult.failed(job.error or "cancelled", quiesced=True)
                job.finished = True
                self.signal_progress()
                return
        if req.notify is None:
            job.result = PollResult.done()
            job.finished = True
            self.signal_progress()
        else:
            self._notifier.submit(self._notify_then_done, job, peer, req.notify)

    def _cma_copy(self, job: _Job, req: PostRequest, peer: _Peer,
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
                        or self._closed or time.monotonic() >= give_up):
                    raise
            self._notifier.submit(self._send_attach, peer)
            time.sleep(pause)
            pause = min(pause * 2, 0.05)

    @staticmethod
    def _memmove(op: Op, la: np.ndarray, ra: np.ndarray, ln: np.ndarray) -> None:
        # Fallback when CMA is refused: one call per merged segment.
        src, dst = (ra, la) if op is Op.READ else (la, ra)
        for d, s, n in zip(dst.tolist(), src.tolist(), ln.tolist()):
            ctypes.memmove(d, s, n)

    def _send(self, peer: _Peer, payload: bytes, kind: str = "n") -> None:
        if peer.sender is None:
            peer.sender = NotificationSender(self._ctx, peer.notify_addr, peer.notify_key, self.agent_name)
        peer.sender.send(payload, kind)

    def _send_attach(self, peer: _Peer) -> None:
        if peer.gone:
            return
        me = self.identity
        self._send(peer, msgspec.msgpack.encode(_Attach(me.pid, me.start_time, me.boot_id, me.pid_ns)), ATTACH)

    def _on_control(self, kind: str, sender: str, payload: bytes) -> None:
        """Receiver thread: a peer that holds our metadata asks to copy from/into us."""
        if kind != ATTACH:
            raise ValueError(f"unknown control message {kind!r}")
        a = _attach_decoder.decode(payload)
        self.ptrace.on_attach_request(ProcessIdentity(a.pid, a.start_time, a.boot_id, a.pid_ns))

    def _notify_then_done(self, job: _Job, peer: _Peer, payload: bytes) -> None:
        try:
            if peer.gone or not peer.alive():
                raise ConnectionError(f"peer {peer.name!r} is gone; notification not delivered")
            self._send(peer, payload)
            job.result = PollResult.done()
        except Exception as exc:
            job.result = PollResult.failed(f"data moved but the notification failed: {exc}")
        job.finished = True
        self.signal_progress()

    def poll(self, handle: _Job) -> PollResult:
        return handle.result

    def cancel(self, handle: _Job) -> bool:
        with handle.lock:
            handle.cancelled = True
            return handle.finished or not handle.started

    def quiesced(self, handle: _Job) -> bool:
        return handle.finished or not handle.started

    # -- notifications --------------------------------------------------------
    def notifications(self) -> list[tuple[str, bytes]]:
        return self._rx.drain()

    def send_notification(self, peer: _Peer, payload: bytes) -> None:
        if peer.gone or not peer.alive():
            raise NotificationError(f"peer {peer.name!r} is gone")
        fut = self._notifier.submit(self._send, peer, payload)
        fut.result(timeout=5)

    # -- lifetime -------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # Not cancel_futures: a dropped part would leave its job PENDING and unquiesced for
        # good; queued parts run, see _closed and end their jobs FAILED without copying.
        self._copiers.shutdown(wait=True)
        for p in list(self._peers.values()):
            self._retire(p)
        self._notifier.shutdown(wait=True)
        # No thread of ours asks any more: close the peers' /proc/PID/stat descriptors now
        # (a peer replaced or disconnected earlier closes its own when it is collected).
        for p in self._peers.values():
            if p.watch is not None:
                p.watch.close()
        self._peers.clear()
        self._rx.close()
        for path, rm in ((self._ipc_path, os.unlink), (self._own_dir, os.rmdir)):
            try:
                if path:
                    rm(path)
            except OSError:
                pass

    def describe(self) -> dict[str, Any]:
        return {"cross_process": self.cma_ok, "cross_process_reason": self.cma_reason,
                "threads": self.threads, "notify_addr": self.notify_addr,
                "notification_refusals": self._rx.refusals,
                "ptrace_scope": self.ptrace.scope, "ptrace_grant": self.ptrace.mode,
                "ptrace_grants": self.ptrace.grants}

