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

This class is a facade over the backend skeleton's parts: ``options.py`` (the options,
declared), ``probe.py`` (can CMA be used here), ``wire.py`` (the exported blob and the
``attach`` control message), ``peers.py`` (connections, peer liveness, the notifier
thread) and ``datapath.py`` (copies, completion); ``cma.py`` and ``ptrace.py`` beside them
bind the system calls.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import zmq

from kvtransport.errors import NotificationError
from kvtransport.notify import NotificationReceiver, new_notification_key
from kvtransport.process_identity import ProcessIdentity
from kvtransport.spi import (
    Availability,
    Backend,
    Capabilities,
    LocalRegion,
    PollResult,
    PostRequest,
    RemoteRegion,
    Scope,
)

from . import cma, probe
from .datapath import DataPath, Xfer
from .options import parse_options
from .peers import Conn, Peers
from .ptrace import PtracerPolicy, yama_scope

__all__ = ["LoopbackBackend"]


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
        return probe.probe()

    def __init__(self, agent_name: str, options: Mapping[str, Any]):
        opts = parse_options(options)
        super().__init__(agent_name, options)
        self.threads = opts.threads
        self.cma_ok, self.cma_reason = cma.cma_available()
        # No prctl at open: a peer is named ptracer when it asks (see ptrace.py).
        self.ptrace = PtracerPolicy(yama_scope(), opts.ptrace_grant)
        self.identity = ProcessIdentity.current()
        # A private (0700) directory: only this user can connect to the notification
        # socket, and it accepts only messages sealed with our key (kvtransport.notify).
        self._own_dir = None if opts.notify_dir else tempfile.mkdtemp(prefix="kvt-lb-")
        ndir = opts.notify_dir or self._own_dir
        self._ipc_path = os.path.join(ndir, f"{uuid.uuid4().hex[:16]}.sock")
        self.notify_addr = f"ipc://{self._ipc_path}"
        # The process-wide context: a per-agent context would be terminated by the garbage
        # collector when an agent is dropped without close(), which can block forever.
        ctx = zmq.Context.instance()
        self._notify_key = new_notification_key()
        self._peers = Peers(agent_name, self.identity, self.identity.boot_id or "unknown-" + os.uname().nodename,
                            self.cma_ok, self.cma_reason, self.ptrace, ctx)
        self._rx = NotificationReceiver(ctx, self.notify_addr, self._notify_key,
                                        name=agent_name, on_control=self._peers.on_control)
        self._data = DataPath(agent_name, opts, self.cma_ok, self.ptrace, self._peers, self.signal_progress)
        self._closed = False

    # -- memory: nothing to pin or key; CMA reaches any mapped page -----------
    def register(self, region: LocalRegion) -> bytes:
        return b""

    def deregister(self, region: LocalRegion) -> None:
        pass

    # -- peers ----------------------------------------------------------------
    def export(self) -> bytes:
        return self._peers.export(self.notify_addr, self._notify_key)

    def connect(self, peer_name: str, blob: bytes, regions: Sequence[RemoteRegion]) -> Conn:
        return self._peers.connect(peer_name, blob)

    def disconnect(self, peer: Conn) -> None:
        self._peers.disconnect(peer)

    def peer_alive(self, peer: Conn) -> bool | None:
        return self._peers.peer_alive(peer)

    # -- data path ------------------------------------------------------------
    def post(self, req: PostRequest) -> Xfer:
        return self._data.post(req)

    def poll(self, handle: Xfer) -> PollResult:
        return self._data.poll(handle)

    def cancel(self, handle: Xfer) -> bool:
        return self._data.cancel(handle)

    def quiesced(self, handle: Xfer) -> bool:
        return self._data.quiesced(handle)

    # -- notifications --------------------------------------------------------
    def notifications(self) -> list[tuple[str, bytes]]:
        return self._rx.drain()

    def send_notification(self, peer: Conn, payload: bytes) -> None:
        if peer.gone or not peer.alive():
            raise NotificationError(f"peer {peer.name!r} is gone")
        self._peers.on_notifier(self._peers.send, peer, payload).result(timeout=5)

    # -- lifetime -------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._data.close()
        self._peers.close()
        self._rx.close()
        for path, rm in ((self._ipc_path, os.unlink), (self._own_dir, os.rmdir)):
            try:
                if path:
                    rm(path)
            except OSError:
                pass

    def describe(self) -> dict[str, Any]:
        return {"cross_process": self.cma_ok, "cross_process_reason": self.cma_reason,
                "threads": self.threads, "copy_cpus": None if self._data.copy_cpus is None else list(self._data.copy_cpus),
                "notify_addr": self.notify_addr,
                "notification_refusals": self._rx.refusals,
                "ptrace_scope": self.ptrace.scope, "ptrace_grant": self.ptrace.mode,
                "ptrace_grants": self.ptrace.grants}
