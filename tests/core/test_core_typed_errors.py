"""Bad input and failing backends reach the caller as typed errors, and leave the agent
consistent: nothing half-registered, nothing leaked, no transfer left to its deadline.

Real loopback agents; where a backend must fail, one of its methods is replaced on the
live backend (the failure a real backend may raise, e.g. ENOMEM from a memory map), or a
minimal in-test backend stands in (named so: it tests only the core's handling)."""

from __future__ import annotations

import glob
import tempfile
import threading

import numpy as np
import pytest

import kvtransport as kvt
from kvtransport import errors
from kvtransport.agent import Agent, AgentConfig
from kvtransport.spi import Backend, PollResult


@pytest.fixture
def pair():
    a, b = kvt.open("loopback", name="te-a"), kvt.open("loopback", name="te-b")
    local, remote = np.zeros(64, np.uint8), np.arange(64, dtype=np.uint8) + 1
    ra, rb = a.register(local), b.register(remote)
    b.connect(a.metadata())
    peer = a.connect(b.metadata())
    yield a, b, peer, ra, rb, local, remote
    a.close()
    b.close()


@pytest.mark.parametrize("op", [0, 1, "READ", None])
def test_an_op_that_is_not_an_Op_is_refused_and_nothing_moves(pair, op):
    a, b, peer, ra, rb, local, remote = pair
    with pytest.raises(errors.InvalidSegmentsError, match="Op.READ or Op.WRITE"):
        a.prepare(op, peer, ra.segments([0], [64]), peer.region(rb.id).segments([0], [64]))
    assert (remote == np.arange(64, dtype=np.uint8) + 1).all() and not local.any()


@pytest.mark.parametrize("call", ["read", "disconnect", "peer_alive"])
def test_a_peer_that_is_not_a_Peer_is_a_typed_error(pair, call):
    a, b, peer, ra, rb, local, remote = pair
    with pytest.raises(errors.UnknownPeerError, match="Agent.connect"):
        if call == "read":
            a.read(None, ra.segments([0], [64]), peer.region(rb.id).segments([0], [64]))
        else:
            getattr(a, call)("te-b")
    assert a.read(peer, ra.segments([0], [64]), peer.region(rb.id).segments([0], [64])).wait(10).ok


def test_deregistering_another_agents_region_is_refused_and_ours_stays(pair):
    a, b, peer, ra, rb, local, remote = pair
    assert ra.id == rb.id  # region ids are per agent
    with pytest.raises(errors.UnregisteredMemoryError, match="not registered by 'te-b'"):
        b.deregister(ra)
    assert [r.id for r in b.regions] == [rb.id]
    assert a.read(peer, ra.segments([0], [64]), peer.region(rb.id).segments([0], [64])).wait(10).ok
    assert (local == remote).all()


def test_a_backend_failing_to_deregister_is_typed_and_the_region_is_out_of_use(pair):
    a, b, peer, ra, rb, local, remote = pair

    def refuse(region):  # e.g. ucp_mem_unmap failing
        raise RuntimeError("device busy")
    a._backend.deregister = refuse
    with pytest.raises(errors.KVTransportError, match="failed to deregister region .*device busy"):
        a.deregister(ra)
    assert a.regions == []
    with pytest.raises(errors.UnregisteredMemoryError):  # validation agrees: nothing lands in it
        a.read(peer, ra.segments([0], [64]), peer.region(rb.id).segments([0], [64]))
    assert not local.any()


@pytest.mark.parametrize("method, call, error", [
    ("register", lambda a: a.register(np.zeros(64, np.uint8)), errors.KVTransportError),
    ("export", lambda a: a.metadata(), errors.KVTransportError),
    ("notifications", lambda a: a.notifications(), errors.NotificationError),
])
def test_a_backend_exception_reaches_the_caller_typed(method, call, error):
    a = kvt.open("loopback", name="te-raw")
    try:
        def fail(*args, **kwargs):
            raise OSError(12, "Cannot allocate memory")
        setattr(a._backend, method, fail)
        with pytest.raises(error, match="Cannot allocate memory"):
            call(a)
        assert a.regions == []
    finally:
        a.close()


