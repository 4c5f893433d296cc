"""Side-channel requests a worker answers: one handler per message type.

The :class:`~.side_channel.SideChannelServer` thread calls :class:`SideChannelHandlers`
with each authenticated, decoded request; a dispatch table keyed by the message's type
picks its handler, and a type without one gets ``Error(code="unexpected")``. Handlers
run on the server thread, so each takes the worker lock and only reads or changes the
lock-protected tables of the :class:`~.producer.Producer` (holds: Done, Renew, Release,
Cancel, WriteReq, Hello) and the :class:`~.consumer.Consumer` (loads: Written, and
Aborted, which may be about either). They never call the agent and never block.

The exception is :class:`DoctorProbes`, the engine's side of ``kvtransport doctor``:
its requests touch no hold and no load, but one of them makes the engine WRITE one of
its own blocks into the doctor's scratch memory. It posts that write and answers at once
(the doctor asks again for the outcome), so it never blocks either; the agent is safe to
call from this thread (it takes its own lock). The engine's memory is only ever read.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import kvtransport as kvt
from kvtransport.metadata import decode_metadata

from .compat import refusal
from .consumer import Consumer
from .context import WorkerContext
from .kv_layout import block_segments
from .messages import (
    DOCTOR_AGENT_PREFIX,
    Aborted,
    Cancel,
    Done,
    Error,
    Hello,
    Msg,
    Probe,
    ProbeInfo,
    ProbeResult,
    ProbeStatus,
    ProbeWrite,
    Release,
    Renew,
    Reply,
    Welcome,
    WriteReq,
    Written,
)
from .producer import Producer

__all__ = ["SideChannelHandlers", "DoctorProbes"]

log = logging.getLogger(__name__)


class SideChannelHandlers:
    """``handlers(msg) -> reply``: the worker's side-channel server handler."""

    def __init__(self, ctx: WorkerContext, producer: Producer, consumer: Consumer) -> None:
        self.ctx, self.producer, self.consumer = ctx, producer, consumer
        self._table: dict[type[Msg], Callable[[Msg, float], Msg]] = {
            Hello: self.on_hello,
            Done: self.on_done,
            Renew: self.on_renew,
            Release: self.on_give_up,
            Cancel: self.on_give_up,
            WriteReq: self.on_write_req,
            Written: self.on_written,
            Aborted: self.on_aborted,
        }
        #: the doctor's requests, apart: they serve no request and change no hold or load
        self.doctor = DoctorProbes(ctx)
        self._doctor_table: dict[type[Msg], Callable[[Any], Msg]] = {
            Probe: self.doctor.on_probe,
            ProbeWrite: self.doctor.on_probe_write,
            ProbeStatus: self.doctor.on_probe_status,
        }

    def __call__(self, msg: Msg) -> Msg:
        handler = self._table.get(type(msg))
        if handler is None and type(msg) in self._doctor_table:
            return self._doctor_table[type(msg)](msg)
        if handler is None:
            return Error(code="unexpected", message=f"unexpected message {type(msg).__name__}")
        return handler(msg, time.monotonic())

    def on_hello(self, msg: Hello, now: float) -> Msg:
        """A consumer hand-shakes: check layouts, remember its agent, send ours."""
        layout = self.ctx.layout
        assert layout is not None
        diff = refusal(layout, msg.layout, "prefill", "decode")
        if diff:
            return Error(code="layout", message=f"KV layout mismatch (incompatible KV caches) with {self.ctx.name}, "
                                                f"no byte moved: {diff}")
        with self.ctx.lock:
            self.producer.on_hello(msg)
        return Welcome(engine_id=self.ctx.name, agent_md=self.ctx.agent_md, layout=layout)

    def on_done(self, msg: Done, now: float) -> Reply:
        """READ mode: the consumer read these keys; "ok" frees them, inside the lease only."""
        with self.ctx.lock:
            return Reply(status={k: self.producer.answer_done(k, msg.instance, now, msg.rank, msg.readers, msg.load)
                                 for k in msg.keys})

    def on_renew(self, msg: Renew, now: float) -> Reply:
        with self.ctx.lock:
            return Reply(status={k: self.producer.answer_renew(k, now) for k in msg.keys})

    def on_give_up(self, msg: Release | Cancel, now: float) -> Reply:
        """Release (won't read) and Cancel (WRITE: stop writing): "acked" only once no
        write of ours can land in the consumer's blocks any more."""
        with self.ctx.lock:
            return Reply(status={k: self.producer.answer_give_up(k, now, msg.rank, msg.readers) for k in msg.keys})

    def on_write_req(self, msg: WriteReq, now: float) -> Reply:
        with self.ctx.lock:
            answer = self.producer.answer_write_req(msg, now)
        if answer == "pending":  # the order layer-wise WRITE needs (a router dispatching both hops)
            log.debug("write request for %s came before its prefill: destination kept", msg.key)
        return Reply(status={msg.key: answer})

    def on_written(self, msg: Written, now: float) -> Reply:
        with self.ctx.lock:
            return Reply(status={msg.key: self.consumer.answer_written(msg)})

    def on_aborted(self, msg: Aborted, now: float) -> Reply:
        """The peer aborted the request behind each key: our load of it ends early, or
        our hold of it is released (unless our write into it is in flight)."""
        with self.ctx.lock:
            for key in msg.keys:
                if not self.consumer.answer_peer_aborted(key):
                    self.producer.answer_aborted(key)
            return Reply(status={k: "ok" for k in msg.keys})


