"""Connections of the nixl backend: the loaded remote NIXL agents and what we know of them.

A :class:`Conn` is one connected peer: the NIXL agent its blob names, its regions' memory
kinds and devices, and its process (watched while transfers to it are pending when it runs
on this host in another process). :class:`Peers` loads a peer's NIXL metadata
(``add_remote_agent``), replaces a restarted peer, and removes a disconnected one from NIXL
only once nothing to it is in flight: removing a peer while a request to it runs does not
stop the request (see backend.py on quiescence).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Sequence
from typing import Any

from kvtransport.errors import PeerMetadataError
from kvtransport.process_identity import peer_alive
from kvtransport.spi import RemoteRegion

from .reuse import RequestCache
from .wire import CODEC, NixlBlob, region_device
from .xfer import Xfer, nixl_error

__all__ = ["Conn", "Peers", "SUFFIX"]

#: NIXL agent names are ``<kvtransport name>@kvt-<random>``.
SUFFIX = "@kvt-"


class Conn:
    """A loaded remote NIXL agent and what we know about its process."""

    def __init__(self, name: str, exp: NixlBlob, regions: Sequence[RemoteRegion]) -> None:
        self.name = name
        self.nixl_name = exp.nixl_name
        self.ident = exp.identity
        self.remote_kinds = {r.id: r.kind for r in regions}
        self.remote_devs = {r.id: region_device(name, r) for r in regions}
        self.all_cpu = all(k == "cpu" for k in self.remote_kinds.values())
        #: Check the process only for a same-host peer in another process.
        self.watch = exp.identity.pid != os.getpid() and self.ident.checkable_here()
        self.next_check = 0.0
        self.failed: str | None = None
        self.dead = False  # its process is confirmed gone
        self.gone = False  # disconnected by the core
        self.xfers: set[Xfer] = set()


class Peers:
    """The peers of one NIXL agent: loading, replacing, removing, liveness."""

    def __init__(self, nx: Any, reuse: RequestCache, liveness_interval_s: float) -> None:
        self.nx = nx
        self._reuse = reuse
        self._interval = liveness_interval_s
        self.by_name: dict[str, Conn] = {}
        self.loaded: dict[str, Conn] = {}  # NIXL agent name -> the conn that loaded it
        self.parting: list[Conn] = []  # disconnected, waiting for in-flight transfers

    def export(self, nixl_name: str, plugins: list[str]) -> bytes:
        return CODEC.encode(CODEC.seal(nixl_name=nixl_name, nixl_md=self.nx.get_agent_metadata(), plugins=plugins))

    def connect(self, peer_name: str, blob: bytes, regions: Sequence[RemoteRegion]) -> Conn:
        exp = CODEC.decode(blob, peer_name)
        if exp.nixl_name.rpartition(SUFFIX)[0] != peer_name:
            raise PeerMetadataError(f"nixl blob of peer {peer_name!r} names NIXL agent {exp.nixl_name!r}")
        old = self.by_name.get(peer_name)
        if old is not None and old.nixl_name != exp.nixl_name:
            self.disconnect(old)  # a restarted peer: its predecessor goes
        try:
            loaded = self.nx.add_remote_agent(exp.nixl_md)
        except Exception as exc:
            raise PeerMetadataError(nixl_error(exc, f"NIXL refused the metadata of peer {peer_name!r}")) from None
        loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if loaded != exp.nixl_name:
            if loaded not in self.loaded:
                self.nx.remove_remote_agent(loaded)
            raise PeerMetadataError(f"peer {peer_name!r}: its NIXL metadata is for agent {loaded!r}, "
                                    f"its blob says {exp.nixl_name!r}")
        conn = Conn(peer_name, exp, regions)
        self.loaded[exp.nixl_name] = conn
        self.by_name[peer_name] = conn
        return conn

    def disconnect(self, peer: Conn) -> None:
        peer.gone = True
        if self.by_name.get(peer.name) is peer:
            del self.by_name[peer.name]
        self.parting.append(peer)
        self.sweep()

    def sweep(self) -> None:
        """Remove disconnected peers from NIXL once nothing to them is in flight (removing a
        peer while a request to it runs does not stop the request: see backend.py)."""
        keep = []
        for conn in self.parting:
            if any(x.moving for x in conn.xfers):
                keep.append(conn)
                continue
            self._reuse.drop_conn(conn)  # kept requests first: they name the peer
            if self.loaded.get(conn.nixl_name) is conn:
                del self.loaded[conn.nixl_name]
                with contextlib.suppress(Exception):
                    self.nx.remove_remote_agent(conn.nixl_name)
        self.parting = keep

    @staticmethod
    def peer_alive(peer: Conn) -> bool | None:
        # gone = every thread of it gone (ProcessIdentity.has_exited), not only its main one
        # (``dead`` is set when the main thread exits: the data path's question)
        return peer_alive(peer.ident if peer.watch else None, lambda: False if peer.dead else None)

    def check(self, conn: Conn) -> None:
        """Same-host peers: a process that exited fails its transfers now, not at the deadline."""
        if not conn.watch or conn.dead:
            return
        now = time.monotonic()
        if now < conn.next_check:
            return
        conn.next_check = now + self._interval
        if conn.ident.is_alive() is False:
            conn.dead = True
            conn.failed = conn.failed or f"peer {conn.name!r} (pid {conn.ident.pid}) exited"

    def close(self) -> None:
        """Remove every loaded peer from NIXL and forget them all."""
        for name in list(self.loaded):
            with contextlib.suppress(Exception):
                self.nx.remove_remote_agent(name)
        self.loaded.clear()
        self.by_name.clear()
        self.parting.clear()
        self.nx = None
