"""Loopback specifics: a peer is identified by pid *and* process start time, so a dead
peer is refused at connect and a recycled pid is never taken for the peer that
exported its memory. The peer is a real agent in a child process. Also: how many copy
threads an agent starts by default on a thread pinned to one CPU."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import msgspec
import numpy as np
import pytest

import kvtransport as kvt
from kvtransport import errors
from kvtransport import metadata as md
from kvtransport.testing.pinning import call_on_one_cpu

CHILD = """
import sys, numpy as np, kvtransport as kvt
a = kvt.open("loopback", name="child")
buf = np.arange(4096, dtype=np.uint32).view(np.uint8)
a.register(buf)
sys.stdout.write(a.metadata().hex() + "\\n")
sys.stdout.flush()
sys.stdin.read()  # serve until the parent closes our stdin (or kills us)
"""


@pytest.fixture
def child():
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line, "child agent did not start"
        yield proc, bytes.fromhex(line.strip())
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def _with_blob(metadata: bytes, **changes) -> bytes:
    """The same metadata with fields of the loopback blob (pid, start_time, boot_id,
    notify_addr, notify_key) changed."""
    m = md.decode_metadata(metadata)
    names = ("pid", "start_time", "boot_id", "notify_addr", "notify_key")
    fields = {**dict(zip(names, msgspec.msgpack.decode(m.blob))), **changes}
    blob = msgspec.msgpack.encode([fields[k] for k in names])
    return md.encode_metadata(msgspec.structs.replace(m, blob=blob))


def test_recycled_pid_refused_by_start_time(child):
    proc, good = child
    start = msgspec.msgpack.decode(md.decode_metadata(good).blob)[1]
    with kvt.open("loopback", name="parent") as a:
        # Same pid, another start time: what a recycled pid looks like. Refused.
        with pytest.raises(errors.PeerMetadataError, match=f"pid {proc.pid}.*no longer running"):
            a.connect(_with_blob(good, start_time=start + 1))
        assert a.peers == {} and a.stats()["peers_refused"] == 1
        # The genuine metadata connects, and (with CMA) bytes move from the child.
        dst = np.zeros(4 * 4096, np.uint8)
        r = a.register(dst)
        peer = a.connect(good)
        assert peer.name == "child"
        if not a.describe()["cross_process"]:
            pytest.skip(f"cross-process loopback unavailable: {a.describe()['cross_process_reason']}")
        assert a.read(peer, r.whole(), peer.regions[0].whole()).wait(10).ok
        assert np.array_equal(dst.view(np.uint32), np.arange(4096, dtype=np.uint32))


def test_dead_peer_refused_at_connect_and_fails_fast_when_connected(child):
    proc, good = child
    with kvt.open("loopback", name="parent2") as a:
        dst = np.zeros(4 * 4096, np.uint8)
        r = a.register(dst)
        peer = a.connect(good)
        assert a.peer_alive(peer) is True
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        # Known gone: nothing it posted can land any more (lets WRITE-mode consumers free
        # blocks the dead producer was writing into without waiting for its lease).
        assert a.peer_alive(peer) is False
        # Already connected: the next transfer fails at once (detects_peer_failure), not at
        # its 30 s deadline.
        t = a.read(peer, r.whole(), peer.regions[0].whole(), timeout=30)
        st = t.wait(5)
        assert st.state is kvt.State.FAILED and "gone" in st.reason, st
        assert not dst.any()
    with kvt.open("loopback", name="parent3") as b:
        with pytest.raises(errors.PeerMetadataError, match=f"pid {proc.pid}.*no longer running"):
            b.connect(good)
        assert b.peers == {}


def test_other_host_refused(child):
    _, good = child
    with kvt.open("loopback", name="parent4") as a:
        with pytest.raises(errors.IncompatiblePeerError, match="another host"):
            a.connect(_with_blob(good, boot_id="00000000-not-this-boot"))


def test_malformed_loopback_blob_refused(child):
    _, good = child
    m = md.decode_metadata(good)
    with kvt.open("loopback", name="parent5") as a:
        for blob in (b"", b"\x93\x01\x02\x03", msgspec.msgpack.encode(["x", 1, "b", "ipc://y"])):
            with pytest.raises(errors.PeerMetadataError, match="malformed loopback blob"):
                a.connect(md.encode_metadata(msgspec.structs.replace(m, blob=blob)))
        with pytest.raises(errors.PeerMetadataError, match="non-ipc"):
            a.connect(_with_blob(good, notify_addr="tcp://10.0.0.1:5555"))
        # A blob without a notification key (kvtransport before authenticated
        # notifications): we could not seal anything it would accept. Refused, saying so.
        m_old = md.decode_metadata(good)
        four = msgspec.msgpack.encode(msgspec.msgpack.decode(m_old.blob)[:4])
        with pytest.raises(errors.PeerMetadataError, match="no notification key"):
            a.connect(md.encode_metadata(msgspec.structs.replace(m_old, blob=four)))
        assert a.peers == {}


def test_an_agent_opened_on_one_cpu_copies_on_one_thread_by_default_and_moves_every_byte():
    """Inside an engine pinned to one core a second copy thread shares that core and only
    adds hand-offs (two processes pinned to one core each: 4096 x 16 KiB 0.63x memcpy with two
    threads, docs/UCX.md), so the default follows the opening thread's CPUs; ``threads`` wins."""
    n = 12 << 20  # above min_split_bytes: two threads would split it
    src = np.frombuffer(np.random.default_rng(5).bytes(n), np.uint8).copy()
    dst = np.zeros(n, np.uint8)

    def pinned() -> tuple[int, int]:
        with kvt.open("loopback", name="one-cpu-a") as a, kvt.open("loopback", name="one-cpu-b") as b:
            ra, rb = a.register(dst), b.register(src)
            peer = a.connect(b.metadata())
            assert a.read(peer, ra.whole(), peer.region(rb.id).whole()).wait(60).ok
            with kvt.open("loopback", name="one-cpu-c", threads=2) as c:
                return a.describe()["threads"], c.describe()["threads"]

    assert call_on_one_cpu(pinned) == (1, 2)
    assert dst.tobytes() == src.tobytes()
    with kvt.open("loopback", name="all-cpus") as d:
        assert d.describe()["threads"] == min(2, len(os.sched_getaffinity(0)))
