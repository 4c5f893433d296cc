"""Layer-wise WRITE: push each layer's KV of the prompt blocks completed so far from
``save_kv_layer``, while the next layers compute (opt-in: ``layerwise_write``).

Why: a whole-request WRITE starts only once the prefill has ended, so the decode engine
waits for the prefill *plus* the whole transfer. When the consumer's block ids reach the
producer before or during its prefill (the router flow: both hops dispatched at once),
each layer's blocks can be on their way as soon as that layer's attention has written
them; by the end of the prefill little or nothing is left to send.

Two halves, like the connector:

* :class:`LayerwisePlanner` (scheduler process): per step, for each prefill whose KV goes
  to a decode engine (``do_remote_decode``), the prompt block positions that are complete
  after this step and were not before (whole blocks; the prompt's last, partly filled
  block once the prompt is done: a block is sent when it is complete, so under chunked
  prefill a block filled across chunks is sent in the chunk that completes it). Carried in
  :class:`LayerwiseMetadata`, the normal metadata plus :class:`LayerJob` rows.
* :class:`LayerwiseWriter` (each worker): in ``save_kv_layer`` of the last layer of each
  group of ``layerwise_layers_per_post`` layers, one WRITE of that group's bytes of those
  blocks per job whose single destination is known (``Producer.early_dest``); the posts
  are polled each step. The producer's whole-request
  path then sends only what no early write covered (:meth:`uncovered`), and only after
  every early write has ended.

The WRITE invariants (docs/LIFECYCLE.md section 3) stay as strong:

* a key with an early write that may still land (being posted, in flight, or failed and
  not quiesced) is *in flight*: ``Producer.answer_give_up`` answers "pending" and
  ``Producer.end_hold`` refuses to end its hold (:meth:`in_flight`, under the lock);
* no early write is posted for a key that has ended (a cancel was acked: the consumer may
  reuse its blocks) or whose destination was withdrawn; the check and the "posting" mark
  are one step under the lock, so a cancel handled meanwhile sees the post;
* "written" is sent by the producer's hold only after every early write of the key has
  ended; an early write that failed makes the hold send everything again (once the failed
  one is quiesced), so "written ok" always means every byte landed. An aborted prefill
  never gets a hold, so never "written".
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import kvtransport as kvt
import numpy as np

from .context import WorkerContext
from .kv_layout import block_segments, head_slice, remote_layouts
from .messages import KVTransportMetadata
from .routing import producer_key
from .staging import KVDevice

log = logging.getLogger(__name__)

__all__ = ["LayerJob", "LayerwiseMetadata", "LayerwisePlanner", "LayerwiseWriter"]


# ------------------------------------------------------------------ scheduler side
@dataclass
class LayerJob:
    """Prompt blocks of ``req_id`` complete after this step and not before."""

    req_id: str
    key: str
    block_ids: list[int]  # the request's blocks at positions ``first`` .. ``end`` - 1
    first: int  # first block position (0: every complete block, so a destination known
    #: only now gets what earlier steps computed; the writer skips what it already posted)
    end: int  # one past the last
    prompt_blocks: int  # blocks of the whole prompt (the consumer's blocks pair with its tail)


@dataclass
class LayerwiseMetadata(KVTransportMetadata):
    layerwise: list[LayerJob] = field(default_factory=list)


@dataclass
class _Track:
    key: str
    prompt_tokens: int
    block_ids: list[int] = field(default_factory=list)


def _wants_remote_decode(params: Any) -> bool:
    if not isinstance(params, dict):
        return False
    v = params.get("do_remote_decode")
    return v is True or (isinstance(v, str) and v.lower() == "true")


class LayerwisePlanner:
    """Scheduler process: which prompt blocks each step completes, per remote-decode prefill."""

    def __init__(self, engine_id: str, block_size: int) -> None:
        self.engine_id = engine_id
        self.block_size = block_size
        self._reqs: dict[str, _Track] = {}

    def on_new_request(self, request: Any) -> None:
        if _wants_remote_decode(getattr(request, "kv_transfer_params", None)):
            rid = request.request_id
            self._reqs[rid] = _Track(producer_key(self.engine_id, rid), int(request.num_prompt_tokens))

    def forget(self, req_id: str) -> None:
        self._reqs.pop(req_id, None)

    def wrap(self, meta: KVTransportMetadata, scheduler_output: Any) -> LayerwiseMetadata:
        out = LayerwiseMetadata(recv=meta.recv, hold=meta.hold, notices=meta.notices)
        out.layerwise = self.plan(scheduler_output)
        return out

    def plan(self, so: Any) -> list[LayerJob]:
        for rid in getattr(so, "finished_req_ids", ()) or ():
            self._reqs.pop(rid, None)
        if not self._reqs:
            return []
        jobs: list[LayerJob] = []
        sched = so.num_scheduled_tokens
        for nr in so.scheduled_new_reqs:
            t = self._reqs.get(nr.req_id)
            if t is not None:
                t.block_ids = list(nr.block_ids[0]) if nr.block_ids else []
                self._job(jobs, nr.req_id, t, int(nr.num_computed_tokens), sched.get(nr.req_id, 0))
        cached = so.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", set()) or set()
        for i, rid in enumerate(cached.req_ids):
            t = self._reqs.get(rid)
            if t is None:
                continue
            new = cached.new_block_ids[i]
            if rid in resumed:
                t.block_ids = list(new[0]) if new else []
            elif new:
                t.block_ids += list(new[0])
            self._job(jobs, rid, t, int(cached.num_computed_tokens[i]), sched.get(rid, 0))
        return jobs

    def _job(self, jobs: list[LayerJob], rid: str, t: _Track, computed: int, scheduled: int) -> None:
        bs = self.block_size
        if computed >= t.prompt_tokens:  # decoding (max_tokens > 1): nothing of the prompt left
            return
        done = min(computed + scheduled, t.prompt_tokens)
        end = -(-done // bs) if done == t.prompt_tokens else done // bs
        end = min(end, len(t.block_ids))
        if end > computed // bs:  # this step completes blocks
            jobs.append(LayerJob(rid, t.key, t.block_ids[:end], 0, end, -(-t.prompt_tokens // bs)))


# ------------------------------------------------------------------ worker side
@dataclass
class _KeyWrites:
    """The early writes of one key, all to one destination. Positions are the prompt's
    block positions; arrays, so a step's bookkeeping is no Python loop per block."""

    engine: str
    dst_block_ids: list[int]
    load: str
    #: [layer, position]: that layer's bytes of the block pair below were posted
    posted: np.ndarray
    src_at: np.ndarray  # [position]: our block id posted there (-1: none)
    dst_at: np.ndarray  # [position]: the consumer's block id it went to
    open: list[Any] = field(default_factory=list)  # writes not ended (a failed one: not quiesced)
    posting: int = 0  # posts decided under the lock, agent.write not returned yet
    failed: bool = False
    touched: float = 0.0

    @classmethod
    def new(cls, engine: str, dst_block_ids: list[int], load: str, layers: int, blocks: int) -> _KeyWrites:
        return cls(engine, list(dst_block_ids), load, np.zeros((layers, blocks), bool),
                   np.full(blocks, -1, np.int64), np.full(blocks, -1, np.int64))

    def in_flight(self) -> bool:
        return self.posting > 0 or bool(self.open)


