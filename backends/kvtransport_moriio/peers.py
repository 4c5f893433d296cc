"""Connection management of the moriio backend: who the peers are and how we reach them.

A :class:`Conn` is one ``connect`` call's view of a peer (a reconnect makes a new one);
:class:`Peers` turns a peer's blob into one (checking every descriptor mori will be
handed), keeps mori's remote-engine registrations reference counted (two peer names may
share one engine), keeps one authenticated notification sender per peer receiver, and
retires connections (replaced, disconnected, restarted). Posting and status are in
``datapath.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtransport.errors import PeerMetadataError
from kvtransport.notify import KEY_BYTES, NotificationSender
from kvtransport.spi import RemoteRegion

from .wire import CODEC, MoriioBlob, decode_agent_blob

__all__ = ["Conn", "Peers"]


@dataclass(eq=False)
class Conn:
    """One ``connect`` call's view of a peer (a reconnect makes a new one)."""

    name: str
    engine_key: str
    engine_desc: Any
    remote_mds: dict[int, Any]
    notify_address: str
    sessions: dict[tuple[int, int], Any] = field(default_factory=dict)
    #: Its unfinished transfers (``datapath.Xfer``).
    inflight: set[Any] = field(default_factory=set)
    #: Set when mori reported this peer's QP dead; new posts fail until reconnect.
    dead: str | None = None
    current: bool = True

    def fail(self, reason: str) -> None:
        """Fail this connection's unfinished transfers (reported FAILED, quiesced once mori
        settles them)."""
        for t in self.inflight:
            if t.final is None and t.forced is None:
                t.forced = reason


