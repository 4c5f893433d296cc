"""Worker half of KVTransportConnector: moves the bytes and keeps the contracts.

Runs in each vLLM worker (one per TP rank). Everything here is driven from vLLM's
per-step hooks (``start_load_kv`` .. ``get_finished``) and never blocks on a peer: the
side channel is asynchronous and transfers are polled. A side-channel server thread
answers peers; it only touches the lock-protected tables below, never the agent.

Consumer, per request (``_Recv``)::

    CONNECT --hand-shake ok--> READ: post one batched READ (all layers) --DONE--> CONFIRM
      "done with key?" --ok--> done_recving           (read, then confirm: lifecycle 2.4)
                       --expired/error/deadline--> load error + done_recving
    WRITE mode: CONNECT --> send WriteReq --"written ok"--> done_recving
      give up (deadline/abort/peer aborted) --> CANCEL until the producer acks that no
      write can land any more (stale-write hazard, lifecycle 3.3) --> load error

Producer, per finished prefill (``_Hold``): blocks stay held under a lease that any
consumer message for the key renews. READ: "done" inside the lease -> ok + done_sending;
after it -> expired. Lease lapse or "release" -> done_sending (blocks return to vLLM).
WRITE: once both the hold and the consumer's block ids exist, one batched WRITE, then
"written" to the consumer; blocks are freed when the consumer acks, on cancel, or on lease
lapse (never while a write is in flight and not quiesced: T3).

Every request id reaches ``get_finished`` at most once and only while vLLM tracks it (R3).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import kvtransport as kvt

from .config import ConnectorConfig
from .messages import (
    Aborted,
    Cancel,
    Done,
    Error,
    Hello,
    KVTransportMetadata,
    LayoutInfo,
    Msg,
    PeerNotice,
    RecvJob,
    Release,
    Renew,
    Reply,
    Welcome,
    WriteReq,
    Written,
)
from .side_channel import SideChannelClient, SideChannelServer

log = logging.getLogger(__name__)

__all__ = ["KVTransportWorker", "KVLayoutError", "describe_kv_caches"]

_RECENT = 65536  # remembered ended keys (late messages answered "expired", not "pending")


class KVLayoutError(ValueError):
    """The KV cache tensors cannot be described as paged blocks, or the peer's differ."""


# ----------------------------------------------------------------------------------
# KV cache layout


@dataclass
class _LayerMem:
    tensor: Any
    addr: int
    nbytes: int
    bases: list[int]  # byte offset of each part (1: blocks first; 2: K/V halves first)
    block_bytes: int
    block_stride: int


def describe_kv_caches(kv_caches: dict[str, Any], num_blocks: int) -> list[_LayerMem]:
    """Describe each layer's paged cache as parts of ``num_blocks`` blocks.

    Works from sizes and strides, so permuted views (vLLM allocates a raw buffer and
    views it in the attention backend's stride order) are handled. The block dimension
    is the outermost dimension of size ``num_blocks``; a dimension of size 2 with a larger
    stride is a K/V split (two parts). Within a part, one block must be one dense byte
    range; anything else is refused with a message instead of guessing.
    """
    out = []
    for name, t in kv_caches.items():
        item = t.element_size()
        sizes, strides = list(t.shape), list(t.stride())
        cands = [d for d, n in enumerate(sizes) if n == num_blocks]
        if not cands:
            raise KVLayoutError(f"KV cache of layer {name} has shape {tuple(sizes)}: no dimension of "
                                f"num_blocks={num_blocks}")
        bd = max(cands, key=lambda d: strides[d])
        split = [d for d, n in enumerate(sizes) if n == 2 and strides[d] > strides[bd] and d != bd]
        inner = [d for d in range(len(sizes)) if d != bd and d not in split[:1]]
        if any(strides[d] > strides[bd] for d in inner):
            raise KVLayoutError(f"KV cache of layer {name} (shape {tuple(sizes)}, strides {tuple(strides)}) "
                                "does not keep each block in one byte range")
        per_block = 1
        for d in inner:
            per_block *= sizes[d]
        if per_block != strides[bd]:
            raise KVLayoutError(f"KV cache of layer {name} (shape {tuple(sizes)}, strides {tuple(strides)}) "
                                "has gaps inside a block")
        bases = [0] if not split else [0, strides[split[0]] * item]
        span = 1 + sum((n - 1) * st for n, st in zip(sizes, strides))
        out.append(_LayerMem(t, int(t.data_ptr()), span * item, bases, per_block * item, strides[bd] * item))
    return out


