"""kvtransport backend over AMD mori's IO engine (``amd-mori``, module ``mori.io``).

mori keeps the data path: an ``IOEngine`` with an RDMA backend (or XGMI inside one node)
moves bytes between registered memory descriptors. kvtransport's core keeps the lifecycle:
validation, deadlines, exactly-once completion. This module is the glue between them:

==========================  ====================================================
kvtransport SPI             mori.io
==========================  ====================================================
``register(region)``        ``IOEngine.register_memory`` -> ``MemoryDesc.pack()``
``export()``                ``IOEngine.get_engine_desc().pack()`` + notify address
``connect(peer)``           ``EngineDesc.unpack`` + ``register_remote_engine``,
                            ``MemoryDesc.unpack`` for each peer region
``post(req)``               one ``create_session(local, remote)`` per region pair
                            (cached), one ``batch_read``/``batch_write`` per pair
``poll(handle)``            ``TransferStatus`` Succeeded / Failed / InProgress
peer failure                ``IOEngine.pop_peer_failure`` -> FAILED transfers
notifications               ZeroMQ side channel (see ``notify.py``)
==========================  ====================================================

The ``mori.io`` module is taken through a seam (the ``mori_module`` option, or
:func:`using_mori_module` for code that cannot pass options), so tests run this glue
against a recording *fake* of the mori surface. The fake proves only the glue; the
hardware tests and ``bench/moriio_validate.py`` prove the backend.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import threading
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import zmq

from kvtransport.errors import BackendOptionError, BackendUnavailableError, PeerMetadataError
from kvtransport.spi import (
    Availability,
    Backend,
    Capabilities,
    LocalRegion,
    Op,
    PollResult,
    PollState,
    PostRequest,
    RemoteRegion,
    Scope,
)

from . import probe as _probe
from .grouping import group_by_region_pair
from .notify import NotifyError, NotifyInbox, NotifyOutbox
from .options import RDMA_KNOBS, MoriioOptions, parse_options
from .status import all_settled, classify
from .wire import WIRE_VERSION, AgentBlob, decode_agent_blob, encode_agent_blob

__all__ = ["MoriioBackend", "using_mori_module", "MORI_SURFACE"]

#: Every piece of the mori.io surface this backend touches, checked against the real
#: ``mori/io/engine.py`` (and the wheel's bindings) by tests/moriio/test_mori_signature_drift.py.
#: Python-level methods: (class in mori/io/engine.py, method, positional args we pass).
MORI_SURFACE: dict[str, Any] = {
    "python_methods": [
        ("IOEngine", "__init__", 2),
        ("IOEngine", "create_backend", 2),
        ("IOEngine", "get_engine_desc", 0),
        ("IOEngine", "register_memory", 4),
        ("IOEngine", "deregister_memory", 1),
        ("IOEngine", "register_remote_engine", 1),
        ("IOEngine", "deregister_remote_engine", 1),
        ("IOEngine", "create_session", 2),
        ("IOEngine", "pop_peer_failure", 0),
        ("IOEngineSession", "allocate_transfer_uid", 0),
        ("IOEngineSession", "batch_read", 4),
        ("IOEngineSession", "batch_write", 4),
    ],
    # Names imported from mori.io.
    "module_names": [
        "IOEngine",
        "IOEngineConfig",
        "BackendType",
        "RdmaBackendConfig",
        "XgmiBackendConfig",
        "PollCqMode",
        "MemoryLocationType",
        "MemoryDesc",
        "EngineDesc",
    ],
    # Attributes of pybind11 objects (defined in libmori_pybinds.so, not in engine.py).
    "binding_names": [
        "Succeeded", "Failed", "InProgress", "Init", "Message", "Code",  # TransferStatus
        "pack", "unpack", "engine_key", "size",  # MemoryDesc / EngineDesc
        "key", "host", "port",  # EngineDesc, IOEngineConfig
        "remote_engine_key", "reason", "detail", "device_name", "qp_num",  # PeerFailureEvent
        "num_streams", "num_events",  # XgmiBackendConfig
        "poll_cq_mode", "POLLING", "EVENT", "RDMA", "XGMI", "CPU", "GPU",
        *RDMA_KNOBS,
    ],
}

# Peer-failure reasons that concern a local port/device rather than the attributed peer:
# they fail what is in flight but do not condemn the connection (a port can come back).
#: Set to 1 on a node without an RDMA NIC that uses only transport="xgmi".
XGMI_ONLY_ENV = "KVT_MORIIO_XGMI_ONLY"

_LOCAL_DEVICE_REASONS = {"LOCAL_PORT_DOWN", "LOCAL_DEVICE_FATAL", "PORT_DOWN", "DEVICE_FATAL"}
_MAX_EVENTS_PER_POLL = 1024

_override: list[Any] = []
_override_lock = threading.Lock()


@contextlib.contextmanager
def using_mori_module(module: Any) -> Iterator[None]:
    """Use ``module`` instead of the real ``mori.io`` inside the block (tests, or a
    site-specific build). Nothing global leaks out of the block."""
    with _override_lock:
        _override.append(module)
    try:
        yield
    finally:
        with _override_lock:
            _override.remove(module)


def _current_override() -> Any:
    with _override_lock:
        return _override[-1] if _override else None


_import_result: tuple[Any, str] | None = None


def _import_mori_io() -> tuple[Any, str]:
    """Import the real ``mori.io`` once; return (module or None, failure reason)."""
    global _import_result
    if _import_result is None:
        try:
            _import_result = (importlib.import_module("mori.io"), "")
        except Exception as exc:  # ImportError, OSError from a missing ROCm library, ...
            _import_result = (None, f"import mori.io failed: {type(exc).__name__}: {exc}")
    return _import_result


def _mori_version(module: Any) -> str:
    fake = getattr(module, "FAKE_VERSION", None)
    if fake:
        return str(fake)
    try:
        return str(importlib.import_module("mori").__version__)
    except Exception:
        return "unknown"


# --------------------------------------------------------------------------- state
@dataclass(eq=False)
class _Peer:
    """One ``connect`` call's view of a peer (a reconnect makes a new one)."""

    name: str
    engine_key: str
    engine_desc: Any
    remote_mds: dict[int, Any]
    notify_address: str
    sessions: dict[tuple[int, int], Any] = field(default_factory=dict)
    inflight: set[_Transfer] = field(default_factory=set)
    #: Set when mori reported this peer's QP dead; new posts fail until reconnect.
    dead: str | None = None
    current: bool = True


