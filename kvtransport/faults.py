"""Fault injection as a wrapper around any backend.

``kvtransport.open(name, faults=FaultPlan(...))`` wraps the backend in
:class:`FaultInjectingBackend`, which sits between the core and the real backend and
perturbs what the core sees: transfers that fail at once, transfers that never
complete (the core's deadline must end them), completions reported late, notifications
dropped or duplicated, peers declared dead (:attr:`FaultPlan.dead_peers`). Bytes that do
move, move through the real backend, so the reliability tests exercise real data paths.

Faults are drawn per transfer / per notification from a seeded RNG, so a failing run
can be replayed with the same seed.

Besides random faults, a plan can hold one post inside the backend until it is let go
(:attr:`FaultPlan.hold_next_post`, a :class:`PostHold`): the model of a backend that does
real work on the posting thread (UCX drives its worker inside ``post`` for
milliseconds), which makes races between posting and the side channel deterministic.
A plan may be changed while its backend runs; :mod:`kvtransport.testing.fault_controls`
does so (kill and revive a peer, hold the next post behind a gate).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from .spi import Backend, LocalRegion, Op, PollResult, PostRequest, RemoteRegion

__all__ = ["FaultPlan", "FaultInjectingBackend", "PostHold"]


class PostHold(Protocol):
    """Holds one post of one of :attr:`ops` inside ``Backend.post``, before the real
    backend posts it."""

    ops: frozenset[Op]

    def hold(self) -> None:
        """Called on the posting thread, nothing moved yet; returns when the post may go on."""

    def posted(self) -> None:
        """Called once the real backend's post has returned."""


@dataclass
class FaultPlan:
    """Probabilities are per transfer (or per received notification), in [0, 1]."""

    #: Fail the transfer at post time; nothing moves.
    fail_rate: float = 0.0
    #: Never complete (nothing moves, the backend stays silent): only the deadline ends it.
    hang_rate: float = 0.0
    #: Report completion this many seconds after the backend finished (bytes landed on time).
    delay_s: float = 0.0
    #: Probability that ``delay_s`` applies to a transfer.
    delay_rate: float = 1.0
    #: Drop a received notification.
    drop_notify_rate: float = 0.0
    #: Deliver a received notification twice.
    dup_notify_rate: float = 0.0
    #: Only these ops are perturbed (default both).
    ops: frozenset[Op] = frozenset({Op.READ, Op.WRITE})
    seed: int | None = None
    #: Every transfer to these peers fails, pending ones included (nothing moves for new
    #: ones): peers declared dead. Replaced, never mutated in place, while the backend runs.
    dead_peers: frozenset[str] = frozenset()
    #: The next post of one of its ops is held inside ``post`` until it lets go; one-shot
    #: (taken off the plan when it holds a post).
    hold_next_post: PostHold | None = None
    #: Counters of what was injected, for reports.
    injected: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("fail_rate", "hang_rate", "delay_rate", "drop_notify_rate", "dup_notify_rate"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"FaultPlan.{name} must be within [0, 1], got {v}")
        if self.delay_s < 0:
            raise ValueError("FaultPlan.delay_s must be >= 0")
        self.dead_peers = frozenset(self.dead_peers)

    def count(self, what: str) -> None:
        self.injected[what] = self.injected.get(what, 0) + 1


class _Injected:
    """Handle of a transfer whose fate the injector decided."""

    __slots__ = ("inner", "kind", "ready_at", "peer_name")

    def __init__(self, inner: Any, kind: str, ready_at: float, peer_name: str):
        self.inner = inner  # the real backend's handle, or None when nothing was posted
        self.kind = kind  # "pass", "fail", "hang", "delay"
        self.ready_at = ready_at
        self.peer_name = peer_name