class LayerwiseWriter:
    """Worker: posts each layer's completed blocks to a destination known early.

    ``producer`` is the worker's :class:`~.producer.Producer` (its consumer hand-shakes,
    early destinations and ended keys); ``layer_index`` maps vLLM's layer names to the
    registered layouts; ``kv_device`` is the device ordering point run before each post."""

    def __init__(self, ctx: WorkerContext, producer: Any, layer_index: dict[str, int], kv_device: KVDevice,
                 layers_per_post: int = 0) -> None:
        self.ctx = ctx
        self.producer = producer
        self.layer_index = layer_index
        self.kv_device = kv_device
        #: consecutive layers sent in one post. Why not each layer alone: a post costs the
        #: engine thread about half a millisecond of Python (segments, validation, the
        #: backend's post), which the prefill pays once per layer and step; 8 posts per step
        #: keep the overlap (what is left after the prefill is the last group's bytes)
        self.layers_per_post = layers_per_post or max(1, -(-len(layer_index) // 8))
        self.jobs: list[LayerJob] = []
        self.keys: dict[str, _KeyWrites] = {}

    # -------------------------------------------------------------- engine thread
    def begin_step(self, meta: Any) -> None:
        """This step's jobs (none for metadata without layer-wise rows)."""
        self.jobs = list(getattr(meta, "layerwise", None) or [])

    def save_layer(self, layer_name: str) -> None:
        """``save_kv_layer``: post this layer's bytes of each job's completed blocks."""
        if not self.jobs:
            return
        layer = self.layer_index.get(layer_name)
        if layer is None:
            return
        group = self.layers_per_post
        if (layer + 1) % group and layer != len(self.layer_index) - 1:
            return  # posted with the last layer of its group, once that layer has been computed
        lo, hi = layer - layer % group, layer + 1
        for job in self.jobs:
            try:
                self._post_layers(job, lo, hi)
            except Exception as exc:  # a post refused: the hold's whole-request path sends it all
                log.warning("layer-wise WRITE of %s layers %d..%d refused: %s", job.key, lo, hi - 1, exc)

    def _post_layers(self, job: LayerJob, lo: int, hi: int) -> None:
        """Post layers ``[lo, hi)`` of this step's completed blocks of ``job``."""
        ctx, prod = self.ctx, self.producer
        with ctx.lock:
            early = prod.early_dest.get(job.key)
            if (early is None or len(early[0]) != 1 or job.key in prod.ended or job.key in prod.holds):
                return
            dest = early[0][0]
            if dest.readers != 1 or dest.engine not in prod.consumer_md or dest.engine not in prod.consumer_layouts:
                return  # several consumer ranks, or no hand-shake yet: the whole-request path
            if ctx.layout is None or prod.consumer_layouts[dest.engine].block_size != ctx.layout.block_size:
                return  # another block size: blocks pair by token position, in the whole-request path
            kw = self.keys.get(job.key)
            if kw is not None and (kw.dst_block_ids != dest.block_ids or kw.load != dest.load or kw.failed):
                return  # another destination than the early writes went to, or one failed
            if dest.engine not in prod.consumer_peers and dest.engine in getattr(prod, "retired_peers", {}):
                return  # a failed connection to replace: the whole-request path reconnects
            if kw is not None and kw.posted.shape[1] != job.prompt_blocks:
                return
            offset = job.prompt_blocks - len(dest.block_ids)  # the consumer's blocks pair with our tail
            pos = np.arange(max(job.first, offset), job.end)
            if not len(pos):
                return
            src = np.asarray(job.block_ids, np.int64)[pos - job.first]
            dst = np.asarray(dest.block_ids, np.int64)[pos - offset]
            if kw is not None:  # complete blocks not yet posted for this layer to the same blocks
                need = ~kw.posted[lo:hi, pos].all(axis=0) | (kw.src_at[pos] != src) | (kw.dst_at[pos] != dst)
                pos, src, dst = pos[need], src[need], dst[need]
                if not len(pos):
                    return
            else:
                kw = self.keys[job.key] = _KeyWrites.new(dest.engine, dest.block_ids, dest.load,
                                                         len(ctx.local_layouts), job.prompt_blocks)
            kw.posting += 1  # before the lock is released: a cancel now gets "pending"
            kw.touched = time.monotonic()
            md = prod.consumer_md[dest.engine]
            info = prod.consumer_layouts[dest.engine]
        write, posted = None, False
        try:
            # ordering point: this layer's KV of these blocks is complete in the registered memory
            self.kv_device.before_send(src.tolist())
            peer = prod.consumer_peers.get(dest.engine)
            if peer is None:  # first write to this consumer (a retired connection: see _post_layer)
                peer = ctx.agent.connect(md)
                prod.consumer_peers[dest.engine] = peer
            ours = ctx.layout.kv_heads if ctx.layout is not None else 0
            n = dest.num_heads
            remote = block_segments(head_slice(remote_layouts(peer, info), info.kv_heads, dest.dst_head,
                                               n or info.kv_heads)[lo:hi], dst)
            local = block_segments(head_slice(ctx.local_layouts, ours, dest.src_head, n or ours)[lo:hi], src)
            write = ctx.agent.write(peer, local, remote, timeout=ctx.cfg.transfer_timeout_s)
            posted = True
            log.debug("layer-wise WRITE %s: layers %d..%d, prompt blocks %d..%d", job.key, lo, hi - 1, int(pos[0]),
                      int(pos[-1]))
        finally:
            with ctx.lock:
                kw.posting -= 1
                if posted:
                    kw.open.append(write)
                    moved = (kw.src_at[pos] != src) | (kw.dst_at[pos] != dst)  # other blocks now
                    kw.posted[:, pos[moved]] = False
                    kw.src_at[pos], kw.dst_at[pos] = src, dst
                    kw.posted[lo:hi, pos] = True
                else:
                    kw.failed = True

    def poll(self, now: float) -> None:
        """Note which early writes have ended (a failed one only once quiesced: T3) and
        forget keys that ended with nothing in flight."""
        with self.ctx.lock:
            open_posts = [(kw, w) for kw in self.keys.values() for w in kw.open]
        for kw, w in open_posts:
            st = w.status()  # outside the lock: polling may drive the backend
            if st.state is kvt.State.PENDING or (st.state is kvt.State.FAILED and not st.quiesced):
                continue
            with self.ctx.lock:
                kw.open.remove(w)
                if st.state is kvt.State.DONE:
                    self.ctx.stats["bytes"] += w.nbytes
                else:
                    kw.failed = True
                    self.ctx.stats["failures"] += 1
        with self.ctx.lock:
            prod, lease = self.producer, self.ctx.cfg.lease_s
            for key in [k for k, kw in self.keys.items() if not kw.in_flight() and (
                    k in prod.ended or (k not in prod.holds and k not in prod.early_dest
                                        and now - kw.touched > lease))]:
                del self.keys[key]

    # -------------------------------------------------------------- under the lock
    def in_flight(self, key: str) -> bool:
        """An early write of ``key`` may still land in the consumer's blocks."""
        kw = self.keys.get(key)
        return kw is not None and kw.in_flight()

    def uncovered(self, key: str, dest: Any, src_groups: list[list[int]], dst_groups: list[list[int]]
                  ) -> tuple[list[list[int]], list[list[int]]]:
        """The (source, destination) block pairs the hold still has to write: those no early
        write covered in every layer to the same destination (all of them after a failed
        early write). Only called once no early write is in flight."""
        kw = self.keys.get(key)
        if (kw is None or kw.failed or len(src_groups) != 1 or kw.dst_block_ids != list(dest.block_ids)
                or kw.load != dest.load):
            return src_groups, dst_groups
        s = np.asarray(src_groups[0], np.int64)
        d = np.asarray(dst_groups[0], np.int64)
        n = kw.posted.shape[1]
        at = np.arange(len(s)) + (n - len(s))  # the pairs end at the prompt's last block
        inside = at >= 0
        at = np.clip(at, 0, max(n - 1, 0))
        covered = inside & kw.posted[:, at].all(axis=0) & (kw.src_at[at] == s) & (kw.dst_at[at] == d)
        return [s[~covered].tolist()], [d[~covered].tolist()]