@dataclass(eq=False)
class _Transfer:
    transfer_id: int
    op: Op
    peer: _Peer
    statuses: list[Any]
    notify: bytes | None
    nbytes: int
    forced: str | None = None  # failure decided by us (peer failure, disconnect, close)
    final: PollResult | None = None


class MoriioBackend(Backend):
    """kvtransport over ``mori.io`` (RDMA between nodes, XGMI inside one node)."""

    name: ClassVar[str] = "moriio"
    version: ClassVar[str] = str(WIRE_VERSION)
    capabilities: ClassVar[Capabilities] = Capabilities(
        read=True,
        write=True,
        notify=True,
        memory_kinds=frozenset({"cpu", "cuda", "rocm"}),
        scopes=frozenset({Scope.SAME_PROCESS, Scope.SAME_HOST, Scope.CROSS_HOST}),
        detects_peer_failure=True,
    )

    # ------------------------------------------------------------------ probing
    @classmethod
    def probe(cls) -> Availability:
        if _current_override() is not None:
            return Availability(True)
        # The probe has no options; a node without a NIC that only wants XGMI says so here.
        return cls._probe_real(need_rdma=os.environ.get(XGMI_ONLY_ENV, "") != "1")

    @classmethod
    def _probe_real(cls, need_rdma: bool) -> Availability:
        av = _probe.check_requirements(need_rdma=need_rdma)
        if not av.usable:
            return av
        module, reason = _import_mori_io()
        if module is None:
            return Availability(False, reason, _probe.INSTALL_HINT)
        return av

    # ------------------------------------------------------------------ lifetime
    def __init__(self, agent_name: str, options: Mapping[str, Any]) -> None:
        super().__init__(agent_name, options)
        self._opts: MoriioOptions = parse_options(options)
        io = self._opts.mori_module or _current_override()
        if io is None:
            av = self._probe_real(need_rdma=self._opts.transport == "rdma")
            if not av.usable:
                raise BackendUnavailableError(self.name, av.reason, av.install_hint)
            io, _ = _import_mori_io()
        self._io = io
        self._is_fake = bool(getattr(io, "IS_FAKE", False))
        self._local: dict[int, Any] = {}  # region id -> MemoryDesc
        self._peers: dict[str, _Peer] = {}  # current connection per peer name
        self._all_peers: set[_Peer] = set()  # including replaced ones with transfers in flight
        self._remote_engines: dict[str, tuple[Any, int]] = {}  # engine key -> (desc, refcount)
        self._outboxes: dict[str, NotifyOutbox] = {}
        self._stats = {
            "batches_posted": 0,
            "bytes_posted": 0,
            "sessions_created": 0,
            "notifications_sent": 0,
            "notifications_received": 0,
            "peer_failure_events": 0,
        }
        self._closed = False
        key = self._opts.engine_key or f"kvt-{agent_name}-{uuid.uuid4().hex[:12]}"
        try:
            self._engine = io.IOEngine(key, io.IOEngineConfig(host=self._opts.host, port=self._opts.port))
            self._backend_config = self._make_backend_config()
            kind = io.BackendType.RDMA if self._opts.transport == "rdma" else io.BackendType.XGMI
            self._engine.create_backend(kind, self._backend_config)
            # The descriptor is read after create_backend: with port=0 mori binds a free
            # port while creating the RDMA backend and records it in the descriptor.
            self._desc = self._engine.get_engine_desc()
        except BackendOptionError:
            raise
        except Exception as exc:
            raise BackendUnavailableError(
                self.name,
                f"mori could not start a {self._opts.transport.upper()} engine: {type(exc).__name__}: {exc}",
                _probe.INSTALL_HINT,
            ) from exc
        self._engine_key = str(self._desc.key)
        self._zctx = zmq.Context.instance()
        try:
            self._inbox = NotifyInbox(self._zctx, self._opts.host)
        except zmq.ZMQError as exc:
            raise BackendOptionError(
                f"moriio cannot bind its notification socket on host {self._opts.host!r}: {exc}; "
                "pass host=<an address of this node>"
            ) from exc

    def _make_backend_config(self) -> Any:
        io = self._io
        if self._opts.transport == "xgmi":
            cfg = io.XgmiBackendConfig()
            for fname, value in self._opts.xgmi.items():
                setattr(cfg, fname, value)
            return cfg
        cfg = io.RdmaBackendConfig()
        for fname, value in self._opts.rdma.items():
            setattr(cfg, fname, value)
        if self._opts.poll_cq_mode is not None:
            cfg.poll_cq_mode = io.PollCqMode.POLLING if self._opts.poll_cq_mode == "polling" else io.PollCqMode.EVENT
        return cfg

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for peer in list(self._all_peers):
            self._fail_inflight(peer, f"agent {self.agent_name!r} closed")
        for key, (desc, _) in list(self._remote_engines.items()):
            with contextlib.suppress(Exception):
                self._engine.deregister_remote_engine(desc)
        self._remote_engines.clear()
        for md in self._local.values():
            with contextlib.suppress(Exception):
                self._engine.deregister_memory(md)
        self._local.clear()
        for box in self._outboxes.values():
            box.close()
        self._outboxes.clear()
        self._inbox.close()
        self._peers.clear()

    # ------------------------------------------------------------------ memory
    def register(self, region: LocalRegion) -> bytes:
        io = self._io
        if region.kind == "cpu":
            loc, device = io.MemoryLocationType.CPU, -1
        elif region.kind in ("cuda", "rocm"):
            if region.device < 0:
                raise ValueError(
                    f"moriio: GPU region {region.id} has no device index; register a tensor on a "
                    "specific device (e.g. cuda:0)"
                )
            loc, device = io.MemoryLocationType.GPU, region.device
        else:
            raise ValueError(f"moriio cannot register memory of kind {region.kind!r}; use cpu, cuda or rocm")
        md = self._engine.register_memory(region.addr, region.length, device, loc)
        self._local[region.id] = md
        return bytes(md.pack())

    def deregister(self, region: LocalRegion) -> None:
        md = self._local.pop(region.id, None)
        if md is None:
            return
        for peer in self._all_peers:
            for key in [k for k in peer.sessions if k[0] == region.id]:
                del peer.sessions[key]
        self._engine.deregister_memory(md)

    # ------------------------------------------------------------------ peers
    def export(self) -> bytes:
        return encode_agent_blob(
            AgentBlob(
                version=WIRE_VERSION,
                engine_key=self._engine_key,
                engine_desc=bytes(self._desc.pack()),
                notify_address=self._inbox.address,
                transport=self._opts.transport,
            )
        )

    def connect(self, peer_name: str, blob: bytes, regions: Sequence[RemoteRegion]) -> Any:
        meta = decode_agent_blob(blob, peer_name)
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

        old = self._peers.get(peer_name)
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
        if meta.notify_address not in self._outboxes:
            self._outboxes[meta.notify_address] = NotifyOutbox(self._zctx, meta.notify_address, self.agent_name)
        peer = _Peer(peer_name, meta.engine_key, desc, remote_mds, meta.notify_address)
        self._peers[peer_name] = peer
        self._all_peers.add(peer)
        return peer

    def disconnect(self, peer: Any) -> None:
        self._retire(peer, f"peer {peer.name!r} disconnected")

    def _retire(self, peer: _Peer, reason: str | None) -> None:
        """Stop using ``peer``'s connection; fail its transfers when ``reason`` is given."""
        if not peer.current:
            return
        peer.current = False
        if self._peers.get(peer.name) is peer:
            del self._peers[peer.name]
        if reason is not None:
            self._fail_inflight(peer, reason)
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
            self._all_peers.discard(peer)
        if not any(p.notify_address == peer.notify_address for p in self._peers.values()):
            box = self._outboxes.pop(peer.notify_address, None)
            if box is not None:
                box.close()

    def _fail_inflight(self, peer: _Peer, reason: str) -> None:
        for t in peer.inflight:
            if t.final is None and t.forced is None:
                t.forced = reason

    # ------------------------------------------------------------------ data path
    def _session(self, peer: _Peer, local_id: int, remote_id: int) -> Any:
        key = (local_id, remote_id)
        sess = peer.sessions.get(key)
        if sess is None:
            sess = self._engine.create_session(self._local[local_id], peer.remote_mds[remote_id])
            if sess is None:
                raise RuntimeError(
                    f"mori could not open a session from local region {local_id} to region {remote_id} "
                    f"of peer {peer.name!r} (no mori backend can reach that memory pair)"
                )
            peer.sessions[key] = sess
            self._stats["sessions_created"] += 1
        return sess

    def post(self, req: PostRequest) -> Any:
        peer: _Peer = req.peer
        if self._closed:
            raise RuntimeError(f"agent {self.agent_name!r} is closed")
        if not peer.current:
            raise RuntimeError(f"peer {peer.name!r} is no longer connected to this moriio agent")
        self._drain_peer_failures()  # apply known failures before adding new work
        if peer.dead is not None:
            raise RuntimeError(f"peer {peer.name!r} failed earlier ({peer.dead}); reconnect with fresh metadata")
        groups = group_by_region_pair(
            req.local_region, req.remote_region, req.local_offset, req.remote_offset, req.length
        )
        handle = _Transfer(req.transfer_id, req.op, peer, [], req.notify, req.nbytes)
        for g in groups:
            try:
                sess = self._session(peer, g.local_region, g.remote_region)
                uid = sess.allocate_transfer_uid()
                fn = sess.batch_read if req.op is Op.READ else sess.batch_write
                status = fn(g.local_offsets, g.remote_offsets, g.sizes, uid)
            except Exception as exc:
                if not handle.statuses:
                    raise  # nothing in flight: fail the transfer at once
                # Earlier batches are in flight: report FAILED, quiesced once they settle.
                handle.forced = f"mori could not post batch to peer {peer.name!r}: {type(exc).__name__}: {exc}"
                break
            handle.statuses.append(status)
            self._stats["batches_posted"] += 1
            self._stats["bytes_posted"] += g.nbytes
        peer.inflight.add(handle)
        return handle

    def poll(self, handle: Any) -> PollResult:
        t: _Transfer = handle
        if t.final is not None:
            return t.final
        self._drain_peer_failures()
        if t.forced is not None:
            res = PollResult.failed(t.forced, quiesced=all_settled(t.statuses))
            if res.quiesced:
                self._finalize(t, res)
            return res
        res = classify(t.statuses, t.peer.name)
        if res.state is PollState.DONE and t.notify is not None:
            try:
                self._outboxes[t.peer.notify_address].send(t.notify)
                self._stats["notifications_sent"] += 1
            except (NotifyError, KeyError, zmq.ZMQError) as exc:
                res = PollResult.failed(f"data moved but the notification to {t.peer.name!r} failed: {exc}")
        if res.state is PollState.FAILED and not res.quiesced:
            return res
        if res.state is not PollState.PENDING:
            self._finalize(t, res)
        return res

    def _finalize(self, t: _Transfer, res: PollResult) -> None:
        """Terminal and quiesced: nothing can happen to ``t`` any more; stop tracking it."""
        t.final = res
        t.peer.inflight.discard(t)
        if not t.peer.current and not t.peer.inflight:
            self._all_peers.discard(t.peer)

    def cancel(self, handle: Any) -> bool:
        # mori has no per-transfer cancel: a posted RDMA batch runs to completion or
        # error. Nothing more can land once every batch has settled.
        t: _Transfer = handle
        if t.forced is None and t.final is None:
            t.forced = "cancelled by the core"
        return all_settled(t.statuses)

    def quiesced(self, handle: Any) -> bool:
        return all_settled(handle.statuses)

    def release(self, handle: Any) -> None:
        t: _Transfer = handle
        t.peer.inflight.discard(t)
        if not t.peer.current and not t.peer.inflight:
            self._all_peers.discard(t.peer)

    # ------------------------------------------------------------------ peer failure
    def _drain_peer_failures(self) -> None:
        pop = getattr(self._engine, "pop_peer_failure", None)
        if pop is None:  # mori older than 1.2.4: only deadlines catch a dead peer
            return
        for _ in range(_MAX_EVENTS_PER_POLL):
            ev = pop()
            if ev is None:
                return
            self._stats["peer_failure_events"] += 1
            reason_name = str(getattr(ev.reason, "name", ev.reason))
            key = str(ev.remote_engine_key)
            where = f" on {ev.device_name}" if getattr(ev, "device_name", "") else ""
            text = f"mori peer failure {reason_name}{where}: {ev.detail or 'no detail'}"
            if key:
                targets = [p for p in self._all_peers if p.engine_key == key]
            else:  # device-wide event: every peer reached through this engine is affected
                targets = list(self._all_peers)
            for p in targets:
                self._fail_inflight(p, f"{text} (peer {p.name!r})")
                if key and reason_name not in _LOCAL_DEVICE_REASONS:
                    p.dead = text

    # ------------------------------------------------------------------ notifications
    def notifications(self) -> list[tuple[str, bytes]]:
        msgs = self._inbox.drain()
        self._stats["notifications_received"] += len(msgs)
        return msgs

    def send_notification(self, peer: Any, payload: bytes) -> None:
        self._outboxes[peer.notify_address].send(payload)
        self._stats["notifications_sent"] += 1

    # ------------------------------------------------------------------ introspection
    def describe(self) -> dict[str, Any]:
        cfg = self._backend_config
        fields = RDMA_KNOBS if self._opts.transport == "rdma" else {"num_streams": 0, "num_events": 0}
        effective = {k: getattr(cfg, k, None) for k in fields}
        if self._opts.transport == "rdma":
            effective["poll_cq_mode"] = str(getattr(getattr(cfg, "poll_cq_mode", None), "name", None))
        return {
            "transport": self._opts.transport,
            "mori_version": _mori_version(self._io),
            "fake_mori": self._is_fake,
            "engine_key": self._engine_key,
            "host": self._opts.host,
            "port": int(self._desc.port),
            "notify_address": self._inbox.address,
            "backend_config": effective,
            "malformed_notifications": self._inbox.malformed,
            **self._stats,
        }
