"""ucx backend behaviour in one process: options, refusals with clear errors, reconnect,
disconnect and close with transfers in flight, deregistration, stuck-peer quiescence."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

import kvtransport as kvt
from kvtransport.errors import BackendOptionError, PeerMetadataError
from kvtransport.testing.peer import stop_process
from ucx_helpers import PeerProcess, expected_bytes, skip_unless_ucx_usable

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _need_ucx():
    skip_unless_ucx_usable()


@pytest.mark.parametrize(
    "opts, words",
    [
        ({"tls": "tcp", "bogus": 1}, ["unknown option", "bogus"]),
        ({"tls": "t c p"}, ["tls"]),
        ({"tls": "shm", "err_mode": "peer"}, ["err_mode='peer'", "cma+tcp"]),
        ({"progress": "sometimes"}, ["progress"]),
        ({"ucx_config": {"not a key": 1}}, ["ucx_config"]),
        ({"ucx_config": {"NO_SUCH_UCX_SETTING": "1"}}, ["NO_SUCH_UCX_SETTING"]),
        # each accepted alone, refused together when the tcp transport opens
        ({"tls": "tcp", "ucx_config": {"TCP_TX_SEG_SIZE": "256k"}}, ["TCP_TX_SEG_SIZE", "conflict"]),
        ({"liveness_interval_s": 0}, ["liveness_interval_s"]),
    ],
)
def test_bad_options_are_refused_with_a_message_naming_them(opts, words):
    with pytest.raises(BackendOptionError) as ei:
        kvt.open("ucx", name="x", **opts)
    for w in words:
        assert w in str(ei.value)


@pytest.mark.parametrize("ucx_config", [{}, {"TCP_RX_SEG_SIZE": "64k"}, {"TCP_TX_SEG_SIZE": "8k"}])
def test_tcp_segment_tuning_yields_to_a_users_setting_of_either_size(ucx_config):
    """Our 1 MiB tcp segments are dropped as a pair when the user sets one size (UCX refuses
    RX < TX): a user's 64 KiB RX alone must not meet our 1 MiB TX."""
    n = 3 << 20  # above lane_split_bytes: both lanes carry a share
    src = np.frombuffer(np.random.default_rng(7).bytes(n), np.uint8).copy()
    dst = np.zeros(n, np.uint8)
    with kvt.open("ucx", name="seg-a", tls="tcp", lanes=2, ucx_config=ucx_config) as a, \
            kvt.open("ucx", name="seg-b", tls="tcp", lanes=2, ucx_config=ucx_config) as b:
        ra, rb = a.register(dst), b.register(src)
        peer = a.connect(b.metadata())
        assert a.read(peer, ra.whole(), peer.region(rb.id).whole()).wait(60).ok
        assert dst.tobytes() == src.tobytes()
        out = np.frombuffer(np.random.default_rng(8).bytes(n), np.uint8).copy()
        dst[:] = out  # now WRITE a's new bytes over b's buffer
        assert a.write(peer, ra.whole(), peer.region(rb.id).whole()).wait(60).ok
        assert src.tobytes() == out.tobytes()


def test_describe_reports_transport_and_library():
    with kvt.open("ucx", name="d", tls="shm") as a:
        d = a.describe()
    assert d["tls"] == "sysv,posix,cma" and d["err_mode"] == "none"
    assert d["ucx_version"].startswith("1.")
    assert "libucp" in d["ucx_library"]


def test_malformed_backend_blob_is_a_peer_metadata_error():
    with kvt.open("ucx", name="m", tls="tcp") as a:
        with pytest.raises(PeerMetadataError):
            a._backend.connect("ghost", b"\x93not-msgpack", [])  # the backend's own check


def test_peers_without_a_common_transport_are_refused_or_fail_fast():
    with kvt.open("ucx", name="t", tls="tcp") as a, kvt.open("ucx", name="s", tls="shm") as b:
        ra = a.register(np.zeros(4096, np.uint8))
        b.register(np.zeros(4096, np.uint8))
        try:
            p = a.connect(b.metadata())
        except PeerMetadataError as exc:
            assert "common transport" in str(exc)
            return
        st = a.read(p, ra.segments([0], [4096]), p.regions[0].segments([0], [4096]), timeout=10).wait()
        assert not st.ok  # never a silent success


