"""The ``mooncake`` backend: kvtransport over Mooncake's Transfer Engine.

One Mooncake ``TransferEngine`` per agent, initialised with the peer-to-peer hand-shake
(``P2PHANDSHAKE``: no metadata server; each engine serves its segment description on its
own RPC port and is named by the session id ``host:port``), TCP or RDMA. The parts:

* :mod:`.probe` — can it run here, and why not;
* :mod:`.options` — backend options, declared (``kvtransport.options_schema``);
* :mod:`.wire` — the agent blob (session id, scratch buffer), in the core's envelope;
* :mod:`.peers` — connections: reachability, the table by name, peer liveness;
* :mod:`.datapath` — chunked batch READ/WRITE, completion, quiescence;
* :mod:`.abi` — the non-blocking batch status calls the Python binding lacks;
* :mod:`.device` — whether the loaded engine registers GPU memory (its CUDA build), and where;
* :mod:`.notify` — kvtransport notifications carried by Mooncake's own notifications.

The core serialises every SPI call (agent lock); the notifier thread is the only other
thread touching this object, through ``NotifyJob.result`` and ``signal_progress``.
See docs/MOONCAKE.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from kvtransport.errors import BackendUnavailableError, InvalidSegmentsError, NotificationError
from kvtransport.notify import new_notification_key
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

from . import device as D
from . import notify as N
from . import probe as P
from . import wire
from .datapath import DataPath, Xfer
from .options import MooncakeOptions, parse_options
from .peers import Conn, Peers


class MooncakeBackend(Backend):
    name = "mooncake"
    version = "1"
    capabilities = Capabilities(
        read=True,
        write=True,
        notify=True,
        # cuda with Mooncake's CUDA build; refused with the fix at register on another
        # build (.device)
        memory_kinds=frozenset({"cpu", "cuda"}),
        scopes=frozenset({Scope.SAME_PROCESS, Scope.SAME_HOST, Scope.CROSS_HOST}),
        # Same-host peers are watched by pid; a cross-host peer that vanishes without a TCP
        # reset is only caught by Mooncake's status timeout or the core's deadline.
        detects_peer_failure=False,
        # A peer's device memory is its own engine's to move (GPUDirect RDMA on its NIC, or
        # its TCP transport's cudaMemcpy): our engine only names the address, whatever its build.
        remote_memory_kinds=frozenset({"cpu", "cuda"}),
    )
    conformance_options = ({"protocol": "tcp"},)

    @classmethod
    def probe(cls) -> Availability:
        return P.probe()

    def __init__(self, agent_name: str, options: Mapping[str, Any]) -> None:
        super().__init__(agent_name, options)
        self.opts: MooncakeOptions = parse_options(options)
        av = P.probe()
        if not av.usable:
            raise BackendUnavailableError(self.name, av.reason, av.install_hint)
        self._me = P.load_engine_module()
        #: whether this engine registers GPU memory (its own SUPPORT_CUDA flag)
        self._cuda = D.supports_cuda(self._me)
        o = self.opts
        if o.protocol == "rdma" and not P.rdma_devices(self._me, o.device_name):
            raise BackendUnavailableError(
                self.name, "protocol='rdma' but Mooncake finds no RDMA device"
                + (f" matching device_name={o.device_name!r}" if o.device_name else "") + " on this host",
                "use protocol='tcp', or install the NIC's verbs provider (rdma-core)")
        self._engine = self._me.TransferEngine()
        rc = P.initialize(self._engine, o.hostname, o.protocol, o.device_name)
        if rc != 0:
            raise BackendUnavailableError(
                self.name, f"Mooncake Transfer Engine did not initialise (hostname={o.hostname!r}, "
                f"protocol={o.protocol!r}, device_name={o.device_name!r}): rc={rc}; see Mooncake's log",
                "protocol='rdma' needs an RDMA NIC; use protocol='tcp' otherwise")
        self.session = f"{o.hostname}:{self._engine.get_rpc_port()}"
        #: 8 registered bytes: the target of the 1-byte transfers that carry notifications
        #: and of the reachability check in ``connect``.
        self._scratch = np.zeros(64, np.uint8)
        self._scratch_addr = int(self._scratch.ctypes.data)
        if self._engine.register_memory(self._scratch_addr, self._scratch.nbytes) != 0:
            raise BackendUnavailableError(self.name, "Mooncake refused to register an 8-byte buffer")
        self._notify_key = new_notification_key()
        self._inbox = N.Inbox(self._notify_key, agent_name)
        self._notifier = N.Notifier(self._engine, self._me, agent_name, self._scratch_addr, self.signal_progress)
        self._data = DataPath(self._engine, self.opts, self._notifier, agent_name)
        self._peers = Peers(self._engine, self._scratch_addr, o.protocol, self._data.drop)
        #: Mooncake registrations: base address -> (length, ids of the regions using it).
        self._mc_buffers: dict[int, tuple[int, set[int]]] = {}
        self._region_buffer: dict[int, int] = {}  # region id -> base address of its buffer
        self._closed = False

    # -- memory ---------------------------------------------------------------------------
    def register(self, region: LocalRegion) -> bytes:
        """Mooncake refuses a buffer overlapping one it has; a region lying inside an
        existing registration shares it (reference-counted), since Mooncake accepts any
        address inside a registered buffer. GPU memory only with a CUDA build of the
        engine (refused before the engine sees the address otherwise)."""
        where = D.location(region.kind, region.device, self._cuda)
        if where is None:
            from kvtransport.registry import backends_for_memory_kind  # error path only: probes every backend

            others = [b for b in backends_for_memory_kind(region.kind) if b.split(" ")[0] != self.name]
            raise D.MooncakeMemoryKindUnavailable(region.kind, self._cuda, D.installed_distribution(), others)
        end = region.addr + region.length
        for base, (length, users) in self._mc_buffers.items():
            if base <= region.addr and end <= base + length:
                users.add(region.id)
                self._region_buffer[region.id] = base
                return b""
        rc = self._engine.register_memory(region.addr, region.length, where)
        if rc != 0:
            raise InvalidSegmentsError(
                f"Mooncake refused to register {region.length} bytes at {region.addr:#x} (rc={rc}): "
                "it rejects a buffer that partly overlaps or contains one already registered on this "
                "agent; register the enclosing buffer first, or deregister the overlapping one")
        self._mc_buffers[region.addr] = (region.length, {region.id})
        self._region_buffer[region.id] = region.addr
        return b""  # peers address our memory by absolute address (RemoteRegion.addr)

    def deregister(self, region: LocalRegion) -> None:
        base = self._region_buffer.pop(region.id)
        users = self._mc_buffers[base][1]
        users.discard(region.id)
        if not users:
            del self._mc_buffers[base]
            self._engine.unregister_memory(base)

    # -- peers ----------------------------------------------------------------------------
    def export(self) -> bytes:
        return wire.CODEC.encode(wire.CODEC.seal(session=self.session, protocol=self.opts.protocol,
                                                 scratch_addr=self._scratch_addr, notify_key=self._notify_key))

    def connect(self, peer_name: str, blob: bytes, regions: Sequence[RemoteRegion]) -> Conn:
        return self._peers.connect(peer_name, blob)

    def disconnect(self, peer: Conn) -> None:
        self._peers.disconnect(peer)

    def peer_alive(self, peer: Conn) -> bool | None:
        return self._peers.peer_alive(peer)

    # -- data path ------------------------------------------------------------------------
    def post(self, req: PostRequest) -> Xfer:
        return self._data.post(req, req.peer)

    def poll(self, handle: Xfer) -> PollResult:
        return self._data.poll(handle)

    def cancel(self, handle: Xfer) -> bool:
        return self._data.cancel(handle)

    def quiesced(self, handle: Xfer) -> bool:
        return self._data.quiesced(handle)

    # -- notifications --------------------------------------------------------------------
    def notifications(self) -> list[tuple[str, bytes]]:
        return self._inbox.drain(self._engine)

    def send_notification(self, peer: Conn, payload: bytes) -> None:
        """Queued behind earlier notifications; raises if the peer is known gone."""
        if peer.gone or peer.alive() is False:
            raise NotificationError(f"peer {peer.name!r} is gone: {peer.gone or 'its process exited'}")
        self._notifier.submit(N.NotifyJob(peer.session, peer.exp.scratch_addr,
                                          N.seal(peer.auth, self.agent_name, bytes(payload))))

    # -- lifetime -------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._peers.close("agent closed")
        if self._notifier.close():
            # Destroying the engine stops its threads and closes its ports. Not while the
            # notifier may still be inside a call on it.
            self._engine.unregister_memory(self._scratch_addr)
            self._engine = None
            self._data = None

    def describe(self) -> dict[str, Any]:
        return {"transport": f"mooncake-{self.opts.protocol}", "session": self.session,
                "hostname": self.opts.hostname, "device_name": self.opts.device_name,
                "cuda_build": self._cuda,
                "peers": sorted(self._peers.by_name), "notification_refusals": self._inbox.refusals}
