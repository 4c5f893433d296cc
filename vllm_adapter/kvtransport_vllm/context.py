"""What the worker's consumer, producer and side-channel handlers share.

One :class:`WorkerContext` per worker: its configuration and identity, the kvtransport
agent and our layout (set when the KV caches are registered), the statistics counters,
the side-channel clients to reply addresses, and the one lock. That lock guards every
table the side-channel server thread reads or writes (holds, receives, ended keys,
consumer hand-shakes) and every state change of a hold or a receive, so the server
thread and the engine thread always see one state machine, never a half-made change.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import kvtransport as kvt
from kvtransport.auth import Authenticator

from .config import ConnectorConfig
from .load_stats import new_stats
from .messages import LayoutInfo
from .side_channel import SideChannelClient, Transmit, send_sealed

__all__ = ["WorkerContext", "new_stats"]


@dataclass
class WorkerContext:
    cfg: ConnectorConfig
    name: str  # this worker's engine name on the side channel ("<engine_id>-tp<rank>")
    port: int  # our side-channel port (base + TP rank)
    tp_rank: int
    auth: Authenticator | None
    tp_size: int = 1
    lock: threading.RLock = field(default_factory=threading.RLock)
    stats: dict[str, Any] = field(default_factory=new_stats)
    #: this worker's transport (None before the KV caches are registered and after shutdown)
    agent: kvt.Agent | None = None
    layout: LayoutInfo | None = None
    local_layouts: list[kvt.BlockLayout] = field(default_factory=list)
    #: KV cache group of each layer of local_layouts (hybrid models; []: all in group 0)
    layer_group: list[int] = field(default_factory=list)
    #: which layers of local_layouts are Mamba / SSM state pages (ssm_tp.py)
    state_layers: frozenset[int] = frozenset()
    agent_md: bytes = b""
    #: clients to the reply addresses peers gave us (Written, notices), by (host, port)
    reply_clients: dict[tuple[str, int], SideChannelClient] = field(default_factory=dict)
    #: how every side-channel client of this worker puts a request on the wire (seal and
    #: send; a soak passes a lossy network model before the first peer is contacted)
    transmit: Transmit = send_sealed

    def new_client(self, host: str, port: int) -> SideChannelClient:
        return SideChannelClient(host, port, auth=self.auth, max_message_bytes=self.cfg.max_message_bytes,
                                 transmit=self.transmit)

    def client_to(self, host: str, port: int) -> SideChannelClient:
        """The (cached) client to a peer's reply address. Engine thread only."""
        c = self.reply_clients.get((host, port))
        if c is None:
            c = self.reply_clients[(host, port)] = self.new_client(host, port)
        return c
