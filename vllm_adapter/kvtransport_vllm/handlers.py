"""Side-channel requests a worker answers: one handler per message type.

The :class:`~.side_channel.SideChannelServer` thread calls :class:`SideChannelHandlers`
with each authenticated, decoded request; a dispatch table keyed by the message's type
picks its handler, and a type without one gets ``Error(code="unexpected")``. Handlers
run on the server thread, so each takes the worker lock and only reads or changes the
lock-protected tables of the :class:`~.producer.Producer` (holds: Done, Renew, Release,
Cancel, WriteReq, Hello) and the :class:`~.consumer.Consumer` (loads: Written, and
Aborted, which may be about either). They never call the agent and never block.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from .consumer import Consumer
from .context import WorkerContext
from .messages import (
    Aborted,
    Cancel,
    Done,
    Error,
    Hello,
    Msg,
    Release,
    Renew,
    Reply,
    Welcome,
    WriteReq,
    Written,
)
from .producer import Producer

__all__ = ["SideChannelHandlers"]


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

    def __call__(self, msg: Msg) -> Msg:
        handler = self._table.get(type(msg))
        if handler is None:
            return Error(code="unexpected", message=f"unexpected message {type(msg).__name__}")
        return handler(msg, time.monotonic())

    def on_hello(self, msg: Hello, now: float) -> Msg:
        """A consumer hand-shakes: check layouts, remember its agent, send ours."""
        layout = self.ctx.layout
        assert layout is not None
        diff = layout.mismatch(msg.layout)
        if diff:
            return Error(code="layout", message=f"KV layout mismatch with {self.ctx.name}: {diff}")
        with self.ctx.lock:
            self.producer.on_hello(msg)
        return Welcome(engine_id=self.ctx.name, agent_md=self.ctx.agent_md, layout=layout)

    def on_done(self, msg: Done, now: float) -> Reply:
        """READ mode: the consumer read these keys; "ok" frees them, inside the lease only."""
        with self.ctx.lock:
            return Reply(status={k: self.producer.answer_done(k, msg.instance, now) for k in msg.keys})

    def on_renew(self, msg: Renew, now: float) -> Reply:
        with self.ctx.lock:
            return Reply(status={k: self.producer.answer_renew(k, now) for k in msg.keys})

    def on_give_up(self, msg: Release | Cancel, now: float) -> Reply:
        """Release (won't read) and Cancel (WRITE: stop writing): "acked" only once no
        write of ours can land in the consumer's blocks any more."""
        with self.ctx.lock:
            return Reply(status={k: self.producer.answer_give_up(k, now) for k in msg.keys})

    def on_write_req(self, msg: WriteReq, now: float) -> Reply:
        with self.ctx.lock:
            return Reply(status={msg.key: self.producer.answer_write_req(msg, now)})

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