@pytest.mark.parametrize("option", [{"latency_window": -1}, {"progress_window": "many"},
                                    {"max_metadata_bytes": 0}, {"layout": 5}])
def test_a_bad_core_option_is_typed_and_builds_no_backend(option):
    threads = {t.ident for t in threading.enumerate()}
    dirs = set(glob.glob(tempfile.gettempdir() + "/kvt-lb-*"))
    with pytest.raises(errors.BackendOptionError, match=next(iter(option))):
        kvt.open("loopback", name="te-bad", **option)
    assert [t.name for t in threading.enumerate() if t.ident not in threads] == []
    assert set(glob.glob(tempfile.gettempdir() + "/kvt-lb-*")) == dirs


def test_disconnect_ends_transfers_posted_on_an_earlier_peer_of_the_name():
    """connect() again to the same instance gives a new Peer; a transfer posted on the old
    one must end with the connection too, not run on to its deadline."""
    a = kvt.open("loopback", name="te-hang", faults=kvt.FaultPlan(hang_rate=1.0))  # posts never finish
    b = kvt.open("loopback", name="te-far")
    try:
        la, lb = a.register(np.zeros(4096, np.uint8)), b.register(np.zeros(4096, np.uint8))
        b.connect(a.metadata())
        first = a.connect(b.metadata())
        old = a.read(first, la.segments([0], [64]), first.region(lb.id).segments([0], [64]), timeout=600)
        second = a.connect(b.metadata())
        new = a.read(second, la.segments([0], [64]), second.region(lb.id).segments([0], [64]), timeout=600)
        a.disconnect(second)
        assert old.status().state is kvt.State.FAILED and new.status().state is kvt.State.FAILED
        assert a.pending() == 0
    finally:
        a.close()
        b.close()


class _LinkResetBackend(Backend):
    """In-test backend (tests the SPI's default only): every transfer fails with bytes that
    may still land, and it does not override ``quiesced``."""

    name = "in-test-link-reset"

    def __init__(self, agent_name: str):
        super().__init__(agent_name, {})

    def register(self, region):
        return b""

    def deregister(self, region):
        pass

    def export(self):
        return b""

    def connect(self, peer_name, blob, regions):
        return peer_name

    def post(self, req):
        return object()

    def poll(self, handle) -> PollResult:
        return PollResult.failed("link reset; RMA may still land", quiesced=False)

    def notifications(self):
        return []

    def close(self):
        pass


def test_the_spi_default_does_not_call_a_failed_unquiesced_transfer_quiesced():
    a = Agent(_LinkResetBackend("lr-a"), AgentConfig(name="lr-a"))
    b = Agent(_LinkResetBackend("lr-b"), AgentConfig(name="lr-b"))
    try:
        ra, rb = a.register(np.zeros(4096, np.uint8)), b.register(np.zeros(4096, np.uint8))
        peer = a.connect(b.metadata())
        t = a.read(peer, ra.segments([0], [64]), peer.region(rb.id).segments([0], [64]))
        for _ in range(3):
            st = t.status()
            assert st.state is kvt.State.FAILED and not st.quiesced
        with pytest.raises(errors.KVTransportError, match="not yet quiesced|in use"):
            a.deregister(ra)
    finally:
        a.close()
        b.close()


def test_a_library_error_while_a_backend_starts_is_typed_and_names_it():
    """A backend whose library refuses to start (UCX asked for a NIC this host does not
    have, as ``kvtransport doctor`` is on a host whose link is down) is a typed error
    naming the backend, the options and the library's own words, not the library's raw
    exception escaping ``kvtransport.open``."""
    from kvtransport.testing.required import skip_unless_usable

    skip_unless_usable("ucx")
    with pytest.raises(errors.BackendUnavailableError) as exc:
        kvt.open("ucx", name="no-nic", tls="tcp", net_devices="kvt-no-such-nic")
    msg = str(exc.value)
    assert "'ucx'" in msg and "net_devices" in msg and "No such device" in msg
