"""Connections of the mooncake backend: who the peers are and whether they still run.

A :class:`Conn` is one connected peer: its session id and scratch buffer (from its blob,
``wire.py``), the key its notifications are sealed with, its process (watched while
transfers to it are pending when it runs on this host in another process), and its load
(segments in flight, jobs with work left; the data path's to change). :class:`Peers`
checks that a new peer is reachable (a 1-byte READ of its scratch buffer opens its segment
now rather than in the first post) and keeps the table by name.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from kvtransport.errors import IncompatiblePeerError
from kvtransport.process_identity import peer_alive

from . import wire
from .notify import authenticator as seal_for

__all__ = ["Conn", "Peers"]


class Conn:
    """One connected peer: its session id, scratch buffer, liveness and in-flight load."""

    def __init__(self, name: str, exp: wire.MooncakeBlob) -> None:
        self.name = name
        self.exp = exp
        self.session = exp.session
        #: Seals our notifications to this peer with its key (used on the notifier thread
        #: only after being created here).
        self.auth = seal_for(exp.notify_key)
        self.ident = exp.identity
        #: Check the peer's process while transfers are pending: same host, other process.
        self.watch = self.ident.checkable_here() and exp.identity.pid != os.getpid()
        self.next_check = 0.0
        self.gone: str = ""  # why the peer can no longer be used ("" while usable)
        self.inflight = 0  # segments submitted to Mooncake and not yet freed
        #: Jobs with chunks to submit or batches to reap, FIFO (``datapath.Xfer``).
        self.jobs: list[Any] = []

    def alive(self) -> bool | None:
        return self.ident.is_alive() if self.watch else None


class Peers:
    """The peers of one Mooncake engine, by name."""

    def __init__(self, engine: Any, scratch_addr: int, protocol: str, drop: Callable[[Conn, str], None]) -> None:
        self._engine = engine
        self._scratch_addr = scratch_addr
        self._protocol = protocol
        #: Fails the transfers of a peer that is replaced or disconnected (the data path's).
        self._drop = drop
        self.by_name: dict[str, Conn] = {}

    def connect(self, peer_name: str, blob: bytes) -> Conn:
        exp = wire.decode(peer_name, blob, self._protocol)
        # Opens the peer's segment (hand-shake) now rather than in the first post, and
        # proves the data path: a 1-byte READ of the peer's scratch buffer.
        rc = self._engine.batch_transfer_sync_read(exp.session, [self._scratch_addr], [exp.scratch_addr], [1])
        if rc != 0:
            raise IncompatiblePeerError(f"peer {peer_name!r} is not reachable over Mooncake at {exp.session} "
                                        f"({self._protocol}); rc={rc}")
        conn = Conn(peer_name, exp)
        old = self.by_name.get(peer_name)
        if old is not None:
            self._drop(old, f"connection to {peer_name!r} replaced by a new connect")
        self.by_name[peer_name] = conn
        return conn

    def disconnect(self, peer: Conn) -> None:
        self._drop(peer, f"peer {peer.name!r} disconnected")
        if self.by_name.get(peer.name) is peer:
            del self.by_name[peer.name]

    @staticmethod
    def peer_alive(peer: Conn) -> bool | None:
        # gone = every thread of it gone (ProcessIdentity.has_exited), not only its main one
        return peer_alive(peer.ident if peer.watch else None)

    def close(self, reason: str) -> None:
        """Drop every peer (their transfers fail with ``reason``) and let go of the engine
        and the data path: the backend destroys the engine by dropping the last reference."""
        for conn in list(self.by_name.values()):
            self._drop(conn, reason)
        self.by_name.clear()
        self._engine = None
        self._drop = _gone


def _gone(conn: Conn, reason: str) -> None:
    """The drop of a closed agent: it has no transfers left to fail."""
