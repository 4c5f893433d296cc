"""The ``ucx`` backend: one-sided RMA through UCX's ucp API (bound in ``ucp``).

This class is a facade over four parts, each with one job:

* :mod:`.worker` — the UCP context, its workers ("lanes") and their progress threads;
* :mod:`.memory` — local registrations (memory handles, packed remote keys);
* :mod:`.peers` — connections: the exported blob, endpoints and remote keys per lane, peer
  failure (UCX endpoint errors, the same-host pid check), asynchronous endpoint close;
* :mod:`.datapath` — posting and completion: lane split, puts/gets, flushes,
  notification, poll/cancel/quiesced, standalone notifications.

Locks: one state lock (``UcpWorker.lock``) guards every table of the parts above; each lane
has its own lock, taken around every call on that lane's worker. Order: state lock, then at
most one lane lock. See docs/UCX.md.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

from kvtransport.errors import BackendOptionError
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

from . import probe
from . import ucp as U
from .memory import LocalMemory
from .options import UcxOptions, parse_options
from .peers import Conn, Peers
from .datapath import DataPath, Xfer
from .worker import UcpWorker

class UcxBackend(Backend):
    name = "ucx"
    version = "1"
    capabilities = Capabilities(
        read=True,
        write=True,
        notify=True,
        # cuda / rocm where the loaded UCX has the device transports; refused with the
        # reason at register where it has not (memory.LocalMemory.memory_type)
        memory_kinds=frozenset({"cpu", "cuda", "rocm"}),
        scopes=frozenset({Scope.SAME_PROCESS, Scope.SAME_HOST, Scope.CROSS_HOST}),
        detects_peer_failure=True,
        # a peer's memory type travels in its packed rkey and is the peer's UCX's to serve:
        # a CPU-only agent may pair with a GPU engine
        remote_memory_kinds=frozenset({"cpu", "cuda", "rocm"}),
    )
    #: tcp: cross-host path; shm: sysv/posix + cma without UCX peer-error handling (pid
    #: liveness instead); cma+tcp: cma data with UCX peer-error handling over tcp.
    #: The last two run the suite over the ctypes posting fallback (the others post through
    #: the compiled library where it was built: describe()["post_path"]).
    conformance_options = ({"tls": "tcp"}, {"tls": "shm"}, {"tls": "cma+tcp"},
                           {"tls": "shm", "post": "ctypes"}, {"tls": "tcp", "post": "ctypes"})

    @classmethod
    def probe(cls) -> Availability:
        return probe.probe()

    def __init__(self, agent_name: str, options: Mapping[str, Any]) -> None:
        super().__init__(agent_name, options)
        self.opts: UcxOptions = parse_options(options)
        self._inbox: deque[tuple[str, bytes]] = deque()
        self._closed = False
        try:
            # Progress threads start inside UcpWorker(...): _after_progress ignores rounds
            # until the parts below exist.
            self._w = UcpWorker(
                agent_name,
                self.opts.ucx_settings(),
                optional_config=self.opts.optional_ucx_settings(),
                lanes=self.opts.lanes,
                on_notify=lambda sender, payload: self._inbox.append((sender, payload)),
                after_progress=self._after_progress,
                busy_poll=self.opts.progress == "busy",
                idle_timeout_s=min(0.25, self.opts.liveness_interval_s),
            )
        except U.UcxConfigError as exc:
            raise BackendOptionError(
                f"ucx backend: {exc}; see `ucx_info -c` for the settings this UCX accepts"
            ) from None
        self._memory = LocalMemory(self._w)
        self._peers = Peers(self._w, self.opts, fail_transfers=self._fail_transfers)
        self._data = DataPath(self._w, self.opts, self._peers, self._memory, self.signal_progress, agent_name)

    # -- memory ---------------------------------------------------------------------------
    def register(self, region: LocalRegion) -> bytes:
        return self._memory.register(region)

    def deregister(self, region: LocalRegion) -> None:
        self._memory.deregister(region)

    # -- peers ----------------------------------------------------------------------------
    def export(self) -> bytes:
        return self._peers.export()

    def connect(self, peer_name: str, blob: bytes, regions: Sequence[RemoteRegion]) -> Conn:
        return self._peers.connect(peer_name, blob, regions)

    def peer_alive(self, peer: Conn) -> bool | None:
        return self._peers.peer_alive(peer)

    def disconnect(self, peer: Conn) -> None:
        with self._w.lock:
            self._peers.drop(peer, f"peer {peer.name!r} disconnected")

    def _fail_transfers(self, conn: Conn, reason: str) -> None:
        self._data.fail_transfers(conn, reason)  # a dropped connection's transfers (lock held)

    # -- data path ------------------------------------------------------------------------
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

    def _after_progress(self) -> None:
        """One progress-thread round (state lock held): peers first (endpoint errors, forced
        closes, liveness), then transfers, then endpoint closes that completed."""
        data = getattr(self, "_data", None)
        if data is None:
            return
        now = time.monotonic()
        self._peers.after_progress(now)
        data.after_progress(now)
        self._peers.reap_closing()

    # -- notifications --------------------------------------------------------------------
    def notifications(self) -> list[tuple[str, bytes]]:
        out = []
        while self._inbox:
            out.append(self._inbox.popleft())
        return out

    def send_notification(self, peer: Conn, payload: bytes) -> None:
        self._data.send_notification(peer, payload)

    # -- lifetime -------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        with self._w.lock:
            self._closed = self._data.closed = True
            self._peers.drop_all(f"agent {self.agent_name!r} closed")
        deadline = time.monotonic() + 2.0
        while self._peers.closing and time.monotonic() < deadline:
            self._w.progress_once()
            time.sleep(0.001)
        with self._w.lock:
            self._peers.release_closing()  # peers that never answered: release locally
            self._memory.unmap_all()
        self._w.close()
        with self._w.lock:
            self._data.forget_all()

    def describe(self) -> dict[str, Any]:
        lib = U.lib()
        return {
            "ucx_version": lib.version(),
            "ucx_library": lib.path,
            "prefer_system_ucx": lib.prefer_system,
            "tls": self.opts.tls or "default",
            "err_mode": self.opts.err_mode,
            "progress": self.opts.progress,
            "post_path": self.opts.post,
            "lanes": len(self._w.lanes),
            "bytes_per_lane": list(self._data.lane_bytes),
            "peers": sorted(self._peers.by_name),
            "progress_rounds": self._w.rounds,
            "idle_wakeups": self._w.idle_wakeups,
        }
