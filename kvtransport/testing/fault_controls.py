"""Controls a test applies to a running fault injector (``kvt.open(..., faults=...)``,
reached as ``agent.faults``): declare a peer dead and alive again, hold the next post
inside the backend behind a :class:`PostGate`.

They change the injector's :class:`~kvtransport.faults.FaultPlan` while the backend
runs; the injector reads the plan at every post and poll, so the change takes effect on
the next one (pending transfers to a killed peer included).
"""

from __future__ import annotations

import threading

from kvtransport.faults import FaultInjectingBackend
from kvtransport.spi import Op

__all__ = ["PostGate", "gate_posts", "kill_peer", "revive_peer"]


def kill_peer(injector: FaultInjectingBackend, peer_name: str) -> None:
    """From now on every transfer to ``peer_name`` fails, pending ones included."""
    plan = injector.plan
    plan.dead_peers = plan.dead_peers | {peer_name}
    plan.count("peer_killed")
    injector.signal_progress()  # waiters the real backend promised a signal must see it now


def revive_peer(injector: FaultInjectingBackend, peer_name: str) -> None:
    """Transfers to ``peer_name`` posted from now on go through again."""
    plan = injector.plan
    plan.dead_peers = plan.dead_peers - {peer_name}


class PostGate:
    """Holds the next post of one of ``ops`` inside ``Backend.post`` until :meth:`release`
    (a :class:`~kvtransport.faults.PostHold`).

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

    def hold(self) -> None:
        self.entered.set()
        if not self._open.wait(self.max_hold_s):
            self.timed_out = True

    def posted(self) -> None:
        self.passed.set()


def gate_posts(injector: FaultInjectingBackend, ops: frozenset[Op] = frozenset({Op.WRITE}),
               max_hold_s: float = 60.0) -> PostGate:
    """Hold the next post of one of ``ops`` inside ``post`` until the returned gate is
    released; then the real backend posts it (real bytes move)."""
    gate = PostGate(frozenset(ops), max_hold_s)
    injector.plan.hold_next_post = gate
    return gate