def _pair(tls: str = "tcp"):
    a, b = kvt.open("ucx", name="a", tls=tls), kvt.open("ucx", name="b", tls=tls)
    xa, xb = np.arange(1 << 20, dtype=np.uint32).view(np.uint8)[: 1 << 20].copy(), np.zeros(1 << 20, np.uint8)
    ra, rb = a.register(xa), b.register(xb)
    pb = b.connect(a.metadata())
    a.connect(b.metadata())
    return a, b, xa, xb, ra, rb, pb


def test_reconnect_to_a_restarted_peer_uses_its_new_memory():
    a, b, xa, xb, ra, rb, pb = _pair()
    try:
        a.close()  # "restart" a under the same name with new memory
        a2 = kvt.open("ucx", name="a", tls="tcp")
        x2 = np.full(1 << 20, 7, np.uint8)
        r2 = a2.register(x2)
        p2 = b.connect(a2.metadata())
        assert b.read(p2, rb.segments([0], [4096]), p2.region(r2.id).segments([0], [4096]), timeout=10).wait().ok
        assert (xb[:4096] == 7).all()
        a2.close()
    finally:
        b.close()


def test_disconnect_and_close_with_transfers_in_flight_end_them_failed():
    a, b, xa, xb, ra, rb, pb = _pair()
    big = np.zeros(64 << 20, np.uint8)
    rbig = b.register(big)
    try:
        ts = [b.read(pb, rbig.segments([0], [1 << 20]), pb.region(ra.id).segments([0], [1 << 20]), timeout=30)
              for _ in range(20)]
        b.disconnect(pb)
        for t in ts:
            st = t.wait(10)
            assert st.done, "a transfer outlived the disconnect of its peer"
            if not st.ok:
                assert "disconnected" in st.reason or "cancel" in st.reason, st.reason
        with pytest.raises(kvt.errors.UnknownPeerError):
            b.read(pb, rb.segments([0], [16]), pb.region(ra.id).segments([0], [16]))
        pb2 = b.connect(a.metadata())
        t = b.read(pb2, rb.segments([0], [4096]), pb2.region(ra.id).segments([0], [4096]), timeout=10)
        assert t.wait().ok and np.array_equal(xb[:4096], xa[:4096])
    finally:
        a.close()
        b.close()
    assert b.closed


def test_deregister_then_reregister():
    a, b, xa, xb, ra, rb, pb = _pair()
    try:
        b.deregister(rb)
        rb2 = b.register(xb)
        assert b.read(pb, rb2.segments([0], [8192]), pb.region(ra.id).segments([8192], [8192]), timeout=10).wait().ok
        assert np.array_equal(xb[:8192], xa[8192:16384])
    finally:
        a.close()
        b.close()


def test_stuck_peer_fails_at_deadline_then_quiesces_by_force_close():
    """A stopped (not dead) peer over tcp: the core fails the transfer at its deadline; the
    backend cannot cancel RMA one by one, so after ``cancel_grace_s`` it force-closes the
    endpoint and only then reports the transfer quiesced (T3). The next post reconnects."""
    peer = PeerProcess("stuck", 64 << 20, seed=5, options={"tls": "tcp"})
    agent = kvt.open("ucx", name="waiter", tls="tcp", cancel_grace_s=0.5)
    try:
        buf = np.zeros(64 << 20, np.uint8)
        region = agent.register(buf)
        p = agent.connect(peer.metadata)
        assert agent.read(p, region.segments([0], [4096]), p.regions[0].segments([0], [4096]), timeout=10).wait().ok
        stop_process(peer.proc.pid)  # every thread stopped: nothing of it serves the READ below
        try:
            t = agent.read(p, region.whole(), p.regions[0].whole(), timeout=1.0)
            st = t.wait()
            assert not st.ok and "deadline" in st.reason
            assert not st.quiesced, "bytes of a stuck RMA may still land: must not claim quiesced yet"
            deadline = time.monotonic() + 10
            while not t.status().quiesced and time.monotonic() < deadline:
                agent.progress()
                time.sleep(0.05)
            assert t.status().quiesced, "transfer never quiesced after the endpoint was force-closed"
        finally:
            os.kill(peer.proc.pid, signal.SIGCONT)
        # The endpoint was force-closed; the next transfer reopens it and works.
        buf[:4096] = 0
        t = agent.read(p, region.segments([0], [4096]), p.regions[0].segments([0], [4096]), timeout=10)
        assert t.wait().ok
        assert np.array_equal(buf[:4096], expected_bytes(64 << 20, 5)[:4096])
    finally:
        peer.close()
        agent.close()
