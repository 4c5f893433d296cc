"""The consumer's hand-shakes with producer workers: one :class:`PeerConn` per producer
side channel (host, port of one producer TP rank), its Hello / Welcome exchange, and the
compatibility check (:mod:`.compat`) of the producer's KV cache against ours before any
byte may move.

Ports: a producer advertises the base port of its DP rank (``remote_port``); its TP rank
*q* listens on that + *q* (docs/vllm/USAGE.md, Data parallel). Which *q* a consumer rank talks
to is decided by :mod:`.tp_mapping` (equal TP sizes: our own rank).

Engine thread only (the consumer's advance and reply polling).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import kvtransport as kvt

from .compat import refusal
from .context import WorkerContext
from .kv_layout import remote_layouts
from .messages import Error, Hello, LayoutInfo, Msg, Welcome

log = logging.getLogger(__name__)

__all__ = ["PeerConn", "ProducerPeers", "reconnect"]


def reconnect(agent: kvt.Agent, md: bytes, old: kvt.Peer | None) -> kvt.Peer:
    """Connect to a peer from its metadata, closing our previous connection to it first.

    Why: a connection is re-made only after a transfer on it failed (or its peer
    restarted). The peer may still be alive behind a link that flapped or an endpoint
    that errored; connecting again over the old connection can reuse the dead endpoint
    (NIXL keeps a loaded remote agent's endpoints across a second load of its metadata),
    so the old one is disconnected first and the backend builds new endpoints. One
    mechanism for every backend; the transfers still on the old connection fail now
    (they were on a connection known to have failed)."""
    if old is not None and agent.peers.get(old.name) is old:
        agent.disconnect(old)
    return agent.connect(md)


@dataclass
class PeerConn:
    """Our hand-shake with one producer worker (host, port of its side channel)."""

    host: str
    port: int
    client: Any  # SideChannelClient
    state: str = "new"  # new | hello | ready | draining (to re-make once idle) | failed
    error: str = ""
    kvt_peer: Any = None
    layouts: list[kvt.BlockLayout] = field(default_factory=list)
    hello_cid: int = 0
    last_hello: float = 0.0
    engine_name: str = ""  # the producer worker we hand-shook with
    failed_at: float = 0.0  # when the hand-shake last failed
    #: the last refusal logged at error level; the same one again is logged at debug level
    logged_error: str = ""
    info: LayoutInfo | None = None  # the producer's layout, from its Welcome

    def fail(self, error: str) -> None:
        """The hand-shake failed. Logged at error level once per peer and reason: every load
        from a refusing peer hand-shakes again (the peer may have been fixed), and an
        engine under load would otherwise log the same refusal once per request. A new
        reason, or the same one after a successful hand-shake, is logged again.

        The producer we last hand-shook with is forgotten (``engine_name``): a load that
        begins after this failure hand-shakes again, also when the same producer answers
        (a connection that failed to a producer still alive is re-made, not kept failed)."""
        self.state, self.error, self.failed_at = "failed", error, time.monotonic()
        self.engine_name = ""
        if error == self.logged_error:
            log.debug("%s (repeated; logged once at error level)", error)
            return
        self.logged_error = error
        log.error("%s", error)



class ProducerPeers:
    """Our hand-shakes with producer workers, by (host, port)."""

    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self.peers: dict[tuple[str, int], PeerConn] = {}

    def get(self, host: str, port: int) -> PeerConn:
        """Our connection to the producer worker at ``port`` (hand-shake sent if due)."""
        p = self.peers.get((host, port))
        if p is None:
            p = self.peers[(host, port)] = PeerConn(host, port, self.ctx.new_client(host, port))
        if p.state == "new" or (p.state == "hello" and time.monotonic() - p.last_hello > 1.0):
            assert self.ctx.layout is not None
            p.hello_cid = p.client.send(Hello(engine_id=self.ctx.name, tp_rank=self.ctx.tp_rank,
                                              agent_md=self.ctx.agent_md, layout=self.ctx.layout,
                                              reply_host=self.ctx.cfg.side_channel_host,
                                              reply_port=self.ctx.port))
            p.last_hello = time.monotonic()
            p.state = "hello"
        return p

    def _on_welcome(self, p: PeerConn, msg: Welcome) -> None:
        assert self.ctx.layout is not None
        diff = refusal(self.ctx.layout, msg.layout, "decode", "prefill")
        if diff:
            p.fail(f"KV layout mismatch (incompatible KV caches) with producer {msg.engine_id} at "
                   f"{p.host}:{p.port}, no byte moved: {diff}")
            return
        try:
            peer = reconnect(self.ctx.agent, msg.agent_md, p.kvt_peer)
        except kvt.errors.KVTransportError as exc:
            p.fail(f"cannot connect to {msg.engine_id}: {exc}")
            return
        try:
            layouts = remote_layouts(peer, msg.layout)
        except Exception as exc:  # typed errors, and whatever a lying layout makes arithmetic raise
            p.fail(f"producer {msg.engine_id} declared an unusable layout: {type(exc).__name__}: {exc}")
            return
        p.kvt_peer, p.layouts, p.state, p.error, p.info = peer, layouts, "ready", "", msg.layout
        p.logged_error = ""  # a later refusal is news again
        p.engine_name = msg.engine_id

    def poll(self) -> list[Msg]:
        """Take the hand-shake replies; return every other reply from producers."""
        out: list[Msg] = []
        for p in list(self.peers.values()):
            for msg in p.client.poll():
                if msg.cid == p.hello_cid and p.state == "hello":
                    if isinstance(msg, Welcome):
                        self._on_welcome(p, msg)
                    elif isinstance(msg, Error):
                        p.fail(f"producer {p.host}:{p.port} refused hand-shake: {msg.message}")
                    continue
                out.append(msg)
        return out
