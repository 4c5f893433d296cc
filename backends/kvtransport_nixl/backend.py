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
  NIXL request instead of creating one (``reuse.py``): NIXL's cheapest path.

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

This class is a facade over the backend skeleton's parts: ``options.py`` (the options,
declared, and each plugin's parameters), ``probe.py`` (can NIXL run here, which plugins,
is there a GPU), ``wire.py`` (the exported blob, region blobs), ``peers.py`` (loaded
remote agents, liveness) and ``datapath.py`` (memory, posting, completion); beside them
``xfer.py`` (one request's state machine and the poster thread) and ``reuse.py`` (re-posting
prepared requests).
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from kvtransport.errors import BackendOptionError, KVTransportError
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
from kvtransport.ucx_config import ucx_environment

from . import probe as P
from .datapath import MARK, DataPath
from .options import NixlOptions, parse_options, plugin_params
from .peers import SUFFIX, Conn, Peers
from .reuse import RequestCache
from .xfer import Xfer, nixl_error

#: Agents closed with transfers still in flight: kept alive (never destroyed under a copy).
_GRAVEYARD: list[Any] = []


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
            return P.probe()
        except Exception as exc:  # probe must not raise
            return Availability(False, f"NIXL probe failed: {type(exc).__name__}: {exc}", P.INSTALL_HINT)

    def __init__(self, agent_name: str, options: Mapping[str, Any]) -> None:
        super().__init__(agent_name, options)
        self.opts: NixlOptions = parse_options(options)
        m = P.nixl()
        info = P.plugin_info()
        params = {p: plugin_params(self.opts, info, p) for p in self.opts.backends}
        self.nixl_name = f"{agent_name}{SUFFIX}{secrets.token_hex(4)}"
        cfg = m.nixl_agent_config(enable_prog_thread=self.opts.progress_thread, backends=[],
                                  num_threads=self.opts.num_threads,
                                  sync_mode=m.nixl_thread_sync_t.NIXL_THREAD_SYNC_RW)
        self._nx = m.nixl_agent(self.nixl_name, cfg)
        for plugin in self.opts.backends:
            try:
                with ucx_environment(self.opts.ucx_env if plugin == "UCX" else {}):
                    self._nx.create_backend(plugin, params[plugin])
            except Exception as exc:
                env = f" with UCX settings {self.opts.ucx_env}" if plugin == "UCX" and self.opts.ucx_env else ""
                raise BackendOptionError(
                    f"nixl backend: plugin {plugin} failed to start{env}: {type(exc).__name__}: {exc}; "
                    f"its parameters were {params[plugin]}") from None
        mems = [set(self._nx.get_backend_mem_types(p)) for p in self.opts.backends]
        kinds = P.local_memory_kinds(mems, P.has_gpu(), self.opts.device_memory)
        if kinds != self.capabilities.memory_kinds:
            self.capabilities = dataclasses.replace(self.capabilities, memory_kinds=kinds)
        reuse = RequestCache()
        self._peers = Peers(self._nx, reuse, self.opts.liveness_interval_s)
        self._data = DataPath(self._nx, self.opts, self._peers, reuse, agent_name, self.signal_progress)
        self._foreign = 0
        self._closed = False

    # -- memory ---------------------------------------------------------------------------
    def register(self, region: LocalRegion) -> bytes:
        return self._data.register(region, self.capabilities.memory_kinds)

    def deregister(self, region: LocalRegion) -> None:
        self._data.deregister(region)

    # -- peers ----------------------------------------------------------------------------
    def export(self) -> bytes:
        return self._peers.export(self.nixl_name, list(self.opts.backends))

    def connect(self, peer_name: str, blob: bytes, regions: Sequence[RemoteRegion]) -> Conn:
        return self._peers.connect(peer_name, blob, regions)

    def disconnect(self, peer: Conn) -> None:
        self._peers.disconnect(peer)

    def peer_alive(self, peer: Conn) -> bool | None:
        return self._peers.peer_alive(peer)

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

    # -- notifications --------------------------------------------------------------------
    def notifications(self) -> list[tuple[str, bytes]]:
        out: list[tuple[str, bytes]] = []
        for sender, msgs in self._nx.get_new_notifs().items():
            sender = sender.decode() if isinstance(sender, bytes) else str(sender)
            peer = sender.rpartition(SUFFIX)[0]
            for msg in msgs:
                if peer and msg[:1] == MARK:
                    out.append((peer, bytes(msg[1:])))
                else:
                    self._foreign += 1  # not from a kvtransport agent: not ours to deliver
        return out

    def send_notification(self, peer: Conn, payload: bytes) -> None:
        self._peers.check(peer)
        if peer.failed:
            raise KVTransportError(peer.failed)
        try:
            self._nx.send_notif(peer.nixl_name, MARK + payload)
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
        if not self._data.drain(self.opts.close_grace_s):
            _GRAVEYARD.append((self._nx, list(self._data.live)))
            return
        self._peers.close()
        self._data.forget()
        self._nx = None  # the last reference: NIXL's destructor joins its progress thread

    def describe(self) -> dict[str, Any]:
        mod, _ = P.load_nixl()
        return {
            "nixl_module": getattr(mod, "__name__", None),
            "nixl_agent": self.nixl_name,
            "plugins": list(self.opts.backends),
            "plugin_params": self.opts.plugin_params,
            "ucx_env": self.opts.ucx_env,
            "progress_thread": self.opts.progress_thread,
            "memory_kinds": sorted(self.capabilities.memory_kinds),
            "peers": sorted(self._peers.by_name),
            "foreign_notifications_dropped": self._foreign,
        }
