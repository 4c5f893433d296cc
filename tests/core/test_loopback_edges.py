"""The loopback backend at its edges: a peer whose pid is recycled between post and copy,
close() with copy parts still queued, segments past the kernel's 2 GiB per call, and the
peers' /proc descriptors on close. Real process_vm_* copies, the backend driven directly
(the agent adds nothing these cases need); a copy thread is held busy where a window must
be deterministic."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import numpy as np
import pytest

import kvtransport_loopback.backend as lb
from kvtransport import errors
from kvtransport.process_identity import ProcessIdentity, boot_id, process_start_time
from kvtransport.spi import Op, PollState, PostRequest
from kvtransport_loopback import cma
from kvtransport_loopback.wire import CODEC

N = 1 << 16
SHARED = np.zeros(N, dtype=np.uint8)  # made before any fork: at the same address in every child


def _one(x: int) -> np.ndarray:
    return np.array([x], dtype=np.uint64)


def _request(op: Op, peer, local: np.ndarray, remote_addr: int, n: int) -> PostRequest:
    return PostRequest(op, 1, peer, "child", np.array([0], np.int64), _one(0), _one(local.ctypes.data),
                       np.array([0], np.int64), _one(0), _one(remote_addr), _one(n))


def _blob(pid: int, tmp) -> bytes:
    ident = ProcessIdentity(pid, process_start_time(pid), boot_id(), "")
    return CODEC.encode(CODEC.seal(ident, notify_addr=f"ipc://{tmp}/unused.sock", notify_key=b"k" * 32))


def _fork_filler(value: int, want_pid: int | None = None) -> tuple[int, int, int]:
    """A child with SHARED filled with ``value``; it reports SHARED[0] when told to exit."""
    if want_pid is not None:
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(want_pid - 1))
    r_ready, w_ready = os.pipe()
    r_go, w_go = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            SHARED[:] = value
            os.write(w_ready, b"x")
            os.read(r_go, 1)
            os.write(w_ready, bytes([int(SHARED[0])]))
        finally:
            os._exit(0)
    os.close(w_ready)
    os.close(r_go)
    assert os.read(r_ready, 1) == b"x"
    return pid, r_ready, w_go


def _reap(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


def _can_choose_pids() -> bool:
    return os.geteuid() == 0 and os.access("/proc/sys/kernel/ns_last_pid", os.W_OK)


@pytest.mark.skipif(not _can_choose_pids(), reason="forcing a pid reuse needs root (/proc/sys/kernel/ns_last_pid)")
@pytest.mark.parametrize("op", [Op.READ, Op.WRITE])
def test_a_pid_recycled_between_post_and_copy_never_ends_done(tmp_path, op):
    """post() checks the peer; the copy runs later by pid. If the peer died and its pid went
    to another process meanwhile, the copy touches a stranger: the transfer must fail."""
    be = lb.LoopbackBackend("parent", {"threads": 1, "inline_bytes": 0})
    stranger = None
    try:
        for _ in range(5):  # another process may take the pid first: try again
            peer_pid, _, _ = _fork_filler(0xAA)
            peer = be.connect("child", _blob(peer_pid, tmp_path), [])
            gate = threading.Event()
            be._data.copiers.submit(gate.wait)  # the copy thread is busy with earlier work
            local = np.full(N, 0x11, dtype=np.uint8)
            job = be.post(_request(op, peer, local, SHARED.ctypes.data, N))
            _reap(peer_pid)
            stranger, s_r, s_w = _fork_filler(0xBB, want_pid=peer_pid)
            gate.set()
            if stranger == peer_pid:
                break
            while be.poll(job).state is PollState.PENDING:
                time.sleep(0.001)
            _reap(stranger)
            stranger = None
        else:
            pytest.skip("other processes took the pid five times in a row")
        deadline = time.monotonic() + 10
        while be.poll(job).state is PollState.PENDING and time.monotonic() < deadline:
            time.sleep(0.001)
        res = be.poll(job)
        assert res.state is PollState.FAILED and "gone" in res.reason, res
        assert be.quiesced(job)
    finally:
        be.close()
        if stranger is not None:
            _reap(stranger)


def test_close_ends_a_transfer_whose_parts_are_still_queued(monkeypatch):
    """close() used to drop queued parts (cancel_futures): their transfer stayed PENDING and
    unquiesced for good. Now every part runs or is skipped, and the transfer ends FAILED."""
    real = cma.copy_segments
    copying, release = threading.Event(), threading.Event()

    def held_copy(*args, **kwargs):
        copying.set()
        release.wait(30)
        return real(*args, **kwargs)

    be = lb.LoopbackBackend("solo", {"threads": 2, "inline_bytes": 0, "min_split_bytes": 1})
    monkeypatch.setattr(cma, "copy_segments", held_copy)
    peer = be.connect("self", be.export(), [])  # this process: cma on ourselves
    src = np.arange(1 << 18, dtype=np.uint32).view(np.uint8)
    dst = np.zeros_like(src)
    gate = threading.Event()
    be._data.copiers.submit(gate.wait)  # one copy thread busy
    job = be.post(_request(Op.READ, peer, dst, src.ctypes.data, src.nbytes))  # two parts
    assert copying.wait(10) and job.parts_left == 2  # one part copying, one queued
    closer = threading.Thread(target=be.close)
    closer.start()
    while not be._data.closed:  # close() has begun
        time.sleep(0.001)
    gate.set()
    release.set()
    closer.join(30)
    assert not closer.is_alive()
    res = be.poll(job)
    assert res.state is PollState.FAILED and "closed" in res.reason, res
    assert be.quiesced(job)


def test_a_segment_larger_than_one_kernel_call_is_copied_whole():
    """The kernel moves at most 2 GiB - 4 KiB per process_vm_* call and reports the rest as a
    short count; such a segment used to fail every time. Copied onto itself (this process),
    so it costs one buffer: 2 GiB + 1 MiB, zero pages until copied."""
    size = (2 << 30) + (1 << 20)
    buf = np.zeros(size, dtype=np.uint8)
    buf[-1] = 7
    addr = _one(buf.ctypes.data)
    assert cma.copy_segments("read", os.getpid(), addr, addr, _one(size)) == size
    assert buf[-1] == 7
    del buf


def test_segments_are_cut_and_batched_by_bytes_with_every_byte_intact(monkeypatch):
    monkeypatch.setattr(cma, "MAX_CALL_BYTES", 4096)
    rng = np.random.default_rng(5)
    src = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    dst = np.zeros_like(src)
    lengths = np.array([1, 4096, 4097, 100_000, 3, 12_288, 65_536], dtype=np.uint64)
    offs = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.uint64) * np.uint64(2)  # gaps between
    moved = cma.copy_segments("read", os.getpid(), offs + np.uint64(dst.ctypes.data),
                              offs + np.uint64(src.ctypes.data), lengths)
    assert moved == int(lengths.sum())
    for o, n in zip(offs.tolist(), lengths.tolist()):
        assert np.array_equal(dst[o:o + n], src[o:o + n])
        assert not dst[o + n:o + 2 * n].any()  # the gaps stay untouched


def _stat_fds(pid: int) -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == f"/proc/{pid}/stat":
                out.append(fd)
        except OSError:
            pass
    return out


def test_close_releases_the_peers_proc_descriptors(tmp_path):
    child = subprocess.Popen(["sleep", "60"])
    try:
        be = lb.LoopbackBackend("p", {})
        be.connect("c", _blob(child.pid, tmp_path), [])
        assert _stat_fds(child.pid)
        be.close()
        assert _stat_fds(child.pid) == []
    finally:
        child.kill()
        child.wait()


def _blob_of(ident, tmp, start_time: int | None = None, pid_ns: str | None = None) -> bytes:
    ident = ProcessIdentity(ident.pid, ident.start_time if start_time is None else start_time, ident.boot_id,
                            ident.pid_ns if pid_ns is None else pid_ns)
    return CODEC.encode(CODEC.seal(ident, notify_addr=f"ipc://{tmp}/unused.sock", notify_key=b"k" * 32))


def test_a_peer_in_another_pid_namespace_is_refused(tmp_path):
    """Engines in two containers are often both pid 1: a pid from another namespace names
    another process here, so CMA cannot reach the peer by it."""
    be = lb.LoopbackBackend("ns", {})
    try:
        assert be.identity.pid_ns, "this test needs /proc/self/ns/pid"
        with pytest.raises(errors.IncompatiblePeerError, match="another pid namespace"):
            be.connect("container", _blob_of(be.identity, tmp_path, pid_ns="pid:[1]"), [])
    finally:
        be.close()


def test_a_peer_with_our_pid_but_another_start_time_is_not_this_process(tmp_path):
    """Our pid alone made a peer 'this process' (memmove / cma on ourselves at its addresses)."""
    be = lb.LoopbackBackend("me", {})
    try:
        with pytest.raises(errors.PeerMetadataError, match="no longer running"):
            be.connect("twin", _blob_of(be.identity, tmp_path, start_time=be.identity.start_time + 1), [])
        assert be.connect("me-again", _blob_of(be.identity, tmp_path), []).same_process
    finally:
        be.close()


def test_copy_cpus_confines_the_copy_threads_and_nothing_else():
    """``copy_cpus``: the copies run on the named CPU (bytes intact), the thread that opened
    the agent keeps its own CPUs, and CPUs this process may not use are refused at open."""
    import kvtransport as kvt

    mine = os.sched_getaffinity(0)
    cpu = max(mine)
    a = kvt.open("loopback", name="cc-a", copy_cpus=[cpu])
    b = kvt.open("loopback", name="cc-b")
    try:
        src = np.random.default_rng(5).integers(0, 256, N, dtype=np.uint8)
        dst = np.zeros(N, np.uint8)
        ra, rb = a.register(dst), b.register(src)
        b.connect(a.metadata())
        peer = a.connect(b.metadata())
        a.read(peer, ra.whole(), peer.region(rb.id).whole(), timeout=10).result(20)
        assert np.array_equal(dst, src)
        copiers = [t for t in threading.enumerate() if t.name.startswith("kvt-lb-cc-a")]
        assert copiers, "the copy went inline, not through a copy thread"
        assert all(os.sched_getaffinity(t.native_id) == {cpu} for t in copiers)
        assert os.sched_getaffinity(0) == mine
        assert a.describe()["copy_cpus"] == [cpu]
    finally:
        a.close()
        b.close()
    with pytest.raises(errors.BackendOptionError, match="copy_cpus"):
        kvt.open("loopback", name="cc-bad", copy_cpus=[os.cpu_count() + 7])