class DoctorProbes:
    """The engine's answers to ``kvtransport doctor`` (one probe write at a time).

    Safety: the only bytes moved are one of this engine's blocks, read from its KV cache
    and written into memory the doctor registered. The doctor's agent is connected only
    under a name starting with :data:`~.messages.DOCTOR_AGENT_PREFIX` (so it cannot replace
    a real peer, which would fail that peer's transfers) and disconnected once its write
    has ended, or when the next probe replaces it."""

    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self._lock = threading.Lock()
        #: (doctor agent name, its peer, the write into its memory) of the last probe
        self._probe: tuple[str, Any, Any] | None = None

    def on_probe(self, msg: Probe) -> Msg:
        ctx = self.ctx
        if ctx.layout is None or ctx.agent is None:
            return Error(code="not_ready", message=f"{ctx.name} has not registered its KV cache yet")
        return ProbeInfo(engine_id=ctx.name, kv_role=ctx.cfg.kv_role, mode=ctx.cfg.mode, backend=ctx.cfg.backend,
                         tp_rank=ctx.tp_rank, agent_md=ctx.agent_md, layout=ctx.layout)

    def on_probe_write(self, msg: ProbeWrite) -> Msg:
        ctx = self.ctx
        if ctx.agent is None:
            return ProbeResult(state="refused", detail=f"{ctx.name} has no open agent")
        if min(msg.block_id, msg.region_id, msg.offset) < 0:
            return ProbeResult(state="refused", detail="block_id, region_id and offset must be >= 0")
        try:
            name = decode_metadata(msg.agent_md).agent
        except kvt.errors.KVTransportError as exc:
            return ProbeResult(state="refused", detail=f"unusable doctor agent metadata: {exc}")
        if not name.startswith(DOCTOR_AGENT_PREFIX):
            return ProbeResult(state="refused",
                               detail=f"probe agent {name!r} is not a doctor agent ({DOCTOR_AGENT_PREFIX}...)")
        with self._lock:
            self._end()
            if name in ctx.agent.peers:
                return ProbeResult(state="refused", detail=f"agent name {name!r} is already a peer of {ctx.name}")
            peer = None
            try:
                peer = ctx.agent.connect(msg.agent_md)
                local = block_segments(ctx.local_layouts, [msg.block_id])
                starts = np.concatenate([[0], np.cumsum(local.length)[:-1]]).astype(np.uint64)
                remote = kvt.Segments(msg.region_id, np.uint64(msg.offset) + starts, local.length)
                write = ctx.agent.write(peer, local, remote, timeout=ctx.cfg.transfer_timeout_s)
            except (kvt.errors.KVTransportError, ValueError, IndexError, OverflowError) as exc:
                if peer is not None:
                    ctx.agent.disconnect(peer)
                return ProbeResult(state="failed", detail=f"{type(exc).__name__}: {exc}")
            self._probe = (name, peer, write)
        return ProbeResult(state="posted", detail=f"{local.nbytes} bytes of block {msg.block_id}")

    def on_probe_status(self, msg: ProbeStatus) -> Msg:
        with self._lock:
            if self._probe is None or self._probe[0] != msg.doctor:
                return ProbeResult(state="unknown", detail="no probe write of this doctor")
            st = self._probe[2].status()
            if not st.done:
                return ProbeResult(state="pending")
            ok = st.state is kvt.State.DONE
            if ok or st.quiesced:
                self._end()
            return ProbeResult(state="done" if ok else "failed", detail=st.reason)

    def _end(self) -> None:
        """Disconnect the last probe's doctor agent (its unfinished write fails)."""
        if self._probe is None:
            return
        _, peer, _ = self._probe
        self._probe = None
        try:
            self.ctx.agent.disconnect(peer)
        except kvt.errors.KVTransportError:
            pass  # already replaced or the agent closed: nothing left to drop
