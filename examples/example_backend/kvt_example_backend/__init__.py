"""``example-memmove``: the smallest complete kvtransport backend (a teaching example).

It moves bytes between agents of *one process* with ``ctypes.memmove``, one call per
merged segment, on one worker thread per agent. The core has already validated every
request, enforces deadlines and reports each completion exactly once, so this file
only moves bytes and says what happened. Notifications go through a process-global
dict of queues ("mailboxes"), one per open agent.
"""

from __future__ import annotations

import ctypes
import os
import queue
import threading
import uuid
from typing import Any

from kvtransport.errors import BackendOptionError, IncompatiblePeerError, PeerMetadataError
from kvtransport.spi import Backend, Capabilities, Op, PollResult, PostRequest, Scope

#: mailbox id -> queue of (sender agent name, payload). The id is the agent name plus a
#: random suffix, so a restarted agent of the same name never gets its predecessor's mail.
_MAILBOXES: dict[str, queue.SimpleQueue] = {}


class _Job:
    """Handle of one posted transfer; ``result`` is what ``poll`` reports."""

    def __init__(self, req: PostRequest):
        self.req, self.result, self.lock = req, PollResult.pending(), threading.Lock()
        self.started = self.finished = self.cancelled = False


class MemmoveBackend(Backend):
    """Copies with memmove between agents of this process (``Scope.SAME_PROCESS`` only)."""

    name = "example-memmove"
    version = "1"  # the core refuses peers running another version
    capabilities = Capabilities(read=True, write=True, notify=True, memory_kinds=frozenset({"cpu"}),
                                scopes=frozenset({Scope.SAME_PROCESS}))
    conformance_options = ({},)  # the conformance suite runs once, with no options

    def __init__(self, agent_name: str, options: dict[str, Any]):
        """Called by ``kvtransport.open``; ``options`` are the caller's backend keywords."""
        if options:  # we take none; an unknown option is a typed error, never ignored
            raise BackendOptionError(f"example-memmove takes no options, got {sorted(options)}")
        super().__init__(agent_name, options)
        self.mailbox = f"{agent_name}/{uuid.uuid4().hex}"
        _MAILBOXES[self.mailbox] = queue.SimpleQueue()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._worker = threading.Thread(target=self._run, name=f"kvt-example-{agent_name}", daemon=True)
        self._worker.start()

    def register(self, region) -> bytes:
        """Our own process's memory needs no pinning or key: no per-region blob."""
        return b""

    def deregister(self, region) -> None:
        """Nothing to undo. The core calls this only when no transfer uses the region."""

    def export(self) -> bytes:
        """Agent blob for peers: our pid (to refuse other processes) and our mailbox id."""
        return f"{os.getpid()} {self.mailbox}".encode()

    def connect(self, peer_name: str, blob: bytes, regions) -> tuple[str, str]:
        """Check a peer's blob; what we return comes back to us as ``PostRequest.peer``."""
        try:
            pid, mailbox = blob.decode().split(" ", 1)
            same_process = int(pid) == os.getpid()
        except (UnicodeDecodeError, ValueError):
            raise PeerMetadataError(f"malformed example-memmove blob from {peer_name!r}") from None
        if not same_process:
            raise IncompatiblePeerError(f"peer {peer_name!r} is another process; example-memmove "
                                        "moves bytes only within one process (use loopback)")
        return (peer_name, mailbox)

    def post(self, req: PostRequest) -> _Job:
        """Queue the copy and return at once (post must not block); the worker does it."""
        job = _Job(req)
        self._jobs.put(job)
        return job

    def _run(self) -> None:
        """Worker thread: one memmove per merged segment, then the notification, then DONE."""
        while (job := self._jobs.get()) is not None:
            with job.lock:
                if job.cancelled:
                    continue
                job.started = True
            r = job.req
            src, dst = (r.remote_addr, r.local_addr) if r.op is Op.READ else (r.local_addr, r.remote_addr)
            try:
                for d, s, n in zip(dst.tolist(), src.tolist(), r.length.tolist()):
                    ctypes.memmove(d, s, n)
                if r.notify is not None:  # only after the data: nobody sees it early
                    self.send_notification(r.peer, r.notify)
                job.result = PollResult.done()
            except Exception as exc:  # e.g. the peer closed: fail this transfer, keep serving
                job.result = PollResult.failed(f"{type(exc).__name__}: {exc}")
            job.finished = True

    def poll(self, handle: _Job) -> PollResult:
        """State of a posted transfer, without blocking."""
        return handle.result

    def cancel(self, handle: _Job) -> bool:
        """The core failed this transfer (deadline...): True if no byte can land any more."""
        with handle.lock:
            handle.cancelled = True
            return handle.finished or not handle.started

    def quiesced(self, handle: _Job) -> bool:
        """Asked after a False ``cancel`` until True: has the running copy ended?"""
        return handle.finished

    def send_notification(self, peer: tuple[str, str], payload: bytes) -> None:
        """A message to a peer's mailbox, without data."""
        box = _MAILBOXES.get(peer[1])
        if box is None:
            raise ConnectionError(f"peer {peer[0]!r} is closed")
        box.put((self.agent_name, payload))

    def notifications(self) -> list[tuple[str, bytes]]:
        """Drain our mailbox: (sender agent name, payload), oldest first."""
        box, out = _MAILBOXES[self.mailbox], []
        while not box.empty():
            out.append(box.get())
        return out

    def close(self) -> None:
        """Stop the worker (queued copies finish first) and remove our mailbox."""
        self._jobs.put(None)
        self._worker.join()
        _MAILBOXES.pop(self.mailbox, None)
