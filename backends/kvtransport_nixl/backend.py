"""The ``nixl`` backend: kvtransport's lifecycle over NVIDIA NIXL (``nixl-cu12``).

One NIXL agent per kvtransport agent. What maps to what:

* ``register`` -> ``register_memory`` of one ``(addr, len, dev)`` descriptor (DRAM; VRAM
  only where NIXL's plugins report it and a GPU exists — written, not verified here);
* ``export`` -> NIXL's agent metadata (``get_agent_metadata``: connection info and every
  registered region) inside a strict msgspec struct with our process identity;
  ``connect`` -> ``add_remote_agent``;
* ``post`` -> two descriptor lists built from ``(n, 3)`` numpy arrays of (address,
  length, device) — NIXL copies them in C++, no Python loop per segment — then
  ``initialize_xfer`` (NIXL validates and prepares them) and ``transfer``. A kvtransport
  ``notify`` becomes NIXL's ``notif_msg``, which NIXL delivers to the peer after the
  transfer completed; standalone messages use ``send_notif``;
* ``poll`` -> ``check_xfer_state``; ``notifications`` -> ``get_new_notifs``;
* a transfer prepared once (``Agent.prepare``) and posted again re-posts its finished
  NIXL request instead of creating one (``_reuse``): NIXL's cheapest path.

Every message we send starts with one marker byte, so an empty kvtransport payload still
travels (NIXL drops an empty ``notif_msg``) and messages from foreign NIXL agents are told
apart. NIXL agent names are ``<kvtransport name>@kvt-<random>``: a restarted peer of the
same name is a different NIXL agent, and a notification's sender name maps back by
cutting the suffix.

Quiescence — measured with nixl-cu12 1.5.1, UCX plugin (docs/NIXL.md): NIXL cannot abort
an in-flight transfer. ``release_xfer_handle`` on a pending READ from a stopped peer returned
at once and the bytes landed when the peer resumed (on another request it blocked for
seconds); ``remove_remote_agent`` made the request unqueryable and the bytes still landed. So a cancelled transfer is
reported ``quiesced=False`` until NIXL itself says the request ended (DONE or an error),
its handle is never released while pending, and a peer is only removed from NIXL once no
transfer to it is in flight.
"""

from __future__ import annotations

import contextlib
import dataclasses
import secrets
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import numpy as np

from kvtransport.errors import BackendOptionError, KVTransportError, PeerMetadataError
from kvtransport.process_identity import ProcessIdentity
from kvtransport.spi import (
    Availability,
    Backend,
    Capabilities,
    LocalRegion,
    Op,
    PollResult,
    PostRequest,
    RemoteRegion,
    Scope,
)

from . import _probe
from ._options import NixlOptions, parse_options
from ._peers import DEC, ENC, Conn, Export, region_blob, ucx_env
from ._reuse import RequestCache
from ._xfer import DONE_INLINE, Poster, Stage, Xfer, apply_state, nixl_error, refresh, transfer

_MARK = b"K"  # first byte of every notification we send
_DONE = PollResult.done()
_SUFFIX = "@kvt-"
_KINDS = {"cpu": "DRAM", "cuda": "VRAM"}
#: Plugins whose init parameter ``num_threads`` is NIXL's thread count (as nixl_agent does).
_THREADED = ("UCX", "OBJ", "LIBFABRIC")
#: NIXL's storage plugins move memory to files, blocks or object stores, not between agents.
_STORAGE = frozenset({"POSIX", "GDS", "GDS_MT", "OBJ", "AZURE_BLOB", "GUSLI", "INFINIA", "HF3FS"})
#: Agents closed with transfers still in flight: kept alive (never destroyed under a copy).
_GRAVEYARD: list[Any] = []