class Peers:
    """The peers of one mori engine: connect, disconnect, retire, notification senders."""

    def __init__(self, io: Any, engine: Any, engine_key: str, desc: Any, transport: str, zctx: Any,
                 notify_address: str, notify_key: bytes, agent_name: str) -> None:
        self._io = io
        self._engine = engine
        self._engine_key = engine_key
        self._desc = desc
        self._transport = transport
        self._zctx = zctx
        self._notify_address = notify_address
        self._notify_key = notify_key
        self.agent_name = agent_name
        self.by_name: dict[str, Conn] = {}  # current connection per peer name
        self.all: set[Conn] = set()  # including replaced ones with transfers in flight
        self._remote_engines: dict[str, tuple[Any, int]] = {}  # engine key -> (desc, refcount)
        self.outboxes: dict[str, NotificationSender] = {}  # peer receiver address -> sender
        self._outbox_keys: dict[str, bytes] = {}  # peer receiver address -> its key

    def export(self) -> bytes:
        return CODEC.encode(CODEC.seal(engine_key=self._engine_key, engine_desc=bytes(self._desc.pack()),
                                       notify_address=self._notify_address, notify_key=self._notify_key,
                                       transport=self._transport))

    def connect(self, peer_name: str, blob: bytes, regions: Sequence[RemoteRegion]) -> Any:
        meta = decode_agent_blob(blob, peer_name)
        desc, remote_mds = self._unpack_peer(peer_name, meta, regions)
        old = self.by_name.get(peer_name)
        if old is not None and old.engine_key != meta.engine_key:
            # Same name, new engine: the peer restarted. Its old QPs are gone.
            self._retire(old, f"peer {peer_name!r} restarted (new mori engine {meta.engine_key!r})")
        if meta.engine_key in self._remote_engines:
            d, n = self._remote_engines[meta.engine_key]
            self._remote_engines[meta.engine_key] = (d, n + 1)
        else:
            self._engine.register_remote_engine(desc)
            self._remote_engines[meta.engine_key] = (desc, 1)
        if old is not None and old.engine_key == meta.engine_key:
            self._retire(old, None)  # replaced: transfers in flight keep running
        self._outbox_for(meta.notify_address, meta.notify_key)
        peer = Conn(peer_name, meta.engine_key, desc, remote_mds, meta.notify_address)
        self.by_name[peer_name] = peer
        self.all.add(peer)
        return peer

    def disconnect(self, peer: Any) -> None:
        self._retire(peer, f"peer {peer.name!r} disconnected")

    def _retire(self, peer: Conn, reason: str | None) -> None:
        """Stop using ``peer``'s connection; fail its transfers when ``reason`` is given."""
        if not peer.current:
            return
        peer.current = False
        if self.by_name.get(peer.name) is peer:
            del self.by_name[peer.name]
        if reason is not None:
            peer.fail(reason)
        peer.sessions.clear()
        entry = self._remote_engines.get(peer.engine_key)
        if entry is not None:
            desc, n = entry
            if n <= 1:
                del self._remote_engines[peer.engine_key]
                with contextlib.suppress(Exception):
                    self._engine.deregister_remote_engine(desc)
            else:
                self._remote_engines[peer.engine_key] = (desc, n - 1)
        if not peer.inflight:
            self.all.discard(peer)
        if not any(p.notify_address == peer.notify_address for p in self.by_name.values()):
            box = self.outboxes.pop(peer.notify_address, None)
            self._outbox_keys.pop(peer.notify_address, None)
            if box is not None:
                box.close()

    def _outbox_for(self, address: str, key: bytes) -> NotificationSender:
        """The sender to the receiver at ``address``, sealing with its key; a receiver that
        came back on the same address with a new key (restarted) gets a new sender."""
        box = self.outboxes.get(address)
        if box is not None and self._outbox_keys.get(address) != key:
            box.close()
            box = None
        if box is None:
            box = NotificationSender(self._zctx, address, key, self.agent_name, linger_ms=500)
            self.outboxes[address] = box
            self._outbox_keys[address] = key
        return box

    def _unpack_peer(self, peer_name: str, meta: MoriioBlob,
                     regions: Sequence[RemoteRegion]) -> tuple[Any, dict[int, Any]]:
        """Check and unpack everything mori will be handed for this peer."""
        io = self._io
        try:
            desc = io.EngineDesc.unpack(meta.engine_desc)
        except Exception as exc:
            raise PeerMetadataError(
                f"moriio: peer {peer_name!r} sent an engine descriptor mori cannot unpack: {exc}"
            ) from None
        if str(desc.key) != meta.engine_key:
            raise PeerMetadataError(
                f"moriio: peer {peer_name!r} engine descriptor names engine {desc.key!r}, "
                f"but its blob names {meta.engine_key!r}"
            )
        if meta.engine_key == self._engine_key:
            raise PeerMetadataError(
                f"moriio: peer {peer_name!r} has this agent's own mori engine key {meta.engine_key!r}; "
                "two agents must not share an engine_key"
            )
        remote_mds: dict[int, Any] = {}
        for r in regions:
            try:
                md = io.MemoryDesc.unpack(r.blob)
            except Exception as exc:
                raise PeerMetadataError(
                    f"moriio: region {r.id} of peer {peer_name!r} carries no valid mori MemoryDesc: {exc}"
                ) from None
            if str(md.engine_key) != meta.engine_key:
                raise PeerMetadataError(
                    f"moriio: region {r.id} of peer {peer_name!r} belongs to mori engine {md.engine_key!r}, "
                    f"not to the peer's engine {meta.engine_key!r}"
                )
            if int(md.size) < r.length:
                raise PeerMetadataError(
                    f"moriio: region {r.id} of peer {peer_name!r} claims {r.length} bytes but its mori "
                    f"descriptor covers only {md.size}"
                )
            remote_mds[r.id] = md
        if len(meta.notify_key) != KEY_BYTES:
            raise PeerMetadataError(
                f"moriio: peer {peer_name!r} exported no notification key (a kvtransport from before "
                "authenticated notifications); run the same kvtransport version on both sides"
            )
        return desc, remote_mds

    def close(self, reason: str) -> None:
        """Fail every transfer, deregister every remote engine, close every sender."""
        for peer in list(self.all):
            peer.fail(reason)
        for desc, _ in list(self._remote_engines.values()):
            with contextlib.suppress(Exception):
                self._engine.deregister_remote_engine(desc)
        self._remote_engines.clear()
        for box in self.outboxes.values():
            box.close()
        self.outboxes.clear()
        self.by_name.clear()