# ----------------------------------------------------------------------------------
# state records


@dataclass
class _PeerConn:
    host: str
    port: int
    client: SideChannelClient
    state: str = "new"  # new | hello | ready | failed
    error: str = ""
    kvt_peer: Any = None
    layouts: list[kvt.BlockLayout] = field(default_factory=list)
    hello_cid: int = 0
    last_hello: float = 0.0
    engine_name: str = ""  # the producer worker we hand-shook with


@dataclass
class _Recv:
    job: RecvJob
    deadline: float
    started: float
    state: str = "connect"  # connect | read | confirm | write_wait | cancel | finished
    transfer: Any = None
    cid: int = 0
    last_sent: float = 0.0
    error: str = ""
    aborted: bool = False  # vLLM finished the request (abort) while loading
    peer_aborted: bool = False
    written: bool | None = None  # WRITE mode: producer's verdict
    write_requested: bool = False
    instance: str = ""  # READ mode: producer agent instance the bytes were read from
    # WRITE mode: the producer processes our write requests reached (None: sent while the
    # hand-shake was not complete, so the receiving process is unknown).
    writers: list = field(default_factory=list)


@dataclass
class _Hold:
    req_id: str
    key: str
    block_ids: list[int]
    expiry: float
    dest: tuple[str, list[int], str, int] | None = None  # consumer engine, blocks, reply host, port
    write: Any = None
    write_state: str = "none"  # none | posted | notify
    write_ok: bool = False
    write_reason: str = ""
    notify_cid: int = 0
    last_sent: float = 0.0


