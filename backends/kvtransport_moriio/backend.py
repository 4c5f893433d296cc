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
notifications               ``kvtransport.notify`` (sealed ZMQ PUSH/PULL)
==========================  ====================================================

The ``mori.io`` module is taken through a seam (the ``mori_module`` option, or
:func:`using_mori_module` for code that cannot pass options), so tests run this glue
against a recording *fake* of the mori surface. The fake proves only the glue; the
hardware tests and ``bench/moriio_validate.py`` prove the backend.

Layout: the backend skeleton's ``options.py`` (the options, declared), ``probe.py``
(requirements), ``wire.py`` (the exported blob), ``peers.py`` (connections) and
``datapath.py`` (posting and status), beside them ``loader.py`` (where mori.io comes from),
``grouping.py`` (batches per region pair) and ``status.py`` (mori statuses to poll
results); this module is the facade (lifetime, memory, notifications).

Why not mori's own notifications: with ``enable_notification`` the *target* engine can
ask ``pop_inbound_transfer_status(remote_key, transfer_uid)`` whether an inbound transfer
with a given id has landed: a poll for an id the target must already know, with no
payload, for the RDMA backend only. kvtransport notifications carry an arbitrary payload
(request id, block list) the receiver does not know in advance, for READ as well as
WRITE. So each agent runs the core's authenticated notification receiver on TCP (its
address and key travel in the agent blob) and the initiator sends to it *after* mori
reported the transfer complete, which orders the message after the data. A message not
sealed with the receiver's key is refused and counted (``notification_refusals``).
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import zmq

from kvtransport.errors import BackendOptionError, BackendUnavailableError, NotificationError
from kvtransport.notify import NotificationReceiver, new_notification_key
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

from . import probe as _probe
from .datapath import DataPath, Xfer
from .loader import MORI_SURFACE, XGMI_ONLY_ENV, current_override, import_mori_io, mori_version, using_mori_module
from .options import RDMA_KNOBS, MoriioOptions, parse_options
from .peers import Conn, Peers
from .wire import WIRE_VERSION

__all__ = ["MoriioBackend", "using_mori_module", "MORI_SURFACE", "XGMI_ONLY_ENV"]


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
        remote_memory_kinds=frozenset({"cpu", "cuda", "rocm"}),
    )

    # ------------------------------------------------------------------ probing
    @classmethod
    def probe(cls) -> Availability:
        if current_override() is not None:
            return Availability(True)
        # The probe has no options; a node without a NIC that only wants XGMI says so here.
        return cls._probe_real(need_rdma=os.environ.get(XGMI_ONLY_ENV, "") != "1")

    @classmethod
    def _probe_real(cls, need_rdma: bool) -> Availability:
        av = _probe.check_requirements(need_rdma=need_rdma)
        if not av.usable:
            return av
        module, reason = import_mori_io()
        if module is None:
            return Availability(False, reason, _probe.INSTALL_HINT)
        return av

    # ------------------------------------------------------------------ lifetime
    def __init__(self, agent_name: str, options: Mapping[str, Any]) -> None:
        super().__init__(agent_name, options)
        self._opts: MoriioOptions = parse_options(options)
        io = self._opts.mori_module or current_override()
        if io is None:
            av = self._probe_real(need_rdma=self._opts.transport == "rdma")
            if not av.usable:
                raise BackendUnavailableError(self.name, av.reason, av.install_hint)
            io, _ = import_mori_io()
        self._io = io
        self._is_fake = bool(getattr(io, "IS_FAKE", False))
        self._local: dict[int, Any] = {}  # region id -> MemoryDesc
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
        zctx = zmq.Context.instance()
        notify_key = new_notification_key()
        try:
            self._inbox = NotificationReceiver(zctx, f"tcp://{self._opts.host}", notify_key, name=agent_name)
        except zmq.ZMQError as exc:
            raise BackendOptionError(
                f"moriio cannot bind its notification socket on host {self._opts.host!r}: {exc}; "
                "pass host=<an address of this node>"
            ) from exc
        self._peers = Peers(io, self._engine, self._engine_key, self._desc, self._opts.transport, zctx,
                            self._inbox.address, notify_key, agent_name)
        self._data = DataPath(self._engine, self._local, self._peers, self._stats, agent_name)

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
        self._closed = self._data.closed = True
        self._peers.close(f"agent {self.agent_name!r} closed")
        for md in self._local.values():
            with contextlib.suppress(Exception):
                self._engine.deregister_memory(md)
        self._local.clear()
        self._inbox.close()

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
        for peer in self._peers.all:
            for key in [k for k in peer.sessions if k[0] == region.id]:
                del peer.sessions[key]
        self._engine.deregister_memory(md)

    # ------------------------------------------------------------------ peers
    def export(self) -> bytes:
        return self._peers.export()

    def connect(self, peer_name: str, blob: bytes, regions: Sequence[RemoteRegion]) -> Conn:
        return self._peers.connect(peer_name, blob, regions)

    def disconnect(self, peer: Conn) -> None:
        self._peers.disconnect(peer)

    # ------------------------------------------------------------------ data path
    def post(self, req: PostRequest) -> Xfer:
        return self._data.post(req)

    def poll(self, handle: Xfer) -> PollResult:
        return self._data.poll(handle)

    def cancel(self, handle: Xfer) -> bool:
        return self._data.cancel(handle)

    def quiesced(self, handle: Xfer) -> bool:
        return self._data.quiesced(handle)

    def release(self, handle: Xfer) -> None:
        self._data.release(handle)

    # ------------------------------------------------------------------ notifications
    def notifications(self) -> list[tuple[str, bytes]]:
        msgs = self._inbox.drain()
        self._stats["notifications_received"] += len(msgs)
        return msgs

    def send_notification(self, peer: Conn, payload: bytes) -> None:
        box = self._peers.outboxes.get(peer.notify_address) if peer.current else None
        if box is None:
            raise NotificationError(f"peer {peer.name!r} is no longer connected to this moriio agent")
        box.send(payload)
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
            "mori_version": mori_version(self._io),
            "fake_mori": self._is_fake,
            "engine_key": self._engine_key,
            "host": self._opts.host,
            "port": int(self._desc.port),
            "notify_address": self._inbox.address,
            "backend_config": effective,
            "malformed_notifications": self._inbox.malformed,
            "notification_refusals": self._inbox.refusals,
            **self._stats,
        }
