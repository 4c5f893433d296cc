"""Worker half of KVTransportConnector: moves the bytes and keeps the contracts.

Runs in each vLLM worker (one per TP rank). Everything here is driven from vLLM's
per-step hooks (``start_load_kv`` .. ``get_finished``) and never blocks on a peer: the
side channel is asynchronous and transfers are polled. A side-channel server thread
answers peers; it touches the lock-protected tables, and the agent only to answer the doctor's
probes (the agent has its own lock; the probe write is posted, never waited for).

:class:`KVTransportWorker` is the facade the connector calls; the work is in

* :mod:`.kv_layout` — our KV tensors and the peer's as kvtransport block layouts;
* :mod:`.consumer` — per request, the load state machine (READ read-then-confirm, WRITE
  wait-for-written or cancel-until-acked);
* :mod:`.producer` — per finished prefill, the hold under a lease and the WRITE;
* :mod:`.handlers` — one side-channel handler per message type;
* :mod:`.context` — what they share: configuration, agent, stats, the one lock;
* :mod:`.staging` — the two device ordering points (and host staging): KV complete on
  the device before holds and writes (:meth:`on_metadata`), received blocks in the device
  cache before loads are reported (:meth:`get_finished`). docs/LIFECYCLE.md section 6.

Invariants kept here (docs/RELIABILITY.md): every request id reaches ``get_finished``
at most once and only while vLLM tracks it (R3); a hold whose write may be in flight
(POSTING or POSTED) is never ended or acknowledged, and a consumer whose write request
may have left frees its blocks only on the producer's word that the write has ended or
when the producer is known gone (the stale-write invariant, see :mod:`.producer`).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import kvtransport as kvt

from .config import ConnectorConfig, ConnectorConfigError, rank_port
from .consumer import Consumer, plan_ranks
from .context import WorkerContext, new_stats
from .discovery import DiscoveryHeartbeat, start_discovery
from .handlers import SideChannelHandlers
from .kv_groups import GroupInfo
from .kv_layout import KVLayoutError, check_uniform, describe_kv_caches
from .layerwise import LayerwiseWriter
from .load_stats import stats_empty
from .messages import Aborted, KVTransportMetadata, LayoutInfo, PeerNotice, Release, Renew
from .producer import Producer
from .read_confirmer import ReadConfirmer
from .side_channel import SideChannelServer, wait_for_any
from .ssm_tp import StateGeometry
from .staging import Fence, HostKV, HostStaging, KVDevice, make_kv_device, merge_group_ids
from .transfer_watcher import TransferWatcher
from .tp_mapping import TPMappingError
from .written_notifier import WrittenNotifier

log = logging.getLogger(__name__)

#: Longest a step's get_finished waits for a producer's reply to a load that needs nothing
#: else (see KVTransportWorker._await_replies).
REPLY_WAIT_S = 0.002

__all__ = ["KVTransportWorker", "ModelInfo", "KVLayoutError", "describe_kv_caches"]


@dataclass(frozen=True)
class ModelInfo:
    """The model facts a hand-shake compares (docs/VLLM.md, Compatibility check)."""

    name: str  # served model name
    dtype: str  # model dtype
    total_kv_heads: int
    kv_heads: int  # this rank's
    head_size: int


class KVTransportWorker:
    def __init__(self, cfg: ConnectorConfig, block_size: int, num_blocks: int, dtype: str, tp_rank: int = 0,
                 tp_size: int = 1, dp_rank: int = 0, model: ModelInfo | None = None,
                 groups: list[GroupInfo] | None = None) -> None:
        self.cfg = cfg
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.dtype = dtype
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.name = f"{cfg.engine_id}-tp{tp_rank}"
        self.port = rank_port(cfg.side_channel_port, dp_rank, tp_size, tp_rank)  # docs/VLLM.md, Data parallel
        self._dp_rank = dp_rank
        #: registration with vllm-router's service discovery (discovery.py), when configured
        self._discovery: DiscoveryHeartbeat | None = None
        self.server: SideChannelServer | None = None
        #: seals/opens every side-channel message (None only if explicitly disabled)
        self._auth = cfg.make_authenticator()
        self.ctx = WorkerContext(cfg, self.name, self.port, tp_rank, self._auth, tp_size)
        #: what the hand-shake compares besides the cache itself (None: not known)
        self.model = model
        #: KV cache groups (hybrid models: several, each with its own block ids)
        self.groups = groups or []
        self.consumer = Consumer(self.ctx)
        self.producer = Producer(self.ctx)
        self.handlers = SideChannelHandlers(self.ctx, self.producer, self.consumer)
        self._notices: list[tuple[PeerNotice, float]] = []
        #: side-channel refusal totals at the last take_stats(), to report differences
        self._side_channel_reported = _side_channel_zero()
        #: set per step by the connector: no forward ran, so get_finished may wait briefly
        #: for a WRITE's "written" too, not only a READ's confirmation (_await_replies)
        self.may_wait_for_replies = True
        #: the last metadata taken (on_metadata is offered each step's metadata twice)
        self._taken_meta: KVTransportMetadata | None = None
        #: (holds, loads) in flight at the last take_stats(), reported again only when changed
        self._in_flight_reported = (0, 0)
        #: totals of side-channel sockets already closed (shutdown), so totals never go down
        self._side_channel_closed = _side_channel_zero()
        #: device ordering / host staging policy, set when the KV caches are registered
        self.kv_device: KVDevice = HostKV()
        #: staged loads not yet copied: req id -> (the blocks to copy into the device cache,
        #: their group sizes)
        self._staged_loads: dict[str, tuple[list[int], list[int]]] = {}
        #: staged loads whose device copy is enqueued: reported once the fence is ready (polled)
        self._copying: list[tuple[Fence, set[str]]] = []
        #: layer-wise WRITE (layerwise_write): set when the KV caches are registered
        self.layerwise: LayerwiseWriter | None = None
        #: threads acting when a transfer ends (written_notifier.py, read_confirmer.py)
        self._helpers: list[TransferWatcher] = []
        self._confirmer: ReadConfirmer | None = None
        #: when the latest get_finished calls handed their loads to vLLM: a load's "step"
        #: phase ends at the first of them after it settled (load_stats.LoadClock.phases)
        self._step_ends: deque[float] = deque(maxlen=64)

    # ------------------------------------------------------------------ shared state
    @property
    def agent(self) -> kvt.Agent | None:
        """This worker's kvtransport agent (None before the KV caches are registered and
        after shutdown): its ``stats()`` and peers are the transport's own view."""
        return self.ctx.agent

    @property
    def layout(self) -> LayoutInfo | None:
        """Our KV layout as the hand-shake advertises it (None before registration)."""
        return self.ctx.layout

    # ------------------------------------------------------------------ set-up
    def register_kv_caches(self, kv_caches: dict[str, Any], attn_backends: list[str] | None = None,
                           state: StateGeometry | None = None) -> None:
        """``attn_backends``: the names of vLLM's attention backends of these layers (which
        decide whether engines of different block sizes can pair; block_sizes.py).
        ``state``: hybrid models, where the Mamba state lies in each state layer's page (its
        layers are those of the KV cache groups that are state groups; ssm_tp.py)."""
        m = self.model
        layers = describe_kv_caches(kv_caches, self.num_blocks, m.kv_heads if m else 0, self.block_size)
        check_uniform(layers)
        self._check_staging_mode()
        self._kv_caches = kv_caches  # keep tensors alive while registered
        ctx = self.ctx
        group_of = {name: g for g, info in enumerate(self.groups) for name in info.layers}
        ctx.layer_group = [group_of.get(name, 0) for name in kv_caches] if len(self.groups) > 1 else []
        state_groups = {g for g, info in enumerate(self.groups) if info.state}
        ctx.state_layers = frozenset(i for i, g in enumerate(ctx.layer_group) if g in state_groups)
        # staged: each layer copies its own group's blocks (hybrid groups alias one allocation)
        self.kv_device = make_kv_device(layers, self.cfg.kv_buffer_device, ctx.layer_group)
        layers = self.kv_device.registered(layers)  # staged: the host mirror, not the cache
        opts = dict(self.cfg.backend_options)
        opts.setdefault("default_timeout_s", self.cfg.transfer_timeout_s)
        opts["name"] = self.name
        ctx.agent = kvt.open(self.cfg.backend, **opts)
        part_regions, strides = [], []
        try:
            for lm in layers:
                # The real kind and device: a backend that cannot move GPU memory refuses it
                # here, naming the installed backends that can, instead of taking it as CPU.
                region = ctx.agent.register((lm.addr, lm.nbytes), kind=lm.kind, device=lm.device)
                ctx.local_layouts.append(kvt.BlockLayout([(region, b) for b in lm.bases], lm.block_bytes,
                                                         self.num_blocks, lm.block_stride))
                part_regions.append([(region.id, b) for b in lm.bases])
                strides.append(lm.block_stride)
        except Exception:  # a refused cache must not leave an open agent behind
            ctx.agent.close()
            ctx.agent = None
            ctx.local_layouts.clear()
            raise
        ctx.layout = LayoutInfo(
            block_size=self.block_size,
            dtype=self.dtype,
            num_layers=len(layers),
            block_bytes=layers[0].block_bytes,
            parts_per_layer=len(layers[0].bases),
            tp_size=self.tp_size,
            part_regions=part_regions,
            block_stride=strides,
            model=m.name if m else "",
            model_dtype=m.dtype if m else "",
            total_kv_heads=m.total_kv_heads if m else 0,
            kv_heads=m.kv_heads if m else 0,
            head_size=m.head_size if m else 0,
            attn_layout=layers[0].attn_layout,
            attn_backends=list(attn_backends or []),
            state=state if ctx.state_layers else None,
            kv_groups=max(1, len(self.groups)),
        )
        ctx.agent_md = ctx.agent.metadata()
        self._start_layerwise(list(kv_caches))
        if self.cfg.is_producer and self.cfg.mode == "write":
            self._helpers.append(WrittenNotifier(self.producer, ctx.new_client, self.name))
        if self.cfg.is_consumer and self.cfg.mode == "read":
            self._confirmer = ReadConfirmer(self.consumer, ctx.new_client, self.name)
            self._helpers.append(self._confirmer)
            self.consumer.read_confirmer_alive = self._confirmer.alive
        try:
            self.server = SideChannelServer(
                self.cfg.side_channel_host,
                self.port,
                self.handlers,
                auth=self._auth,
                max_message_bytes=self.cfg.max_message_bytes,
                bind_host=self.cfg.side_channel_bind_host,
            )
        except Exception:
            self._close_helpers()
            ctx.agent.close()
            ctx.agent = None
            raise
        log.info("kvtransport worker %s: %d layers, %s backend, side channel %s:%d, KV memory: %s",
                 self.name, len(layers), self.cfg.backend, self.cfg.side_channel_host, self.port,
                 self.kv_device.describe())
        if self.tp_rank == 0:  # one registration per engine, once its side channel listens
            self._discovery = start_discovery(self.cfg.discovery, producer=self.cfg.is_producer,
                                              host=self.cfg.side_channel_host, side_channel_port=self.port,
                                              mode=self.cfg.mode, tp_size=self.tp_size, dp_rank=self._dp_rank)

    def _check_staging_mode(self) -> None:
        """Host staging on a READ-mode producer is refused: the consumer may read our host
        buffer as soon as the scheduler has returned kv_transfer_params, which can be
        before this worker learns of the hold and copies the blocks into that buffer, so a
        read could return another request's bytes. (A READ consumer and both WRITE sides
        stage safely: they copy before the transport can touch those host blocks.)"""
        if self.cfg.kv_buffer_device == "cpu" and self.cfg.is_producer and self.cfg.mode == "read":
            raise ConnectorConfigError(
                f"KVTransportConnector: kv_buffer_device 'cpu' (host staging) is not supported on a producer "
                f"(kv_role {self.cfg.kv_role!r}) in mode 'read': the consumer could read the host buffer before "
                "the blocks are copied into it. Use mode 'write' on both engines, or kv_buffer_device 'auto' on "
                "the producer with a backend that moves its KV memory directly (docs/GPU.md)."
            )

    def _start_layerwise(self, layer_names: list[str]) -> None:
        """layerwise_write on a producer: post each layer's blocks from save_kv_layer. One
        KV cache group only (a hybrid model's groups pair blocks per group: refused here)."""
        if not (self.cfg.layerwise_write and self.cfg.is_producer):
            return
        if self.ctx.layer_group:
            self.ctx.agent.close()
            self.ctx.agent = None
            raise ConnectorConfigError(
                "KVTransportConnector: layerwise_write supports models with one KV cache group; this model has "
                f"{len(set(self.ctx.layer_group))} (hybrid). Drop layerwise_write for it.")
        self.layerwise = LayerwiseWriter(self.ctx, self.producer, {n: i for i, n in enumerate(layer_names)},
                                         self.kv_device, self.cfg.layerwise_layers_per_post)
        self.producer.layerwise = self.layerwise

    def save_kv_layer(self, layer_name: str) -> None:
        """vLLM's per-layer hook, right after ``layer_name``'s attention wrote its KV."""
        if self.layerwise is not None:
            self.layerwise.save_layer(layer_name)

    def shutdown(self) -> None:
        if self._discovery is not None:  # first: the router stops sending before we stop serving
            self._discovery.close()
            self._discovery = None
        self._side_channel_closed = self._side_channel_totals()
        if self.server is not None:
            self.server.close()
            self.server = None
        for p in self.consumer.peers.values():
            p.client.close()
        for c in self.ctx.reply_clients.values():
            c.close()
        self.consumer.peers.clear()
        self.ctx.reply_clients.clear()
        self._close_helpers()  # before the agent: it polls the agent's transfers
        if self.ctx.agent is not None:
            self.ctx.agent.close()
            self.ctx.agent = None
        self._copying.clear()
        self.kv_device.close()  # after the agent: the transport no longer uses the mirror

    def _close_helpers(self) -> None:
        for helper in self._helpers:
            helper.close()
        self._helpers, self._confirmer = [], None

    # ------------------------------------------------------------------ per step
    def on_metadata(self, meta: KVTransportMetadata | None) -> None:
        """Take this step's new work from the scheduler half (once per metadata object: the
        connector offers it at handle_preemptions, at bind and at start_load_kv)."""
        if self.layerwise is not None and meta is not self._taken_meta:
            self.layerwise.begin_step(meta)  # this step's blocks (none without metadata)
        if meta is None or meta is self._taken_meta:
            return
        self._taken_meta = meta
        if meta.hold:
            # Ordering point 1 (LIFECYCLE.md section 6): the KV of these blocks is complete
            # (and, staged, in the host buffer) before any hold is offered or written.
            self.kv_device.before_send(*merge_group_ids((j.block_ids, j.group_sizes) for j in meta.hold))
        if isinstance(self.kv_device, HostStaging):
            for job in meta.recv:
                if not job.refused:
                    self._staged_loads.setdefault(job.req_id, (list(job.local_block_ids), list(job.group_sizes)))
        now = time.monotonic()
        with self.ctx.lock:
            self.consumer.add(meta.recv, now)
            self.producer.add(meta.hold, now)
        for n in meta.notices:
            self._notices.append((n, now))

    def progress(self, finished_req_ids: set[str] | frozenset[str] = frozenset()) -> None:
        """Advance every transfer; safe to call any number of times per step."""
        now = time.monotonic()
        if self.ctx.agent is not None:
            self.ctx.agent.progress()
        self.consumer.mark_aborted(finished_req_ids)
        self._send_notices()
        self._poll_replies()
        self.consumer.advance(now)
        if self.layerwise is not None:
            self.layerwise.poll(now)
        self.producer.advance(now)
        self.consumer.renew(now)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self.progress(finished_req_ids)
        clients, writes = self.consumer.awaiting_replies()
        if clients or (writes and self.may_wait_for_replies):
            self._await_replies(REPLY_WAIT_S, writes_too=self.may_wait_for_replies)
        with self.ctx.lock:
            sending, self.producer.done_sending = self.producer.done_sending, set()
            recving, self.consumer.done_recving = self.consumer.done_recving, set()
            staged = bool(self._staged_loads)  # host staging only; nothing to do otherwise
            failed = self.consumer.failed_recving & recving if staged else set()
        if staged:
            recving = self._copy_staged_loads(recving, failed, finished_req_ids)
        if self._copying:
            recving |= self._copies_done()
        step_end = time.monotonic()  # after any staging copy: "report" ends when vLLM is told
        self._step_ends.append(step_end)
        if recving:
            with self.ctx.lock:
                self.consumer.report(recving, step_end, self._step_ends)
        return (sending or None), (recving or None)

    def _copy_staged_loads(self, recving: set[str], failed: set[str], finished_req_ids: set[str]) -> set[str]:
        """Ordering point 2 (LIFECYCLE.md section 6): loads finished now were received in
        the host buffer; enqueue the copy of their blocks into the device cache, to be
        reported once it is done (:meth:`_copies_done`). Returns the loads to report now:
        failed loads are not copied (vLLM recomputes those blocks), nor are requests vLLM
        has finished (aborted): their blocks may already be someone else's."""
        for rid in finished_req_ids:
            self._staged_loads.pop(rid, None)
        copied: set[str] = set()
        jobs: list[tuple[list[int], list[int]]] = []
        for rid in recving:
            entry = self._staged_loads.pop(rid, None)
            if entry is not None and rid not in failed:
                copied.add(rid)
                jobs.append(entry)
        if copied:
            self._copying.append((self.kv_device.after_receive(*merge_group_ids(jobs)), copied))
        return recving - copied

    def _copies_done(self) -> set[str]:
        """The staged loads whose copy into the device cache has completed (fences polled,
        never waited for: the forward in flight keeps running while the engine schedules)."""
        done: set[str] = set()
        waiting = []
        for fence, rids in self._copying:
            if fence.query():
                done |= rids
            else:
                waiting.append((fence, rids))
        self._copying = waiting
        return done

    def _await_replies(self, budget_s: float, writes_too: bool) -> None:
        """Give loads that only wait for the producer's word up to ``budget_s`` to get it
        before this step ends (else they are reported a step, a whole forward, later). A READ's
        confirmation is awaited in every step: it was just sent, for a transfer that has ended.
        A WRITE's "written" (``writes_too``) only in steps without a forward (the connector
        sets ``may_wait_for_replies``): it may be many steps away. Bounded: a silent peer costs
        a step at most ``budget_s``. Measured (docs/bench/E2E_LATENCY.md, kv-70b, concurrency
        8): the connector's own time per READ load 38 ms -> 8 ms, its report phase 26 -> 0.1 ms."""
        give_up = time.monotonic() + budget_s
        while (left := give_up - time.monotonic()) > 0:
            self.consumer.settle_event.clear()  # before looking: what settles after it sets it
            clients, writes = self.consumer.awaiting_replies()
            writes = writes if writes_too else []
            if not clients and not writes:
                return
            # the read confirmer settles loads and sets the event; answers to our own resends
            # wait for the next step (sockets and an event together are polled: CPU)
            event = self.consumer.settle_event if writes or self._confirmer is not None else None
            if any(r.written is not None for r in writes):
                self.consumer.settle_event.set()
            if not wait_for_any([] if self._confirmer is not None else clients, event, left):
                return
            self.progress()

    def take_failed_recving(self) -> set[str]:
        with self.ctx.lock:
            out, self.consumer.failed_recving = self.consumer.failed_recving, set()
        return out

    def take_load_errors(self) -> set[int]:
        with self.ctx.lock:
            out, self.consumer.load_errors = self.consumer.load_errors, set()
        return out

    def take_stats(self) -> dict[str, Any] | None:
        """Counters since the last call; None when nothing changed (vLLM asks every step, and
        most steps move no KV). Side-channel refusals are running totals kept by the sockets
        (the server's thread counts them), reported as the difference to the last call."""
        with self.ctx.lock:
            in_flight = (len(self.producer.holds), len(self.consumer.recv))
            totals = self._side_channel_totals()
            if stats_empty(self.ctx.stats) and (in_flight, totals) == (self._in_flight_reported,
                                                                       self._side_channel_reported):
                return None
            out, self.ctx.stats = self.ctx.stats, new_stats()
            if in_flight != self._in_flight_reported:  # gauges: reported when they change
                out["holds_in_flight"], out["loads_in_flight"] = in_flight
                self._in_flight_reported = in_flight
            for k, v in totals.items():
                out[k] = v - self._side_channel_reported[k]
            self._side_channel_reported = totals
        return out

    def _side_channel_totals(self) -> dict[str, int]:
        """Side-channel messages refused since start, server and every client together:
        failed authentication, malformed, wrong protocol version; and refusals the
        server's failure rate limit dropped without a reply (also counted by reason)."""
        out = dict(self._side_channel_closed)
        names = {"sc_auth_failures": "auth", "sc_malformed": "malformed", "sc_version_mismatch": "version",
                 "sc_dropped": "dropped"}
        counters = [self.server.counters] if self.server is not None else []
        counters += [p.client.counters for p in self.consumer.peers.values()]
        counters += [c.counters for c in self.ctx.reply_clients.values()]  # clients: auth and malformed only
        for c in counters:
            for key, name in names.items():
                out[key] += c.get(name, 0)
        return out

    # ------------------------------------------------------------------ side-channel replies
    def _poll_replies(self) -> None:
        for msg in self.consumer.poll_replies():
            self.consumer.on_reply(msg)
        for msg in self.producer.poll_replies():
            self.producer.on_reply(msg)

    def _send_notices(self) -> None:
        """Tell peers what the scheduler decided without a transfer: "release" (won't
        read), "aborted", and "renew" for consumer requests still queued for blocks."""
        if not self._notices:
            return
        notices, self._notices = self._notices, []
        renew: dict[tuple[str, int], list[str]] = {}
        for n, _ in notices:
            if n.kind == "aborted":
                with self.ctx.lock:
                    self.producer.note_aborted(n.key)
            for port, readers in self._notice_targets(n).items():
                if n.kind == "renew":  # queued consumer request (scheduler side): keep X's lease
                    renew.setdefault((n.host, port), []).append(n.key)
                    continue
                client = self.ctx.client_to(n.host, port)
                client.send(Release(keys=[n.key], rank=self.tp_rank, readers=readers) if n.kind == "release"
                            else Aborted(keys=[n.key]))
        for (host, port), keys in renew.items():
            self.ctx.client_to(host, port).send(Renew(keys=keys))

    def _notice_targets(self, n: PeerNotice) -> dict[int, int]:
        """The peer ports a notice goes to, with the readers each waits for: the producer
        ranks this rank loads from or releases (tp_mapping); equal TP sizes (or a notice
        to a consumer): the peer rank of our rank. Heads that cannot be mapped: each
        producer rank is told by one consumer rank."""
        if n.kind == "aborted" and self.cfg.is_producer and not self.cfg.is_consumer:
            return {n.port + self.tp_rank: 1}
        try:
            _, ranks = plan_ranks(self.ctx, n.remote_tp)
        except TPMappingError:
            ranks = {q: 1 for q in range(n.remote_tp or self.tp_size) if q % self.tp_size == self.tp_rank}
        return {n.port + q: readers for q, readers in ranks.items()}


def _side_channel_zero() -> dict[str, int]:
    return {"sc_auth_failures": 0, "sc_malformed": 0, "sc_version_mismatch": 0, "sc_dropped": 0}