class KVTransportWorker:
    def __init__(
        self,
        cfg: ConnectorConfig,
        block_size: int,
        num_blocks: int,
        dtype: str,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        self.cfg = cfg
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.dtype = dtype
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.name = f"{cfg.engine_id}-tp{tp_rank}"
        self.port = cfg.side_channel_port + tp_rank
        self.agent: Any = None
        self.server: SideChannelServer | None = None
        #: seals/opens every side-channel message (None only if explicitly disabled)
        self._auth = cfg.make_authenticator()
        self.layout: LayoutInfo | None = None
        self._local_layouts: list[kvt.BlockLayout] = []
        self._agent_md = b""
        self._lock = threading.RLock()
        # consumer
        self._recv: dict[str, _Recv] = {}  # req_id -> job
        self._recv_by_key: dict[str, str] = {}  # key -> req_id
        self._peers: dict[tuple[str, int], _PeerConn] = {}
        self._done_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        self._load_errors: set[int] = set()
        self._notices: list[tuple[PeerNotice, float]] = []
        self._last_renew = 0.0
        # producer
        self._holds: dict[str, _Hold] = {}
        self._ended: OrderedDict[str, str] = OrderedDict()  # key -> why (done|expired|released|cancelled)
        self._early_dest: dict[str, tuple[tuple[str, list[int], str, int], float]] = {}
        self._consumer_md: dict[str, bytes] = {}  # consumer engine name -> agent metadata
        self._consumer_peers: dict[str, Any] = {}
        self._consumer_layouts: dict[str, LayoutInfo] = {}
        self._reply_clients: dict[tuple[str, int], SideChannelClient] = {}
        self._done_sending: set[str] = set()
        # stats since last get_stats()
        self._stats = _new_stats()
        #: side-channel refusal totals at the last take_stats(), to report differences
        self._side_channel_reported = _side_channel_zero()
        #: totals of side-channel sockets already closed (shutdown), so totals never go down
        self._side_channel_closed = _side_channel_zero()

    # ------------------------------------------------------------------ set-up
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        layers = describe_kv_caches(kv_caches, self.num_blocks)
        parts = len(layers[0].bases)
        bb = layers[0].block_bytes
        for lm in layers:
            if len(lm.bases) != parts or lm.block_bytes != bb:
                raise KVLayoutError("all attention layers must share one KV layout (block bytes, K/V split)")
        self._kv_caches = kv_caches  # keep tensors alive while registered
        opts = dict(self.cfg.backend_options)
        opts.setdefault("default_timeout_s", self.cfg.transfer_timeout_s)
        opts["name"] = self.name
        self.agent = kvt.open(self.cfg.backend, **opts)
        part_regions, strides = [], []
        for lm in layers:
            region = self.agent.register((lm.addr, lm.nbytes))
            self._local_layouts.append(
                kvt.BlockLayout([(region, b) for b in lm.bases], lm.block_bytes, self.num_blocks, lm.block_stride)
            )
            part_regions.append([(region.id, b) for b in lm.bases])
            strides.append(lm.block_stride)
        self.layout = LayoutInfo(
            block_size=self.block_size,
            dtype=self.dtype,
            num_layers=len(layers),
            block_bytes=bb,
            parts_per_layer=parts,
            tp_size=self.tp_size,
            part_regions=part_regions,
            block_stride=strides,
        )
        self._agent_md = self.agent.metadata()
        try:
            self.server = SideChannelServer(
                self.cfg.side_channel_host,
                self.port,
                self._handle,
                auth=self._auth,
                max_message_bytes=self.cfg.max_message_bytes,
            )
        except Exception:
            self.agent.close()
            self.agent = None
            raise
        log.info("kvtransport worker %s: %d layers, %s backend, side channel %s:%d",
                 self.name, len(layers), self.cfg.backend, self.cfg.side_channel_host, self.port)

    def shutdown(self) -> None:
        self._side_channel_closed = self._side_channel_totals()
        if self.server is not None:
            self.server.close()
            self.server = None
        for p in self._peers.values():
            p.client.close()
        for c in self._reply_clients.values():
            c.close()
        self._peers.clear()
        self._reply_clients.clear()
        if self.agent is not None:
            self.agent.close()
            self.agent = None

    # ------------------------------------------------------------------ per step
    def on_metadata(self, meta: KVTransportMetadata | None) -> None:
        """Take this step's new work from the scheduler half."""
        if meta is None:
            return
        now = time.monotonic()
        with self._lock:
            for job in meta.recv:
                if job.req_id in self._recv:
                    continue
                self._recv[job.req_id] = _Recv(job, deadline=now + self.cfg.transfer_timeout_s, started=now)
                self._recv_by_key[job.key] = job.req_id
            for h in meta.hold:
                why = self._ended.get(h.key)
                if why is not None:  # consumer released / cancelled before we learnt of it
                    self._done_sending.add(h.req_id)
                    continue
                hold = _Hold(h.req_id, h.key, list(h.block_ids), expiry=now + self.cfg.lease_s)
                early = self._early_dest.pop(h.key, None)
                if early is not None:
                    hold.dest = early[0]
                self._holds[h.key] = hold
        for n in meta.notices:
            self._notices.append((n, now))

    def progress(self, finished_req_ids: set[str] | frozenset[str] = frozenset()) -> None:
        """Advance every transfer; safe to call any number of times per step."""
        now = time.monotonic()
        if self.agent is not None:
            self.agent.progress()
        with self._lock:
            for rid in finished_req_ids:
                r = self._recv.get(rid)
                if r is not None and not r.aborted:
                    r.aborted = True
                    r.error = r.error or "request aborted"
        self._send_notices()
        self._poll_replies(now)
        self._advance_consumer(now)
        self._advance_producer(now)
        self._renew(now)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self.progress(finished_req_ids)
        with self._lock:
            sending, self._done_sending = self._done_sending, set()
            recving, self._done_recving = self._done_recving, set()
        return (sending or None), (recving or None)

    def take_failed_recving(self) -> set[str]:
        with self._lock:
            out, self._failed_recving = self._failed_recving, set()
        return out

    def take_load_errors(self) -> set[int]:
        with self._lock:
            out, self._load_errors = self._load_errors, set()
        return out

    def take_stats(self) -> dict[str, Any]:
        """Counters since the last call. The side-channel refusals are kept as running
        totals by the sockets themselves (the server's thread counts them, and its log
        throttling reads them), so they are reported as the difference to the last call."""
        with self._lock:
            out, self._stats = self._stats, _new_stats()
            totals = self._side_channel_totals()
            for k, v in totals.items():
                out[k] = v - self._side_channel_reported[k]
            self._side_channel_reported = totals
        return out

    def _side_channel_totals(self) -> dict[str, int]:
        """Side-channel messages refused since start, server and every client together:
        failed authentication, malformed, wrong protocol version; and refusals the
        server's failure rate limit dropped without a reply (also counted by reason)."""
        out = dict(self._side_channel_closed)
        if self.server is not None:
            c = self.server.counters
            out["sc_auth_failures"] += c["auth"]
            out["sc_malformed"] += c["malformed"]
            out["sc_version_mismatch"] += c["version"]
            out["sc_dropped"] += c["dropped"]
        for client in [p.client for p in self._peers.values()] + list(self._reply_clients.values()):
            out["sc_auth_failures"] += client.counters["auth"]
            out["sc_malformed"] += client.counters["malformed"]
        return out

    # ------------------------------------------------------------------ peers (consumer)
    def _peer(self, host: str, port: int) -> _PeerConn:
        port = port + self.tp_rank
        p = self._peers.get((host, port))
        if p is None:
            p = _PeerConn(host, port, SideChannelClient(host, port, auth=self._auth,
                                                        max_message_bytes=self.cfg.max_message_bytes))
            self._peers[(host, port)] = p
        if p.state in ("new",) or (p.state == "hello" and time.monotonic() - p.last_hello > 1.0):
            assert self.layout is not None
            p.hello_cid = p.client.send(Hello(engine_id=self.name, tp_rank=self.tp_rank, agent_md=self._agent_md,
                                              layout=self.layout, reply_host=self.cfg.side_channel_host,
                                              reply_port=self.port))
            p.last_hello = time.monotonic()
            p.state = "hello"
        return p

    def _on_welcome(self, p: _PeerConn, msg: Welcome) -> None:
        assert self.layout is not None
        diff = self.layout.mismatch(msg.layout)
        if diff:
            p.state, p.error = "failed", (
                f"KV layout mismatch with producer {msg.engine_id} at {p.host}:{p.port}: {diff}. "
                "Both engines must serve the same model with the same dtype, block size and TP size."
            )
            log.error("%s", p.error)
            return
        try:
            peer = self.agent.connect(msg.agent_md)
        except kvt.errors.KVTransportError as exc:
            p.state, p.error = "failed", f"cannot connect to {msg.engine_id}: {exc}"
            log.error("%s", p.error)
            return
        try:
            layouts = _remote_layouts(peer, msg.layout)
        except kvt.errors.KVTransportError as exc:
            p.state, p.error = "failed", f"producer {msg.engine_id} declared an unusable layout: {exc}"
            log.error("%s", p.error)
            return
        p.kvt_peer, p.layouts, p.state, p.error = peer, layouts, "ready", ""
        p.engine_name = msg.engine_id

    def _poll_replies(self, now: float) -> None:
        for p in list(self._peers.values()):
            for msg in p.client.poll():
                if msg.cid == p.hello_cid and p.state == "hello":
                    if isinstance(msg, Welcome):
                        self._on_welcome(p, msg)
                    elif isinstance(msg, Error):
                        p.state, p.error = "failed", f"producer {p.host}:{p.port} refused hand-shake: {msg.message}"
                        log.error("%s", p.error)
                    continue
                self._on_consumer_reply(msg)
        for c in self._reply_clients.values():
            for msg in c.poll():
                self._on_producer_reply(msg)

    def _on_consumer_reply(self, msg: Msg) -> None:
        if not isinstance(msg, Reply):
            return
        with self._lock:
            for key, status in msg.status.items():
                rid = self._recv_by_key.get(key)
                r = self._recv.get(rid) if rid else None
                if r is None or r.cid != msg.cid:
                    continue  # late or duplicate reply: dropped (R3)
                if r.state == "confirm":
                    if status == "ok":
                        self._finish_recv(r, ok=True)
                    elif status == "expired":
                        r.error = "producer lease expired before confirmation (stale read refused)"
                        self._finish_recv(r, ok=False)
                    elif status == "stale":
                        # we read from a previous incarnation of the producer (restarted at
                        # this address): those bytes are not its; hand-shake again
                        r.error = "producer restarted since the hand-shake (stale read refused)"
                        self._reset_peer(r.job)
                        self._send_release(r.job)
                        self._finish_recv(r, ok=False)
                    # "pending": the producer has not learnt of the key yet; resend later
                elif r.state == "cancel" and status in ("acked", "expired"):
                    self._finish_recv(r, ok=False)
                elif r.state == "write_wait" and status == "expired":
                    r.error = "producer no longer holds this request"
                    self._start_giving_up(r)
                elif r.state == "write_wait" and status == "hello":
                    # the producer does not know us (it restarted): hand-shake again;
                    # the write request is re-sent until the deadline
                    self._reset_peer(r.job)
                    self._peer(r.job.host, r.job.port)

    # ------------------------------------------------------------------ consumer
    def _advance_consumer(self, now: float) -> None:
        with self._lock:
            recvs = list(self._recv.values())
        for r in recvs:
            if r.state == "finished":
                continue
            job = r.job
            gave_up = r.aborted or r.peer_aborted or now >= r.deadline
            if r.state == "connect":
                if gave_up:
                    r.error = r.error or ("producer aborted" if r.peer_aborted else "timed out before connecting")
                    self._start_giving_up(r)
                    continue
                p = self._peer(job.host, job.port)
                if (p.state in ("ready", "failed") and job.remote_engine_id
                        and p.engine_name != f"{job.remote_engine_id}-tp{self.tp_rank}"):
                    # another producer now answers at this address (restarted): hand-shake again
                    p.state = "new"
                    p = self._peer(job.host, job.port)
                if p.state == "failed":
                    r.error = p.error
                    self._start_giving_up(r)
                elif p.state == "ready":
                    self._start(r, p, now)
            elif r.state == "read":
                st = r.transfer.status()
                if st.state is kvt.State.PENDING:
                    continue  # the core fails it by its deadline (T2)
                if st.state is kvt.State.DONE:
                    self._stats["bytes"] += r.transfer.nbytes
                    if r.aborted:
                        self._send_release(job)
                        self._finish_recv(r, ok=False)
                    else:
                        r.state = "confirm"
                        self._send_confirm(r, now)
                elif st.quiesced:  # FAILED; no late byte can land any more (T3)
                    r.error = f"read failed: {st.reason}"
                    self._reset_peer(job)
                    self._send_release(job)
                    self._finish_recv(r, ok=False)
            elif r.state == "confirm":
                if gave_up:
                    r.error = r.error or "no confirmation from the producer before the deadline"
                    self._send_release(job)
                    self._finish_recv(r, ok=False)
                elif now - r.last_sent > 0.05:
                    self._send_confirm(r, now)
            elif r.state == "write_wait":
                if r.written is True:
                    self._finish_recv(r, ok=True)
                elif r.written is False or gave_up:
                    r.error = r.error or ("producer write failed" if r.written is False else "write not received before the deadline")
                    self._start_giving_up(r)
                elif now - r.last_sent > 0.5:
                    self._send_write_req(r, now)  # idempotent on the producer
            elif r.state == "cancel":
                if now - r.last_sent > 0.05:
                    self._send_cancel(r, now)
                if self._writers_gone(r):
                    # Every process that could write into our blocks has exited: a dead
                    # process cannot write (lifecycle 3.3, "P is known gone").
                    r.error += "; producer process is gone: no write can land any more"
                    self._finish_recv(r, ok=False)
                elif now >= r.deadline + self.cfg.lease_s + self.cfg.transfer_timeout_s:
                    # Producer unreachable for longer than its lease plus a transfer
                    # deadline: it can no longer write into our blocks (it dropped the
                    # hold and any write it posted has ended). Known gone.
                    r.error += "; producer unreachable, considered gone"
                    self._finish_recv(r, ok=False)

    def _writers_gone(self, r: _Recv) -> bool:
        if not r.writers or any(w is None for w in r.writers):
            return False
        return all(self.agent.peer_alive(w) is False for w in r.writers)

    def _start(self, r: _Recv, p: _PeerConn, now: float) -> None:
        job = r.job
        if job.mode == "write":
            r.state = "write_wait"
            self._send_write_req(r, now)
            return
        local = kvt.Segments.concat([lay.segments(np.asarray(job.local_block_ids, np.int64)) for lay in self._local_layouts])
        try:
            remote = kvt.Segments.concat([lay.segments(np.asarray(job.remote_block_ids, np.int64)) for lay in p.layouts])
            r.transfer = self.agent.read(p.kvt_peer, local, remote, timeout=max(0.001, r.deadline - now))
            r.instance = p.kvt_peer.instance
        except kvt.errors.KVTransportError as exc:
            r.error = f"read refused: {exc}"
            self._reset_peer(job)
            self._send_release(job)
            self._finish_recv(r, ok=False)
            return
        self._stats["transfers"] += 1
        r.state = "read"

    def _reset_peer(self, job: RecvJob) -> None:
        """After a failed transfer, hand-shake again before the next one (the producer may
        have restarted at the same address with new memory)."""
        p = self._peers.get((job.host, job.port + self.tp_rank))
        if p is not None and p.state == "ready":
            p.state = "new"

    def _send_confirm(self, r: _Recv, now: float) -> None:
        p = self._peer(r.job.host, r.job.port)
        r.cid = p.client.send(Done(keys=[r.job.key], instance=r.instance))
        r.last_sent = now

    def _send_write_req(self, r: _Recv, now: float) -> None:
        p = self._peer(r.job.host, r.job.port)
        writer = p.kvt_peer if p.state == "ready" else None
        if not any(w is writer for w in r.writers):
            r.writers.append(writer)
        r.cid = p.client.send(WriteReq(key=r.job.key, block_ids=list(r.job.local_block_ids), engine_id=self.name,
                                       reply_host=self.cfg.side_channel_host, reply_port=self.port))
        r.last_sent = now
        r.write_requested = True

    def _send_cancel(self, r: _Recv, now: float) -> None:
        p = self._peer(r.job.host, r.job.port)
        r.cid = p.client.send(Cancel(keys=[r.job.key]))
        r.last_sent = now

    def _send_release(self, job: RecvJob) -> None:
        p = self._peer(job.host, job.port)
        p.client.send(Release(keys=[job.key]))

    def _start_giving_up(self, r: _Recv) -> None:
        """Stop waiting for ``r``. READ: tell the producer to free. WRITE: the producer
        may still write into our blocks, so cancel and keep them until it acks."""
        if r.job.mode == "write" and r.write_requested:
            r.state = "cancel"
            self._send_cancel(r, time.monotonic())
        else:
            self._send_release(r.job)
            self._finish_recv(r, ok=False)

    def _finish_recv(self, r: _Recv, ok: bool) -> None:
        with self._lock:
            if r.state == "finished":
                return
            r.state = "finished"
            self._recv.pop(r.job.req_id, None)
            self._recv_by_key.pop(r.job.key, None)
            self._done_recving.add(r.job.req_id)
            latency = time.monotonic() - r.started
            if ok:
                self._stats["loads_ok"] += 1
                self._stats["latency_s_sum"] += latency
                self._stats["latency_s_max"] = max(self._stats["latency_s_max"], latency)
            else:
                self._stats["failures"] += 1
                if not r.aborted:
                    self._failed_recving.add(r.job.req_id)
                    self._load_errors.update(r.job.local_block_ids)
                log.warning("kvtransport: load of request %s (key %s) failed: %s",
                            r.job.req_id, r.job.key, r.error or "unknown")

    def _send_notices(self) -> None:
        if not self._notices:
            return
        notices, self._notices = self._notices, []
        renew: dict[tuple[str, int], list[str]] = {}
        for n, _ in notices:
            if n.kind == "renew":  # queued consumer request (scheduler side): keep X's lease
                renew.setdefault((n.host, n.port + self.tp_rank), []).append(n.key)
                continue
            if n.kind == "aborted":
                with self._lock:  # later "write into"/"done" for it get "expired", not "pending"
                    self._ended[n.key] = "aborted"
                    self._early_dest.pop(n.key, None)
            client = self._client_to(n.host, n.port + self.tp_rank)
            client.send(Release(keys=[n.key]) if n.kind == "release" else Aborted(keys=[n.key]))
        for (host, port), keys in renew.items():
            self._client_to(host, port).send(Renew(keys=keys))

    def _renew(self, now: float) -> None:
        if now - self._last_renew < max(0.05, self.cfg.lease_s / 4):
            return
        self._last_renew = now
        by_peer: dict[tuple[str, int], list[str]] = {}
        with self._lock:
            for r in self._recv.values():
                if r.state in ("connect", "read", "confirm", "write_wait"):
                    by_peer.setdefault((r.job.host, r.job.port), []).append(r.job.key)
        for (host, port), keys in by_peer.items():
            p = self._peers.get((host, port + self.tp_rank))
            if p is not None:
                p.client.send(Renew(keys=keys))

    # ------------------------------------------------------------------ producer
    def _client_to(self, host: str, port: int) -> SideChannelClient:
        c = self._reply_clients.get((host, port))
        if c is None:
            c = SideChannelClient(host, port, auth=self._auth, max_message_bytes=self.cfg.max_message_bytes)
            self._reply_clients[(host, port)] = c
        return c

    def _end_hold(self, h: _Hold, why: str) -> None:
        """Caller holds the lock. Blocks go back to vLLM via done_sending."""
        self._holds.pop(h.key, None)
        self._ended[h.key] = why
        while len(self._ended) > _RECENT:
            self._ended.popitem(last=False)
        self._done_sending.add(h.req_id)
        if why == "expired":
            self._stats["leases_expired"] += 1

    def _advance_producer(self, now: float) -> None:
        with self._lock:
            holds = list(self._holds.values())
            for key, (_, exp) in list(self._early_dest.items()):
                if now >= exp:
                    del self._early_dest[key]
        for h in holds:
            with self._lock:
                if h.key not in self._holds:
                    continue
            if h.write_state == "posted":
                st = h.write.status()
                if st.state is kvt.State.PENDING:
                    continue
                if st.state is kvt.State.FAILED and not st.quiesced:
                    continue  # keep the blocks aside until nothing more can land (T3)
                ok = st.state is kvt.State.DONE
                if ok:
                    self._stats["bytes"] += h.write.nbytes
                else:
                    self._stats["failures"] += 1
                h.write_state = "notify"
                h.write_ok = ok
                h.write_reason = st.reason
                h.last_sent = 0.0
            if h.write_state == "notify":
                if now - h.last_sent > 0.05:
                    _, _, host, port = h.dest  # type: ignore[misc]
                    h.notify_cid = self._client_to(host, port).send(
                        Written(key=h.key, ok=h.write_ok, reason=h.write_reason))
                    h.last_sent = now
                if now >= h.expiry:  # consumer never acked: it is gone, and no write is in flight
                    with self._lock:
                        self._end_hold(h, "expired")
                continue
            with self._lock:
                if h.key not in self._holds:
                    continue
                if now >= h.expiry:
                    self._end_hold(h, "expired")
                    continue
                dest = h.dest
            if dest is not None and h.write_state == "none":
                self._post_write(h, dest, now)

    def _post_write(self, h: _Hold, dest: tuple[str, list[int], str, int], now: float) -> None:
        engine, dst_blocks, _, _ = dest
        src_blocks = h.block_ids[len(h.block_ids) - len(dst_blocks):] if len(dst_blocks) <= len(h.block_ids) else None
        fail = ""
        if src_blocks is None:
            fail = f"consumer asked for {len(dst_blocks)} blocks, producer has {len(h.block_ids)}"
        else:
            try:
                peer = self._consumer_peers.get(engine)
                if peer is None:
                    md = self._consumer_md.get(engine)
                    if md is None:
                        return  # hand-shake not seen yet (messages race); try next step
                    peer = self.agent.connect(md)
                    self._consumer_peers[engine] = peer
                layout = self._consumer_layouts[engine]
                remote = kvt.Segments.concat([lay.segments(np.asarray(dst_blocks, np.int64)) for lay in _remote_layouts(peer, layout)])
                local = kvt.Segments.concat([lay.segments(np.asarray(src_blocks, np.int64)) for lay in self._local_layouts])
                h.write = self.agent.write(peer, local, remote, timeout=self.cfg.transfer_timeout_s)
                h.write_state = "posted"
                self._stats["transfers"] += 1
                return
            except kvt.errors.KVTransportError as exc:
                fail = f"write refused: {exc}"
        h.write_state, h.write_ok, h.write_reason, h.last_sent = "notify", False, fail, 0.0

    def _on_producer_reply(self, msg: Msg) -> None:
        if not isinstance(msg, Reply):
            return
        with self._lock:
            for key, status in msg.status.items():
                h = self._holds.get(key)
                if h is None or h.write_state != "notify" or h.notify_cid != msg.cid:
                    continue
                # consumer acked ("ok") or no longer wants it ("unknown"): free either way
                self._end_hold(h, "done" if status == "ok" else "released")

    # ------------------------------------------------------------------ server thread
    def _handle(self, msg: Msg) -> Msg:
        now = time.monotonic()
        if isinstance(msg, Hello):
            assert self.layout is not None
            diff = self.layout.mismatch(msg.layout)
            if diff:
                return Error(code="layout", message=f"KV layout mismatch with {self.name}: {diff}")
            with self._lock:
                self._consumer_md[msg.engine_id] = msg.agent_md
                self._consumer_peers.pop(msg.engine_id, None)  # restarted consumer: reconnect
                self._consumer_layouts[msg.engine_id] = msg.layout
            return Welcome(engine_id=self.name, agent_md=self._agent_md, layout=self.layout)
        status: dict[str, str] = {}
        with self._lock:
            if isinstance(msg, (Done, Renew, Release, Cancel)):
                for key in msg.keys:
                    h = self._holds.get(key)
                    if h is None:
                        why = self._ended.get(key)
                        if why is None and isinstance(msg, (Release, Cancel)):
                            # before we learnt of the key: remember, free on arrival
                            self._ended[key] = "released"
                            self._early_dest.pop(key, None)
                            status[key] = "acked"
                        elif why is None:
                            status[key] = "pending"
                        else:
                            status[key] = "ok" if (why == "done" and isinstance(msg, Done)) else (
                                "acked" if isinstance(msg, (Release, Cancel)) else "expired")
                        continue
                    if now >= h.expiry and h.write_state not in ("posted", "notify"):
                        self._end_hold(h, "expired")
                        status[key] = "acked" if isinstance(msg, (Release, Cancel)) else "expired"
                        continue
                    if isinstance(msg, Done):
                        if msg.instance and msg.instance != self.agent.instance:
                            status[key] = "stale"  # read from our previous incarnation's memory
                            continue
                        self._end_hold(h, "done")
                        status[key] = "ok"
                    elif isinstance(msg, Renew):
                        h.expiry = now + self.cfg.lease_s
                        status[key] = "ok"
                    elif h.write_state == "posted":
                        status[key] = "pending"  # a write is in flight: no ack until it ends
                    else:
                        self._end_hold(h, "released")
                        status[key] = "acked"
            elif isinstance(msg, WriteReq):
                dest = (msg.engine_id, list(msg.block_ids), msg.reply_host, msg.reply_port)
                h = self._holds.get(msg.key)
                if msg.engine_id not in self._consumer_md and msg.key not in self._ended:
                    # we cannot write to a consumer we never hand-shook with (we restarted)
                    status[msg.key] = "hello"
                    if h is not None and h.dest is None:
                        h.dest = dest
                        h.expiry = now + self.cfg.lease_s
                    elif h is None:
                        self._early_dest[msg.key] = (dest, now + self.cfg.lease_s)
                elif h is not None:
                    if h.dest is None:
                        h.dest = dest
                    h.expiry = now + self.cfg.lease_s
                    status[msg.key] = "ok"
                elif msg.key in self._ended:
                    status[msg.key] = "expired"
                else:
                    self._early_dest[msg.key] = (dest, now + self.cfg.lease_s)
                    status[msg.key] = "pending"
            elif isinstance(msg, Written):
                rid = self._recv_by_key.get(msg.key)
                r = self._recv.get(rid) if rid else None
                if r is None or r.state not in ("write_wait", "cancel"):
                    status[msg.key] = "unknown"  # late / duplicate: dropped (R3)
                else:
                    if r.state == "write_wait":
                        r.written = msg.ok
                        if not msg.ok:
                            r.error = f"producer write failed: {msg.reason}"
                    # in "cancel": the write has ended, so nothing more can land -> ack = done
                    elif r.state == "cancel":
                        r.written = msg.ok
                    status[msg.key] = "ok"
            elif isinstance(msg, Aborted):
                for key in msg.keys:
                    rid = self._recv_by_key.get(key)
                    r = self._recv.get(rid) if rid else None
                    if r is not None:
                        r.peer_aborted = True
                        r.error = "producer aborted the request"
                    else:
                        h = self._holds.get(key)
                        if h is not None and h.write_state not in ("posted",):
                            self._end_hold(h, "released")
                    status[key] = "ok"
            else:
                return Error(code="unexpected", message=f"unexpected message {type(msg).__name__}")
        return Reply(status=status)


def _new_stats() -> dict[str, Any]:
    return {"bytes": 0, "transfers": 0, "failures": 0, "loads_ok": 0, "leases_expired": 0,
            "latency_s_sum": 0.0, "latency_s_max": 0.0}


def _side_channel_zero() -> dict[str, int]:
    return {"sc_auth_failures": 0, "sc_malformed": 0, "sc_version_mismatch": 0, "sc_dropped": 0}


def _num_blocks_of(region_len: int, stride: int, regions: list[tuple[int, int]], block_bytes: int) -> int:
    """How many blocks fit the peer's region after the largest part base."""
    base = max(b for _, b in regions)
    return max(1, (region_len - base - block_bytes) // stride + 1)


def _remote_layouts(peer: Any, layout: LayoutInfo) -> list[kvt.BlockLayout]:
    out = []
    for regions, stride in zip(layout.part_regions, layout.block_stride):
        parts = [(peer.region(rid), base) for rid, base in regions]
        out.append(kvt.BlockLayout(parts, layout.block_bytes,
                                   _num_blocks_of(peer.region(regions[0][0]).length, stride, regions, layout.block_bytes),
                                   stride))
    return out
