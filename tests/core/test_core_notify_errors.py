"""``Agent.send_notification`` raises typed errors only (issue 12.7).

Backends raise what they like (``ConnectionError``, ``NotImplementedError``, zmq
errors); the agent maps them to :class:`kvtransport.errors.NotificationError` and
:class:`kvtransport.errors.UnsupportedOperationError`, which name the peer, the cause
and the fix, and still derive from the builtins callers caught before.

Real backends only: the loopback backend with a peer in a child process that crashes,
the third-party example backend (``examples/example_backend``) with a closed peer — both
also behind the fault wrapper — and the loopback backend deprived of standalone
notifications (the SPI's default), which is what a backend without them looks like.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pytest

import kvtransport as kvt
from kvtransport import errors
from kvtransport.agent import Agent, AgentConfig
from kvtransport.faults import FaultInjectingBackend
from kvtransport.registry import load_backend_class
from kvtransport.spi import Backend
from kvtransport.testing.peer import ChildProcessPeer

EXAMPLE_SRC = Path(__file__).resolve().parents[2] / "examples" / "example_backend"


@pytest.mark.parametrize("faults", [None, kvt.FaultPlan()], ids=["plain", "fault-wrapper"])
def test_notification_to_a_crashed_peer_is_a_typed_error(faults):
    far = ChildProcessPeer("loopback", {}, f"crash-far-{faults is not None}", 4096, 1)
    local = kvt.open("loopback", name=f"crash-local-{faults is not None}", faults=faults)
    try:
        peer = local.connect(far.metadata())
        local.send_notification(peer, b"alive?")  # delivered while the peer runs
        assert far.notifications(1) == [(local.name, b"alive?")]
        far.kill()  # SIGKILL: a crash, no goodbye
        with pytest.raises(errors.NotificationError, match=f"peer {far.name!r}") as info:
            local.send_notification(peer, b"anyone?")
        assert isinstance(info.value, ConnectionError)  # handlers for the old error still work
        assert "peer_alive" in str(info.value) and "reconnect" in str(info.value)  # the fix
        assert local.peer_alive(peer) is False
        # The agent keeps working: a transfer to the dead peer fails, visibly.
        r = local.register(np.zeros(64, np.uint8))
        t = local.read(peer, r.segments([0], [64]), peer.region(far.region_id).segments([0], [64]))
        assert t.wait(10).state is kvt.State.FAILED
    finally:
        local.close()
        far.close()


@pytest.fixture
def example_backend_cls(monkeypatch):
    """The third-party example backend's class, imported from its source tree (the
    install-through-pip path is tests/test_third_party_backend.py's subject)."""
    monkeypatch.syspath_prepend(str(EXAMPLE_SRC))
    sys.modules.pop("kvt_example_backend", None)
    import kvt_example_backend
    yield kvt_example_backend.MemmoveBackend
    sys.modules.pop("kvt_example_backend", None)


@pytest.mark.parametrize("wrap", [False, True], ids=["plain", "fault-wrapper"])
def test_example_backend_notification_to_a_closed_peer_is_a_typed_error(example_backend_cls, wrap):
    def agent(name: str) -> Agent:
        impl: Backend = example_backend_cls(name, {})
        if wrap:
            impl = FaultInjectingBackend(impl, kvt.FaultPlan())
        return Agent(impl, AgentConfig(name=name))

    a, b = agent("ex-a"), agent("ex-b")
    try:
        peer = a.connect(b.metadata())
        a.send_notification(peer, b"one")
        assert [(n.peer, n.payload) for n in b.notifications()] == [("ex-a", b"one")]
        b.close()  # the backend now raises a bare ConnectionError for this peer
        with pytest.raises(errors.NotificationError, match="'ex-b'.*ConnectionError.*closed"):
            a.send_notification(peer, b"two")
    finally:
        a.close()
        b.close()


def test_backend_without_standalone_notifications_raises_unsupported():
    loopback = load_backend_class("loopback")

    class LoopbackWithoutStandaloneNotifications(loopback):  # type: ignore[misc, valid-type]
        """The real loopback backend, minus ``send_notification`` (the SPI default)."""

        send_notification = Backend.send_notification

    a = Agent(LoopbackWithoutStandaloneNotifications("nn-a", {}), AgentConfig(name="nn-a"))
    b = kvt.open("loopback", name="nn-b")
    try:
        src = np.arange(256, dtype=np.uint8)
        ra, rb = a.register(np.zeros(256, np.uint8)), b.register(src)
        b.connect(a.metadata())
        peer = a.connect(b.metadata())
        with pytest.raises(errors.UnsupportedOperationError, match="notify=") as info:
            a.send_notification(peer, b"standalone")
        assert isinstance(info.value, NotImplementedError)
        # What the message proposes works: the notification rides on a transfer.
        t = a.read(peer, ra.whole(), peer.region(rb.id).whole(), notify=b"attached")
        assert t.wait(10).ok and np.array_equal(ra.owner, src)
        got: list = []
        limit = time.monotonic() + 10  # hang guard only
        while not got and time.monotonic() < limit:
            got = b.notifications()
            time.sleep(0.002)
        assert [(n.peer, n.payload) for n in got] == [("nn-a", b"attached")]
    finally:
        a.close()
        b.close()
