"""The nixl data path: local memory, posting, completion, quiescence.

``register`` registers one ``(addr, len, dev)`` descriptor (DRAM, or VRAM with its device
index). ``post`` builds two descriptor lists from ``(n, 3)`` numpy arrays of (address,
length, device) — NIXL copies them in C++, no Python loop per segment — then
``initialize_xfer`` (NIXL validates and prepares them) and ``transfer``; a transfer
prepared once and posted again re-posts its finished NIXL request instead (``reuse.py``).
Small transfers are posted on the caller's thread, larger ones on the poster thread
(``xfer.py``, which also holds a request's state machine). NIXL cannot abort a posted
request, so a cancelled transfer is quiesced only once NIXL itself ended it (backend.py).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvtransport.errors import KVTransportError
from kvtransport.spi import LocalRegion, Op, PollResult, PostRequest

from .options import NixlOptions
from .peers import Conn, Peers
from .reuse import RequestCache
from .wire import region_blob
from .xfer import DONE_INLINE, Poster, Stage, Xfer, apply_state, nixl_error, refresh, transfer

__all__ = ["DataPath", "MARK", "KINDS"]

MARK = b"K"  # first byte of every notification we send
_DONE = PollResult.done()
#: kvtransport memory kind -> NIXL memory type.
KINDS = {"cpu": "DRAM", "cuda": "VRAM"}


class DataPath:
    """Registered memory and transfers of one NIXL agent (``nx``)."""

    def __init__(self, nx: Any, opts: NixlOptions, peers: Peers, reuse: RequestCache, agent_name: str,
                 signal_progress: Callable[[], None]) -> None:
        self.nx = nx
        self._opts = opts
        self._peers = peers
        self._reuse = reuse
        self._agent_name = agent_name
        self._signal = signal_progress
        self.regs: dict[int, Any] = {}
        self.kinds: dict[int, tuple[str, int]] = {}
        self._poster: Poster | None = None
        self._stuck: set[Xfer] = set()  # released by the core while NIXL still runs them
        self._xfer_lock = threading.Lock()  # every Xfer's stage (short sections, never nested)
        #: every request not yet released (close); a plain set: a WeakSet's add costs a weak
        #: reference and its callback per post
        self.live: set[Xfer] = set()

    # -- memory ---------------------------------------------------------------------------
    def register(self, region: LocalRegion, accepted: frozenset[str]) -> bytes:
        kind = KINDS.get(region.kind)
        if kind is None or region.kind not in accepted:
            raise KVTransportError(f"nixl backend cannot register {region.kind!r} memory here; it accepts "
                                   f"{sorted(accepted)}")
        dev = max(region.device, 0) if kind == "VRAM" else 0
        descs = self.nx.get_reg_descs(np.array([[region.addr, region.length, dev]], np.uint64), kind)
        try:
            self.nx.register_memory(descs)
        except Exception as exc:
            raise KVTransportError(nixl_error(exc, f"NIXL refused to register region {region.id}")) from None
        self.regs[region.id] = descs
        self.kinds[region.id] = (kind, dev)
        # NIXL's agent metadata (export) carries every region's keys; the blob carries the
        # device index of device memory, for the peer's descriptors
        return region_blob(kind, dev)

    def deregister(self, region: LocalRegion) -> None:
        descs = self.regs.pop(region.id, None)
        self.kinds.pop(region.id, None)
        if descs is not None:
            self.nx.deregister_memory(descs)

    # -- posting --------------------------------------------------------------------------
    def descs(self, addr: np.ndarray, length: np.ndarray, kind: str, dev: int) -> Any:
        d = np.empty((addr.size, 3), np.uint64)
        d[:, 0], d[:, 1], d[:, 2] = addr, length, dev
        return self.nx.get_xfer_descs(d, kind)

    def local_kind(self, regions: np.ndarray) -> tuple[str, int]:
        first = self.kinds[int(regions[0])]
        if len(self.kinds) > 1 and any(self.kinds[int(r)] != first for r in np.unique(regions)):
            raise KVTransportError("a NIXL transfer moves one memory kind and device per side; "
                                   "split this transfer by region kind")
        return first

    @staticmethod
    def remote_kind(conn: Conn, regions: np.ndarray) -> tuple[str, int]:
        """NIXL memory type and device index of the peer's side (one of each per transfer)."""
        if conn.all_cpu:
            return "DRAM", 0
        used = np.unique(regions)
        kinds = {(conn.remote_kinds.get(int(r), "cpu"), conn.remote_devs.get(int(r), 0)) for r in used}
        if len(kinds) != 1 or next(iter(kinds))[0] not in KINDS:
            raise KVTransportError(f"remote segments span memory kinds / devices {sorted(kinds)}; NIXL moves "
                                   "one per side")
        kind, dev = kinds.pop()
        return KINDS[kind], dev

    def _drain_stuck(self) -> None:
        for x in list(self._stuck):
            refresh(self.nx, x)
            if not x.moving:
                self._stuck.discard(x)
                self.release(x)

    def post(self, req: PostRequest) -> Xfer:
        if self._stuck:
            self._drain_stuck()
        conn: Conn = req.peer
        self._peers.check(conn)
        if conn.failed:
            raise KVTransportError(conn.failed)
        notif = b"" if req.notify is None else MARK + req.notify
        handle, entry = self._reuse.take(req, conn)  # a finished request of this preparation
        if handle is None:
            kind, dev = self.local_kind(req.local_region)
            rkind, rdev = self.remote_kind(conn, req.remote_region)
            try:
                local = self.descs(req.local_addr, req.length, kind, dev)
                remote = self.descs(req.remote_addr, req.length, rkind, rdev)
                handle = self.nx.initialize_xfer("READ" if req.op is Op.READ else "WRITE", local, remote,
                                                 conn.nixl_name, notif)
            except Exception as exc:
                raise KVTransportError(nixl_error(exc, f"NIXL refused the transfer to {conn.name!r}")) from None
        nbytes = entry.nbytes if entry is not None else req.nbytes
        if nbytes <= self._opts.inline_post_bytes:
            return self._post_inline(req.transfer_id, conn, handle, nbytes, notif, entry)
        x = Xfer(req.transfer_id, conn, handle, nbytes, notif, entry, lock=self._xfer_lock)
        conn.xfers.add(x)
        self.live.add(x)
        if self._poster is None:
            self._poster = Poster(self.nx, self._agent_name, self._signal)
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
        st, reason = transfer(self.nx, handle, notif)
        if st == "DONE":
            if conn.gone or not self._reuse.give_back(entry, handle, bool(notif)):
                with contextlib.suppress(Exception):
                    handle.release()
            return DONE_INLINE
        x = Xfer(tid, conn, handle, nbytes, notif, entry, lock=self._xfer_lock)
        apply_state(x, st, reason)  # IN_FLIGHT or FAILED
        conn.xfers.add(x)
        self.live.add(x)
        return x

    # -- completion -----------------------------------------------------------------------
    def poll(self, handle: Xfer) -> PollResult:
        if handle is DONE_INLINE:
            return _DONE
        refresh(self.nx, handle)  # returns at once unless the request is IN_FLIGHT
        st = handle.stage
        if st is Stage.DONE:
            return _DONE
        if st is Stage.FAILED:
            return PollResult.failed(handle.reason, quiesced=True)
        conn = handle.conn
        self._peers.check(conn)
        if conn.failed:
            return PollResult.failed(conn.failed, quiesced=self._quiet(handle))
        # QUEUED or POSTING: the poster thread signals progress when its transfer() call
        # for it returns, so a waiter can sleep until then (IN_FLIGHT needs polling).
        return PollResult.pending(will_signal=st is not Stage.IN_FLIGHT)

    @staticmethod
    def _quiet(x: Xfer) -> bool:
        """No byte of ``x`` can land any more: NIXL ended the request, or it was never
        posted, or the peer process is gone and our side is not inside a copy for it."""
        with x.lock:
            if x.stage is Stage.QUEUED:
                x.stage, x.reason = Stage.FAILED, "cancelled before NIXL posted it"
            return not x.moving or (x.conn.dead and x.stage is Stage.IN_FLIGHT)

    def cancel(self, handle: Xfer) -> bool:
        """NIXL cannot abort a posted request: True only if it never started or ended."""
        refresh(self.nx, handle)
        return self.quiesced(handle)

    def quiesced(self, handle: Xfer) -> bool:
        if handle is DONE_INLINE:
            return True
        refresh(self.nx, handle)
        self._peers.check(handle.conn)
        ok = self._quiet(handle)
        if ok:
            handle.conn.xfers.discard(handle)
            if handle.moving:  # dead peer: NIXL may hold the request a while; never GC it
                self._stuck.add(handle)
            if self._peers.parting:
                self._peers.sweep()
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
        self.live.discard(handle)
        if done and not handle.conn.gone and self._reuse.give_back(handle.entry, h, bool(handle.notif)):
            return  # kept for the next post of the same preparation
        with contextlib.suppress(Exception):
            h.release()

    # -- lifetime -------------------------------------------------------------------------
    def drain(self, grace_s: float) -> bool:
        """Stop the poster and wait up to ``grace_s`` for every request to end; release them
        all and deregister the memory if they did (True), else leave everything (False)."""
        if self._poster is not None:
            self._poster.stop(grace_s)
        xfers = list(self.live)
        limit = time.monotonic() + grace_s
        while any(x.moving for x in xfers) and time.monotonic() < limit:
            for x in xfers:
                refresh(self.nx, x)
            time.sleep(0.002)
        if any(x.moving for x in xfers):
            return False
        for x in xfers:
            self.release(x)
        self._reuse.clear()
        return True

    def forget(self) -> None:
        """After :meth:`drain`: deregister the memory and drop the NIXL agent."""
        for descs in self.regs.values():
            with contextlib.suppress(Exception):
                self.nx.deregister_memory(descs)
        self.regs.clear()
        self._poster = None
        self.nx = None