class FaultInjectingBackend(Backend):
    """Delegates to ``inner`` and perturbs results according to ``plan``."""

    def __init__(self, inner: Backend, plan: FaultPlan):
        self.inner = inner
        self.plan = plan
        self.name = inner.name
        self.version = inner.version
        self.capabilities = inner.capabilities
        self.agent_name = inner.agent_name
        self.options = inner.options
        self._rng = random.Random(plan.seed)
        self._lock = threading.Lock()

    def _draw(self, rate: float) -> bool:
        return rate > 0 and self._rng.random() < rate

    # -- delegated SPI --------------------------------------------------------
    def register(self, region: LocalRegion) -> bytes:
        return self.inner.register(region)

    def deregister(self, region: LocalRegion) -> None:
        self.inner.deregister(region)

    def export(self) -> bytes:
        return self.inner.export()

    def connect(self, peer_name: str, blob: bytes, regions: Sequence[RemoteRegion]) -> Any:
        return self.inner.connect(peer_name, blob, regions)

    def disconnect(self, peer: Any) -> None:
        self.inner.disconnect(peer)

    def peer_alive(self, peer: Any) -> bool | None:
        # An injected kill is simulated: the real process may still write. Ask the backend.
        return self.inner.peer_alive(peer)

    def post(self, req: PostRequest) -> Any:
        hold = None
        plan = self.plan
        with self._lock:
            if plan.hold_next_post is not None and req.op in plan.hold_next_post.ops:
                hold, plan.hold_next_post = plan.hold_next_post, None
        if hold is not None:
            hold.hold()
            try:
                return self._post(req)
            finally:
                hold.posted()
        return self._post(req)

    def _post(self, req: PostRequest) -> Any:
        plan = self.plan
        if req.peer_name in plan.dead_peers:
            plan.count("fail_dead_peer")
            return _Injected(None, "dead", 0.0, req.peer_name)
        if req.op in plan.ops:
            if self._draw(plan.fail_rate):
                plan.count("fail")
                return _Injected(None, "fail", 0.0, req.peer_name)
            if self._draw(plan.hang_rate):
                plan.count("hang")
                return _Injected(None, "hang", 0.0, req.peer_name)
        inner = self.inner.post(req)
        if req.op in plan.ops and plan.delay_s > 0 and self._draw(plan.delay_rate):
            plan.count("delay")
            return _Injected(inner, "delay", time.monotonic() + plan.delay_s, req.peer_name)
        return _Injected(inner, "pass", 0.0, req.peer_name)

    def poll(self, handle: _Injected) -> PollResult:
        dead = self.plan.dead_peers
        if handle.kind == "hang" and handle.peer_name in dead:
            return PollResult.failed(f"peer {handle.peer_name!r} is dead (injected)")
        if handle.kind == "fail":
            return PollResult.failed("injected failure (fault plan)")
        if handle.kind == "dead":
            return PollResult.failed(f"peer {handle.peer_name!r} is dead (injected)")
        if handle.kind == "hang":
            return PollResult.pending()
        if handle.peer_name in dead:
            quiesced = self.inner.cancel(handle.inner)
            return PollResult.failed(f"peer {handle.peer_name!r} is dead (injected)", quiesced)
        res = self.inner.poll(handle.inner)
        if handle.kind == "delay" and res.state.name == "DONE" and time.monotonic() < handle.ready_at:
            return PollResult.pending()
        return res

    def cancel(self, handle: _Injected) -> bool:
        if handle.inner is None:
            return True
        return self.inner.cancel(handle.inner)

    def quiesced(self, handle: _Injected) -> bool:
        if handle.inner is None:
            return True
        return self.inner.quiesced(handle.inner)

    def release(self, handle: _Injected) -> None:
        if handle.inner is not None:
            self.inner.release(handle.inner)

    def notifications(self) -> list[tuple[str, bytes]]:
        out: list[tuple[str, bytes]] = []
        for msg in self.inner.notifications():
            if self._draw(self.plan.drop_notify_rate):
                self.plan.count("drop_notify")
                continue
            out.append(msg)
            if self._draw(self.plan.dup_notify_rate):
                self.plan.count("dup_notify")
                out.append(msg)
        return out

    def send_notification(self, peer: Any, payload: bytes) -> None:
        self.inner.send_notification(peer, payload)

    def close(self) -> None:
        self.inner.close()

    def describe(self) -> dict[str, Any]:
        d = dict(self.inner.describe())
        d["faults"] = {k: v for k, v in vars(self.plan).items() if k not in _RUNTIME_FIELDS}
        return d


#: Plan fields that describe the run's state rather than its configuration (not described).
_RUNTIME_FIELDS = frozenset({"injected", "dead_peers", "hold_next_post"})


def plan_from_options(value: FaultPlan | Mapping[str, Any] | None) -> FaultPlan | None:
    """Accept a FaultPlan or a plain mapping (as from a JSON config)."""
    if value is None or isinstance(value, FaultPlan):
        return value
    kwargs = dict(value)
    if "ops" in kwargs:
        kwargs["ops"] = frozenset(Op[o.upper()] if isinstance(o, str) else Op(o) for o in kwargs["ops"])
    return FaultPlan(**kwargs)
