"""Fault injection as a wrapper around any backend.

``kvtransport.open(name, faults=FaultPlan(...))`` wraps the backend in
:class:`FaultInjectingBackend`, which sits between the core and the real backend and
perturbs what the core sees: transfers that fail at once, transfers that never
complete (the core's deadline must end them), completions reported late, notifications
dropped or duplicated, and a peer declared dead. Bytes that do move, move through the
real backend, so the reliability tests exercise real data paths.

Faults are drawn per transfer / per notification from a seeded RNG, so a failing run
can be replayed with the same seed.

Besides random faults, a test can hold one post inside the backend until it says so
(:meth:`FaultInjectingBackend.gate_posts`): the model of a backend that does real work
on the posting thread (UCX drives its worker inside ``post`` for milliseconds), used to
make races between posting and the side channel deterministic.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .spi import Backend, LocalRegion, Op, PollResult, PostRequest, RemoteRegion

__all__ = ["FaultPlan", "FaultInjectingBackend", "PostGate"]


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
    #: Counters of what was injected, for reports.
    injected: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("fail_rate", "hang_rate", "delay_rate", "drop_notify_rate", "dup_notify_rate"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"FaultPlan.{name} must be within [0, 1], got {v}")
        if self.delay_s < 0:
            raise ValueError("FaultPlan.delay_s must be >= 0")

    def count(self, what: str) -> None:
        self.injected[what] = self.injected.get(what, 0) + 1


class PostGate:
    """Holds the next post of one of ``ops`` inside ``Backend.post`` until :meth:`release`.

    ``entered`` is set when a post reached the gate (the posting thread is now blocked in
    ``post``, with nothing moved yet); ``passed`` is set once the real backend's post has
    returned. One-shot: later posts are not held. If no release comes within
    ``max_hold_s`` the post goes on anyway (``timed_out`` is set), so a failing test
    cannot leave a thread blocked forever."""

    def __init__(self, ops: frozenset[Op], max_hold_s: float = 60.0):
        self.ops = ops
        self.max_hold_s = max_hold_s
        self.entered = threading.Event()
        self.passed = threading.Event()
        self.timed_out = False
        self._open = threading.Event()

    def release(self) -> None:
        self._open.set()

    def _hold(self) -> None:
        self.entered.set()
        if not self._open.wait(self.max_hold_s):
            self.timed_out = True


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
        self._killed: set[str] = set()
        self._gate: PostGate | None = None
        self._lock = threading.Lock()

    # -- controls used by tests -----------------------------------------------
    def kill_peer(self, peer_name: str) -> None:
        """From now on every transfer to ``peer_name`` fails, pending ones included."""
        with self._lock:
            self._killed.add(peer_name)
        self.plan.count("peer_killed")
        self.signal_progress()  # waiters the real backend promised a signal must see it now

    def gate_posts(self, ops: frozenset[Op] = frozenset({Op.WRITE}), max_hold_s: float = 60.0) -> PostGate:
        """Hold the next post of one of ``ops`` inside ``post`` until the returned gate is
        released; then the real backend posts it (real bytes move)."""
        gate = PostGate(frozenset(ops), max_hold_s)
        with self._lock:
            self._gate = gate
        return gate

    def revive_peer(self, peer_name: str) -> None:
        with self._lock:
            self._killed.discard(peer_name)

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
        gate = None
        with self._lock:
            if self._gate is not None and req.op in self._gate.ops:
                gate, self._gate = self._gate, None
        if gate is not None:
            gate._hold()
            try:
                return self._post(req)
            finally:
                gate.passed.set()
        return self._post(req)

    def _post(self, req: PostRequest) -> Any:
        plan = self.plan
        if req.peer_name in self._killed:
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
        if handle.kind == "hang" and handle.peer_name in self._killed:
            return PollResult.failed(f"peer {handle.peer_name!r} is dead (injected)")
        if handle.kind == "fail":
            return PollResult.failed("injected failure (fault plan)")
        if handle.kind == "dead":
            return PollResult.failed(f"peer {handle.peer_name!r} is dead (injected)")
        if handle.kind == "hang":
            return PollResult.pending()
        if handle.peer_name in self._killed:
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
        d["faults"] = {k: v for k, v in vars(self.plan).items() if k != "injected"}
        return d


def plan_from_options(value: FaultPlan | Mapping[str, Any] | None) -> FaultPlan | None:
    """Accept a FaultPlan or a plain mapping (as from a JSON config)."""
    if value is None or isinstance(value, FaultPlan):
        return value
    kwargs = dict(value)
    if "ops" in kwargs:
        kwargs["ops"] = frozenset(Op[o.upper()] if isinstance(o, str) else Op(o) for o in kwargs["ops"])
    return FaultPlan(**kwargs)
