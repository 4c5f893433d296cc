"""Connections of the loopback backend: who the peers are, whether they still run, and
the one thread that talks to them.

A :class:`Conn` is one connected peer: the process its blob names (pid + start time + boot
id), watched through its open ``/proc/PID/stat`` (``ProcessWatch``) so a dead or restarted
peer fails a transfer at once and a recycled pid is never written to. :class:`Peers`
checks a peer's blob before it is used, keeps the connection table, and owns the notifier
thread: ZMQ sockets are single-threaded, so one thread owns every PUSH socket, sends the
notifications in the order their transfers completed, and asks peers to let us copy
(``attach``, answered under Yama ``ptrace_scope=1``, see ``ptrace.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import zmq

from kvtransport.blob import pack_identity, unpack_identity
from kvtransport.errors import IncompatiblePeerError, PeerMetadataError
from kvtransport.notify import KEY_BYTES, NotificationSender
from kvtransport.process_identity import ProcessIdentity, ProcessWatch, peer_alive, process_start_time

from .ptrace import PtracerPolicy
from .wire import ATTACH, CODEC, LoopbackBlob

__all__ = ["Conn", "Peers"]


class Conn:
    """One connected peer (a reconnect makes a new one)."""

    def __init__(self, name: str, exp: LoopbackBlob, same_process: bool):
        self.name = name
        self.pid = exp.identity.pid
        self.identity = exp.identity
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


class Peers:
    """The connection table, the checks of a peer's blob, and the notifier thread."""

    def __init__(self, agent_name: str, identity: ProcessIdentity, boot_id: str, cma_ok: bool, cma_reason: str,
                 ptrace: PtracerPolicy, ctx: zmq.Context) -> None:
        self.agent_name = agent_name
        self.identity = identity
        #: Our boot id as exported and compared: where it cannot be read, one per host name.
        self.boot_id = boot_id
        self.cma_ok, self.cma_reason = cma_ok, cma_reason
        self.ptrace = ptrace
        self._ctx = ctx
        self.by_name: dict[str, Conn] = {}
        # One thread owns every PUSH socket (ZMQ sockets are single-threaded) and keeps
        # notifications in the order their transfers completed.
        self._notifier = ThreadPoolExecutor(1, thread_name_prefix=f"kvt-lb-notify-{agent_name}")

    def export(self, notify_addr: str, notify_key: bytes) -> bytes:
        exported = dataclasses.replace(self.identity, boot_id=self.boot_id)
        return CODEC.encode(CODEC.seal(exported, notify_addr=notify_addr, notify_key=notify_key))

    def connect(self, peer_name: str, blob: bytes) -> Conn:
        exp = CODEC.decode(blob, peer_name)
        if exp.identity.boot_id != self.boot_id:
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
        if exp.identity.pid_ns and mine and exp.identity.pid_ns != mine:
            # CMA names a process by pid in *our* namespace: the peer's pid would name another
            # process here (two containers' engines are often both pid 1)
            raise IncompatiblePeerError(
                f"peer {peer_name!r} runs in another pid namespace (a container without the host's "
                "pid namespace); loopback reaches a process by its pid, so run both engines in one "
                "pid namespace (docker --pid=host, or one pod with shareProcessNamespace) or use ucx")
        same = exp.identity.pid == self.identity.pid and exp.identity.start_time == self.identity.start_time
        if not same and not self.cma_ok:
            raise IncompatiblePeerError(
                f"peer {peer_name!r} is another process but {self.cma_reason}")
        peer = Conn(peer_name, exp, same)
        if not peer.alive():
            raise PeerMetadataError(f"peer {peer_name!r} (pid {exp.identity.pid}) is no longer running")
        old = self.by_name.get(peer_name)
        self.by_name[peer_name] = peer
        if old is not None:
            self.retire(old)
        if not same:
            # Ask the peer to let us copy (it names us ptracer under Yama scope 1 only).
            self.ask_grant(peer)
        return peer

    def disconnect(self, peer: Conn) -> None:
        if self.by_name.get(peer.name) is peer:
            del self.by_name[peer.name]
        self.retire(peer)

    @staticmethod
    def peer_alive(peer: Conn) -> bool | None:
        # pid + start time: a recycled pid is not the peer. Gone = every thread of it gone
        # (a thread of a peer whose main thread exited may still be copying into us).
        return True if peer.watch is None else peer_alive(peer.watch, peer.alive)

    def retire(self, peer: Conn) -> None:
        peer.gone = True

        def close_sock() -> None:
            if peer.sender is not None:
                peer.sender.close(0)
                peer.sender = None

        self._notifier.submit(close_sock)

    # -- the notifier thread ----------------------------------------------------------------
    def on_notifier(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run ``fn(*args)`` on the notifier thread, after everything queued before it."""
        return self._notifier.submit(fn, *args)

    def ask_grant(self, peer: Conn) -> None:
        """Ask ``peer`` (again) to let us copy from / into it."""
        self._notifier.submit(self._send_attach, peer)

    def send(self, peer: Conn, payload: bytes, kind: str = "n") -> None:
        """Notifier thread only."""
        if peer.sender is None:
            peer.sender = NotificationSender(self._ctx, peer.notify_addr, peer.notify_key, self.agent_name)
        peer.sender.send(payload, kind)

    def _send_attach(self, peer: Conn) -> None:
        if peer.gone:
            return
        self.send(peer, pack_identity(self.identity), ATTACH)

    def on_control(self, kind: str, sender: str, payload: bytes) -> None:
        """Receiver thread: a peer that holds our metadata asks to copy from/into us."""
        if kind != ATTACH:
            raise ValueError(f"unknown control message {kind!r}")
        self.ptrace.on_attach_request(unpack_identity(payload))

    def close(self) -> None:
        """Retire every peer, let the notifier thread finish, close the peers' stat files."""
        for p in list(self.by_name.values()):
            self.retire(p)
        self._notifier.shutdown(wait=True)
        # No thread of ours asks any more: close the peers' /proc/PID/stat descriptors now
        # (a peer replaced or disconnected earlier closes its own when it is collected).
        for p in self.by_name.values():
            if p.watch is not None:
                p.watch.close()
        self.by_name.clear()