def local_memory_kinds(plugin_mem_types: list[set[str]], has_gpu: bool, device_memory: str) -> frozenset[str]:
    """The memory this agent registers: device memory (VRAM) only where every selected
    plugin moves it, this host has a GPU and the ``device_memory`` option does not say
    ``none`` (which also keeps UCX's cuda transports out of the list, so NIXL could not
    move it: the core refuses it at ``register`` instead of NIXL failing later)."""
    vram = all("VRAM_SEG" in m for m in plugin_mem_types) and has_gpu and device_memory != "none"
    return frozenset({"cpu", "cuda"}) if vram else frozenset({"cpu"})

class NixlBackend(Backend):
    name = "nixl"
    version = "1"
    capabilities = Capabilities(
        read=True,
        write=True,
        notify=True,
        # What NIXL can move on a suitable host ("cuda" = NIXL's VRAM_SEG, with the device
        # index in every descriptor); an agent narrows this to what its plugins and this
        # host offer (``__init__``), so the core refuses cuda here before NIXL sees it.
        memory_kinds=frozenset({"cpu", "cuda"}),
        scopes=frozenset({Scope.SAME_PROCESS, Scope.SAME_HOST, Scope.CROSS_HOST}),
        detects_peer_failure=True,
        # A peer's VRAM is registered with the peer's NIXL and served by its plugin, so
        # this stays {"cpu", "cuda"} when ``__init__`` narrows our own kinds to "cpu".
        remote_memory_kinds=frozenset({"cpu", "cuda"}),
    )
    #: NIXL's UCX defaults (cma data + tcp, peer error handling); tcp only; shared memory
    #: without UCX peer-failure reports (dead peers found by pid liveness).
    conformance_options = ({}, {"tls": "tcp"}, {"tls": "shm"})

    @classmethod
    def probe(cls) -> Availability:
        try:
            return _probe.probe()
        except Exception as exc:  # probe must not raise
            return Availability(False, f"NIXL probe failed: {type(exc).__name__}: {exc}", _probe.INSTALL_HINT)

    def __init__(self, agent_name: str, options: Mapping[str, Any]) -> None:
        super().__init__(agent_name, options)
        self.opts: NixlOptions = parse_options(options)
        m = _probe.nixl()
        info = _probe.plugin_info()
        params = {p: self._plugin_params(info, p) for p in self.opts.backends}
        self.nixl_name = f"{agent_name}{_SUFFIX}{secrets.token_hex(4)}"
        cfg = m.nixl_agent_config(enable_prog_thread=self.opts.progress_thread, backends=[],
                                  num_threads=self.opts.num_threads,
                                  sync_mode=m.nixl_thread_sync_t.NIXL_THREAD_SYNC_RW)
        self._nx = m.nixl_agent(self.nixl_name, cfg)
        for plugin in self.opts.backends:
            try:
                with ucx_env(self.opts.ucx_env if plugin == "UCX" else {}):
                    self._nx.create_backend(plugin, params[plugin])
            except Exception as exc:
                env = f" with UCX settings {self.opts.ucx_env}" if plugin == "UCX" and self.opts.ucx_env else ""
                raise BackendOptionError(
                    f"nixl backend: plugin {plugin} failed to start{env}: {type(exc).__name__}: {exc}; "
                    f"its parameters were {params[plugin]}") from None
        mems = [set(self._nx.get_backend_mem_types(p)) for p in self.opts.backends]
        kinds = local_memory_kinds(mems, _probe.has_gpu(), self.opts.device_memory)
        if kinds != self.capabilities.memory_kinds:
            self.capabilities = dataclasses.replace(self.capabilities, memory_kinds=kinds)
        self._ident = ProcessIdentity.current()
        self._regs: dict[int, Any] = {}
        self._kinds: dict[int, tuple[str, int]] = {}
        self._by_name: dict[str, Conn] = {}
        self._loaded: dict[str, Conn] = {}  # NIXL agent name -> the conn that loaded it
        self._parting: list[Conn] = []  # disconnected, waiting for in-flight transfers
        self._poster: Poster | None = None
        self._reuse = RequestCache()
        self._stuck: set[Xfer] = set()  # released by the core while NIXL still runs them
        self._xfer_lock = threading.Lock()  # every Xfer's stage (short sections, never nested)
        #: every request not yet released (close); a plain set: a WeakSet's add costs a weak
        #: reference and its callback per post
        self._live: set[Xfer] = set()
        self._foreign = 0
        self._closed = False

    def _plugin_params(self, info: _probe.PluginInfo, plugin: str) -> dict[str, str]:
        if plugin not in info.plugins:
            raise BackendOptionError(f"nixl backend: NIXL has no plugin {plugin!r}; installed plugins: "
                                     f"{info.plugins}")
        if plugin in _STORAGE:
            raise BackendOptionError(f"nixl backend: {plugin!r} is a NIXL storage plugin (memory to files "
                                     "or objects), not a transport between agents; use 'UCX' or 'LIBFABRIC'")
        desc = info.describe(plugin)
        if desc is None:
            raise BackendOptionError(f"nixl backend: NIXL cannot load plugin {plugin!r} here (a missing "
                                     "library or device); usable plugins include 'UCX'")
        known, mems = desc
        if "DRAM_SEG" not in mems:
            raise BackendOptionError(f"nixl backend: plugin {plugin!r} does not move CPU memory between "
                                     f"agents (it handles {mems})")
        given = self.opts.params_for(plugin)
        bad = sorted(set(given) - set(known))
        if bad:
            raise BackendOptionError(f"nixl backend: plugin {plugin!r} has no parameter(s) {bad}; its "
                                     f"parameters are {sorted(known)}")
        if self.opts.num_threads and plugin in _THREADED:
            given.setdefault("num_threads", str(self.opts.num_threads))
        return given

    # -- memory ---------------------------------------------------------------------------
    def register(self, region: LocalRegion) -> bytes:
        kind = _KINDS.get(region.kind)
        if kind is None or region.kind not in self.capabilities.memory_kinds:
            raise KVTransportError(f"nixl backend cannot register {region.kind!r} memory here; it accepts "
                                   f"{sorted(self.capabilities.memory_kinds)}")
        dev = max(region.device, 0) if kind == "VRAM" else 0
        descs = self._nx.get_reg_descs(np.array([[region.addr, region.length, dev]], np.uint64), kind)
        try:
            self._nx.register_memory(descs)
        except Exception as exc:
            raise KVTransportError(nixl_error(exc, f"NIXL refused to register region {region.id}")) from None
        self._regs[region.id] = descs
        self._kinds[region.id] = (kind, dev)
        # NIXL's agent metadata (export) carries every region's keys; the blob carries the
        # device index of device memory, for the peer's descriptors
        return region_blob(kind, dev)

    def deregister(self, region: LocalRegion) -> None:
        descs = self._regs.pop(region.id, None)
        self._kinds.pop(region.id, None)
        if descs is not None:
            self._nx.deregister_memory(descs)

    # -- peers ----------------------------------------------------------------------------
    def export(self) -> bytes:
        i = self._ident
        return ENC.encode(Export(1, self.nixl_name, self._nx.get_agent_metadata(), list(self.opts.backends),
                                   i.pid, i.start_time, i.boot_id, i.pid_ns))

    def connect(self, peer_name: str, blob: bytes, regions: Sequence[RemoteRegion]) -> Conn:
        try:
            exp = DEC.decode(blob)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise PeerMetadataError(f"nixl blob of peer {peer_name!r} is malformed: {exc}") from None
        if exp.v != 1:
            raise PeerMetadataError(f"nixl blob of peer {peer_name!r} has version {exp.v}, expected 1")
        if exp.nixl_name.rpartition(_SUFFIX)[0] != peer_name:
            raise PeerMetadataError(f"nixl blob of peer {peer_name!r} names NIXL agent {exp.nixl_name!r}")
        old = self._by_name.get(peer_name)
        if old is not None and old.nixl_name != exp.nixl_name:
            self.disconnect(old)  # a restarted peer: its predecessor goes
        try:
            loaded = self._nx.add_remote_agent(exp.nixl_md)
        except Exception as exc:
            raise PeerMetadataError(nixl_error(exc, f"NIXL refused the metadata of peer {peer_name!r}")) from None
        loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if loaded != exp.nixl_name:
            if loaded not in self._loaded:
                self._nx.remove_remote_agent(loaded)
            raise PeerMetadataError(f"peer {peer_name!r}: its NIXL metadata is for agent {loaded!r}, "
                                    f"its blob says {exp.nixl_name!r}")
        conn = Conn(peer_name, exp, regions)
        self._loaded[exp.nixl_name] = conn
        self._by_name[peer_name] = conn
        return conn

    def disconnect(self, peer: Conn) -> None:
        peer.gone = True
        if self._by_name.get(peer.name) is peer:
            del self._by_name[peer.name]
        self._parting.append(peer)
        self._sweep()

    def _sweep(self) -> None:
        """Remove disconnected peers from NIXL once nothing to them is in flight (removing a
        peer while a request to it runs does not stop the request: see the module doc)."""
        keep = []
        for conn in self._parting:
            if any(x.moving for x in conn.xfers):
                keep.append(conn)
                continue
            self._reuse.drop_conn(conn)  # kept requests first: they name the peer
            if self._loaded.get(conn.nixl_name) is conn:
                del self._loaded[conn.nixl_name]
                with contextlib.suppress(Exception):
                    self._nx.remove_remote_agent(conn.nixl_name)
        self._parting = keep

    def peer_alive(self, peer: Conn) -> bool | None:
        # gone = every thread of it gone (ProcessIdentity.has_exited), not only its main one
        # (``dead`` is set when the main thread exits: the data path's question)
        exited = peer.ident.has_exited() if peer.watch else None
        if exited is not None:
            return not exited
        return False if peer.dead else None

    def _check_peer(self, conn: Conn) -> None:
        """Same-host peers: a process that exited fails its transfers now, not at the deadline."""
        if not conn.watch or conn.dead:
            return
        now = time.monotonic()
        if now < conn.next_check:
            return
        conn.next_check = now + self.opts.liveness_interval_s
        if conn.ident.is_alive() is False:
            conn.dead = True
            conn.failed = conn.failed or f"peer {conn.name!r} (pid {conn.ident.pid}) exited"

    # -- data path ------------------------------------------------------------------------
    def _descs(self, addr: np.ndarray, length: np.ndarray, kind: str, dev: int) -> Any:
        d = np.empty((addr.size, 3), np.uint64)
        d[:, 0], d[:, 1], d[:, 2] = addr, length, dev
        return self._nx.get_xfer_descs(d, kind)

    def _local_kind(self, regions: np.ndarray) -> tuple[str, int]:
        first = self._kinds[int(regions[0])]
        if len(self._kinds) > 1 and any(self._kinds[int(r)] != first for r in np.unique(regions)):
            raise KVTransportError("a NIXL transfer moves one memory kind and device per side; "
                                   "split this transfer by region kind")
        return first

    def _remote_kind(self, conn: Conn, regions: np.ndarray) -> tuple[str, int]:
        """NIXL memory type and device index of the peer's side (one of each per transfer)."""
        if conn.all_cpu:
            return "DRAM", 0
        used = np.unique(regions)
        kinds = {(conn.remote_kinds.get(int(r), "cpu"), conn.remote_devs.get(int(r), 0)) for r in used}
        if len(kinds) != 1 or next(iter(kinds))[0] not in _KINDS:
            raise KVTransportError(f"remote segments span memory kinds / devices {sorted(kinds)}; NIXL moves "
                                   "one per side")
        kind, dev = kinds.pop()
        return _KINDS[kind], dev

    def _drain_stuck(self) -> None:
        for x in list(self._stuck):
            refresh(self._nx, x)
            if not x.moving:
                self._stuck.discard(x)
                self.release(x)

    def post(self, req: PostRequest) -> Xfer:
        if self._stuck:
            self._drain_stuck()
        conn: Conn = req.peer
        self._check_peer(conn)
        if conn.failed:
            raise KVTransportError(conn.failed)
        notif = b"" if req.notify is None else _MARK + req.notify
        handle, entry = self._reuse.take(req, conn)  # a finished request of this preparation
        if handle is None:
            kind, dev = self._local_kind(req.local_region)
            rkind, rdev = self._remote_kind(conn, req.remote_region)
            try:
                local = self._descs(req.local_addr, req.length, kind, dev)
                remote = self._descs(req.remote_addr, req.length, rkind, rdev)
                handle = self._nx.initialize_xfer("READ" if req.op is Op.READ else "WRITE", local, remote,
                                                  conn.nixl_name, notif)
            except Exception as exc:
                raise KVTransportError(nixl_error(exc, f"NIXL refused the transfer to {conn.name!r}")) from None
        nbytes = entry.nbytes if entry is not None else req.nbytes
        if nbytes <= self.opts.inline_post_bytes:
            return self._post_inline(req.transfer_id, conn, handle, nbytes, notif, entry)
        x = Xfer(req.transfer_id, conn, handle, nbytes, notif, entry, lock=self._xfer_lock)
        conn.xfers.add(x)
        self._live.add(x)
        if self._poster is None:
            self._poster = Poster(self._nx, self.agent_name, self.signal_progress)
        self._poster.submit(x)
        return x

    def _post_inline(self, tid: int, conn: Conn, handle: Any, nbytes: int, notif: bytes,
                     entry: Any) -> Xfer:
        """Post on the caller's thread (``post`` holds the agent's lock; no other thread
        knows of the request yet). A request NIXL finished inside ``transfer()`` (a cma
        copy) goes back to the reuse cache at once and the caller gets the shared
        ``DONE_INLINE`` handle: nothing of it to track, poll or release. Right after a
        16 MiB copy has evicted the caches every object and set touched costs
        microseconds (measured: a tracked request added ~5 us per transfer)."""
        st, reason = transfer(self._nx, handle, notif)
        if st == "DONE":
            if conn.gone or not self._reuse.give_back(entry, handle, bool(notif)):
                with contextlib.suppress(Exception):
                    handle.release()
            return DONE_INLINE
        x = Xfer(tid, conn, handle, nbytes, notif, entry, lock=self._xfer_lock)
        apply_state(x, st, reason)  # IN_FLIGHT or FAILED
        conn.xfers.add(x)
        self._live.add(x)
        return x

    def poll(self, handle: Xfer) -> PollResult:
        if handle is DONE_INLINE:
            return _DONE
        refresh(self._nx, handle)  # returns at once unless the request is IN_FLIGHT
        st = handle.stage
        if st is Stage.DONE:
            return _DONE
        if st is Stage.FAILED:
            return PollResult.failed(handle.reason, quiesced=True)
        conn = handle.conn
        self._check_peer(conn)
        if conn.failed:
            return PollResult.failed(conn.failed, quiesced=self._quiet(handle))
        # QUEUED or POSTING: the poster thread signals progress when its transfer() call
        # for it returns, so a waiter can sleep until then (IN_FLIGHT needs polling).
        return PollResult.pending(will_signal=st is not Stage.IN_FLIGHT)

    def _quiet(self, x: Xfer) -> bool:
        """No byte of ``x`` can land any more: NIXL ended the request, or it was never
        posted, or the peer process is gone and our side is not inside a copy for it."""
        with x.lock:
            if x.stage is Stage.QUEUED:
                x.stage, x.reason = Stage.FAILED, "cancelled before NIXL posted it"
            return not x.moving or (x.conn.dead and x.stage is Stage.IN_FLIGHT)

    def cancel(self, handle: Xfer) -> bool:
        """NIXL cannot abort a posted request: True only if it never started or ended."""
        refresh(self._nx, handle)
        return self.quiesced(handle)

    def quiesced(self, handle: Xfer) -> bool:
        if handle is DONE_INLINE:
            return True
        refresh(self._nx, handle)
        self._check_peer(handle.conn)
        ok = self._quiet(handle)
        if ok:
            handle.conn.xfers.discard(handle)
            if handle.moving:  # dead peer: NIXL may hold the request a while; never GC it
                self._stuck.add(handle)
            if self._parting:
                self._sweep()
        return ok

    def release(self, handle: Xfer) -> None:
        done = handle.stage is Stage.DONE  # DONE never changes: the common case takes no lock
        if done:
            h, handle.handle = handle.handle, None  # the core releases under its lock, once
            if h is None:
                return
        else:
            with handle.lock:
                if handle.handle is None:
                    return
                if handle.moving:
                    # Never release a pending NIXL request (it aborts nothing, may block for
                    # seconds) and never let Python's GC do it (nixl_xfer_handle.__del__
                    # does): keep it until NIXL ends it (peer died, _quiet said so).
                    self._stuck.add(handle)
                    return
                h, handle.handle = handle.handle, None
        handle.conn.xfers.discard(handle)
        self._live.discard(handle)
        if done and not handle.conn.gone and self._reuse.give_back(handle.entry, h, bool(handle.notif)):
            return  # kept for the next post of the same preparation
        with contextlib.suppress(Exception):
            h.release()

    # -- notifications --------------------------------------------------------------------
    def notifications(self) -> list[tuple[str, bytes]]:
        out: list[tuple[str, bytes]] = []
        for sender, msgs in self._nx.get_new_notifs().items():
            sender = sender.decode() if isinstance(sender, bytes) else str(sender)
            peer = sender.rpartition(_SUFFIX)[0]
            for msg in msgs:
                if peer and msg[:1] == _MARK:
                    out.append((peer, bytes(msg[1:])))
                else:
                    self._foreign += 1  # not from a kvtransport agent: not ours to deliver
        return out

    def send_notification(self, peer: Conn, payload: bytes) -> None:
        self._check_peer(peer)
        if peer.failed:
            raise KVTransportError(peer.failed)
        try:
            self._nx.send_notif(peer.nixl_name, _MARK + payload)
        except Exception as exc:
            raise KVTransportError(nixl_error(exc, f"notification to {peer.name!r} failed")) from None

    # -- lifetime -------------------------------------------------------------------------
    def close(self) -> None:
        """Wait up to ``close_grace_s`` for in-flight transfers to end; if some never do, the
        NIXL agent is kept alive (leaked) rather than destroyed under a running copy.

        Otherwise the NIXL agent is dropped here, not when this object is collected: NIXL
        stops its progress thread only in the agent's destructor, and that thread polls
        without pausing, so an agent closed but still referenced kept a core busy."""
        if self._closed:
            return
        self._closed = True
        if self._poster is not None:
            self._poster.stop(self.opts.close_grace_s)
        xfers = list(self._live)
        limit = time.monotonic() + self.opts.close_grace_s
        while any(x.moving for x in xfers) and time.monotonic() < limit:
            for x in xfers:
                refresh(self._nx, x)
            time.sleep(0.002)
        if any(x.moving for x in xfers):
            _GRAVEYARD.append((self._nx, xfers))
            return
        for x in xfers:
            self.release(x)
        self._reuse.clear()
        for name in list(self._loaded):
            with contextlib.suppress(Exception):
                self._nx.remove_remote_agent(name)
        for descs in self._regs.values():
            with contextlib.suppress(Exception):
                self._nx.deregister_memory(descs)
        self._loaded.clear()
        self._regs.clear()
        self._by_name.clear()
        self._parting.clear()
        self._poster = None
        self._nx = None  # the last reference: NIXL's destructor joins its progress thread

    def describe(self) -> dict[str, Any]:
        mod, _ = _probe.load_nixl()
        return {
            "nixl_module": getattr(mod, "__name__", None),
            "nixl_agent": self.nixl_name,
            "plugins": list(self.opts.backends),
            "plugin_params": self.opts.plugin_params,
            "ucx_env": self.opts.ucx_env,
            "progress_thread": self.opts.progress_thread,
            "memory_kinds": sorted(self.capabilities.memory_kinds),
            "peers": sorted(self._by_name),
            "foreign_notifications_dropped": self._foreign,
        }
