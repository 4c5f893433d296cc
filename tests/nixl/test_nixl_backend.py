"""nixl backend: bytes and notifications across two processes, killed and stopped peers,
options refused by name, probe reasons. The generic contract is the conformance suite
(tests/conformance, ``-k nixl``); these tests cover what is specific to NIXL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import msgspec
import numpy as np
import pytest

import kvtransport as kvt
from kvtransport import errors
from kvtransport import metadata as md_mod
from kvtransport.testing.peer import ChildProcessPeer, pattern, stop_process
from kvtransport.testing.required import skip_unless_usable
from kvtransport_nixl import xfer as nixl_xfer
from kvtransport_nixl.wire import CODEC

BLOCK = 16 << 10
NBLOCKS = 256
SIZE = BLOCK * NBLOCKS


@pytest.fixture(autouse=True)
def _usable():
    skip_unless_usable("nixl")


#: Default path (small transfers posted inline) and every transfer through the poster thread.
POST_MODES = [{}, {"inline_post_bytes": 0}]


@pytest.fixture(params=POST_MODES, ids=["inline", "poster"], scope="module")
def two_proc(request):
    opts = dict(request.param)
    local = kvt.open("nixl", name="nx-local", **opts)
    buf = pattern(1, SIZE)
    region = local.register(buf)
    far = ChildProcessPeer("nixl", opts, "nx-far", SIZE, 2)
    peer = local.connect(far.metadata())
    far.connect(local.metadata())
    yield local, buf, region, far, peer
    far.close()
    local.close()


def _blocks(seed: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.permutation(NBLOCKS)[:n], rng.permutation(NBLOCKS)[:n]


def _segs(region, ids):
    return region.segments(np.asarray(ids) * BLOCK, np.full(len(ids), BLOCK))


def test_read_and_write_byte_exact_with_notifications_two_processes(two_proc):
    local, buf, region, far, peer = two_proc
    remote = peer.region(far.region_id)
    far.fill(2)
    buf[:] = pattern(1, SIZE)
    lids, rids = _blocks(3, 100)
    t = local.read(peer, _segs(region, lids), _segs(remote, rids), notify=b"read-done")
    assert t.wait(60).ok, t.status()
    theirs = np.frombuffer(far.bytes(), np.uint8).reshape(NBLOCKS, BLOCK)
    assert np.array_equal(buf.reshape(NBLOCKS, BLOCK)[lids], theirs[rids])
    assert far.notifications(1, 10) == [("nx-local", b"read-done")]

    lids, rids = _blocks(4, 100)
    t = local.write(peer, _segs(region, lids), _segs(remote, rids), notify=b"")  # empty payload travels
    assert t.wait(60).ok, t.status()
    got = far.notifications(1, 10)
    theirs = np.frombuffer(far.bytes(), np.uint8).reshape(NBLOCKS, BLOCK)
    assert got == [("nx-local", b"")]
    assert np.array_equal(theirs[rids], buf.reshape(NBLOCKS, BLOCK)[lids])
    untouched = np.setdiff1d(np.arange(NBLOCKS), rids)
    assert np.array_equal(theirs[untouched], pattern(2, SIZE).reshape(NBLOCKS, BLOCK)[untouched])


def test_whole_region_moves_through_the_configured_post_path(two_proc):
    local, buf, region, far, peer = two_proc
    far.fill(9)
    t = local.read(peer, region.whole(), peer.region(far.region_id).whole())
    assert t.wait(60).ok, t.status()
    assert buf.tobytes() == pattern(9, SIZE).tobytes()
    t.release()
    assert local.stats()["pending"] == 0 and local.stats()["unquiesced"] == 0


def test_poster_path_promises_a_signal_and_gives_it(two_proc, monkeypatch):
    """A request on the poster thread is answered PENDING with ``will_signal`` (so
    ``Transfer.wait()`` sleeps instead of polling on its back-off), and the poster keeps the
    promise: it signals the agent when NIXL's ``transfer()`` returns. Inline posts never
    promise a signal: NIXL's ``transfer()`` ran on the caller's thread and either finished
    the copy or left the request in flight (seen on a connection's first transfer), which
    needs polling.

    The poster thread is held until the agent's first poll has been answered: unheld, it
    can finish the whole transfer before that poll (seen once in CI), and the first answer
    is then DONE, which is correct but leaves the promise untested."""
    local, buf, region, far, peer = two_proc
    far.fill(11)
    be = local._backend
    answers = []
    real_poll = be.poll
    first_answer = threading.Event()
    real_post_now = nixl_xfer.post_now

    def recording_poll(handle):
        res = real_poll(handle)
        answers.append(res)
        first_answer.set()
        return res

    def post_after_first_answer(nx, x):
        first_answer.wait(30)  # bounded: a missing poll fails the assertions below, not the run
        real_post_now(nx, x)

    monkeypatch.setattr(nixl_xfer, "post_now", post_after_first_answer)
    be.poll = recording_poll  # the agent calls the instance attribute
    gen0 = local._progress_gen
    try:
        t = local.read(peer, region.whole(), peer.region(far.region_id).whole())
        st = t.wait(60)
    finally:
        del be.poll
    assert st.ok, st
    assert buf.tobytes() == pattern(11, SIZE).tobytes()
    pending = [r for r in answers if r.state.name == "PENDING"]
    if be.opts.inline_post_bytes >= SIZE:
        assert not any(r.will_signal for r in pending), answers
    else:
        assert pending and pending[0].will_signal, answers
        assert local._progress_gen > gen0  # the poster signalled


def test_far_side_writes_into_us_and_notifies(two_proc):
    local, buf, region, far, peer = two_proc
    far.fill(5)
    local.notifications()
    assert far.call("write_to_peer", 0, 2 * BLOCK, 4 * BLOCK, b"from-far") == "DONE"
    limit = time.monotonic() + 10
    got = []
    while not got and time.monotonic() < limit:
        got = local.notifications()
        time.sleep(0.005)
    assert [(n.peer, n.payload) for n in got] == [("nx-far", b"from-far")]
    assert np.array_equal(buf[2 * BLOCK:6 * BLOCK], pattern(5, SIZE)[:4 * BLOCK])


@pytest.mark.parametrize("tls", ["tcp", "shm"])
def test_killed_peer_fails_before_deadline_while_another_peer_is_served(tls):
    """A 256 MiB READ is posted when its source is SIGKILLed: NIXL reports the disconnect
    (tcp: UCX peer error handling; shm: the cma copy fails, or pid liveness), the transfer
    ends FAILED well before its 60 s deadline and quiesced; a second peer is served
    meanwhile and after."""
    big = 256 << 20
    local = kvt.open("nixl", name="nx-victim-reader", tls=tls)
    victim = ChildProcessPeer("nixl", {"tls": tls}, "nx-victim", big, 7)
    healthy = ChildProcessPeer("nixl", {"tls": tls}, "nx-healthy", SIZE, 8)
    try:
        buf = np.zeros(big, np.uint8)
        region = local.register(buf)
        pv, ph = local.connect(victim.metadata()), local.connect(healthy.metadata())
        warm = local.read(pv, region.segments([0], [BLOCK]), pv.region(victim.region_id).segments([0], [BLOCK]))
        assert warm.wait(60).ok  # connection established: the big read below starts at once
        t = local.read(pv, region.whole(), pv.region(victim.region_id).whole(), timeout=60)
        victim.kill()
        served = local.read(ph, region.segments([0], [SIZE]), ph.region(healthy.region_id).whole())
        assert served.wait(60).ok, served.status()
        assert buf[:SIZE].tobytes() == pattern(8, SIZE).tobytes()
        st = t.wait(60)
        assert st.state is kvt.State.FAILED, st
        assert "deadline" not in st.reason  # detected, not timed out
        assert "disconnect" in st.reason or "exited" in st.reason, st.reason
        assert t.status().quiesced
        assert local.peer_alive(pv) is False
        again = local.read(ph, region.segments([SIZE], [SIZE]), ph.region(healthy.region_id).whole())
        assert again.wait(60).ok
        local.deregister(region)  # nothing of the dead transfer can land any more
    finally:
        victim.close()
        healthy.close()
        local.close()


def test_deadline_on_a_stopped_peer_keeps_memory_aside_until_nixl_ends_the_request():
    """NIXL cannot abort a posted request: a READ from a SIGSTOPped peer (tcp) fails at
    its deadline but stays quiesced=False, and its region cannot be deregistered, until
    the peer resumes and NIXL completes the request."""
    local = kvt.open("nixl", name="nx-stop-reader", tls="tcp")
    far = ChildProcessPeer("nixl", {"tls": "tcp"}, "nx-stopped", SIZE, 11)
    try:
        buf = np.zeros(SIZE, np.uint8)
        region = local.register(buf)
        peer = local.connect(far.metadata())
        assert local.read(peer, region.segments([0], [BLOCK]), peer.region(far.region_id).segments([0], [BLOCK])
                          ).wait(60).ok
        stop_process(far.pid)  # every thread stopped: nothing of it serves the READ below
        try:
            t = local.read(peer, region.whole(), peer.region(far.region_id).whole(), timeout=0.5)
            st = t.wait(30)
            assert st.state is kvt.State.FAILED and "deadline" in st.reason, st
            assert not st.quiesced
            with pytest.raises(errors.KVTransportError, match="not yet quiesced"):
                local.deregister(region)
        finally:
            os.kill(far.pid, signal.SIGCONT)
        limit = time.monotonic() + 60
        while not t.status().quiesced and time.monotonic() < limit:
            time.sleep(0.01)
        assert t.status().quiesced
        assert local.stats()["unquiesced"] == 0
        local.deregister(region)
    finally:
        far.close()
        local.close()


# -- options ------------------------------------------------------------------------------

@pytest.mark.parametrize("opts, words", [
    ({"bogus": 1}, ["unknown option", "'bogus'", "progress_thread"]),
    ({"backends": ["NOPE"]}, ["no plugin 'NOPE'", "UCX"]),
    ({"backends": ["POSIX"]}, ["storage plugin", "'POSIX'"]),
    ({"backends": []}, ["backends must be a non-empty list"]),
    ({"plugin_params": {"UCX": {"no_such_param": "1"}}}, ["no parameter(s) ['no_such_param']", "num_workers"]),
    ({"plugin_params": {"LIBFABRIC": {}}}, ["not in backends"]),
    ({"progress_thread": "yes"}, ["progress_thread must be True or False"]),
    ({"num_threads": -1}, ["num_threads"]),
    ({"tls": "tcp;rm -rf"}, ["not a comma-separated UCX transport list"]),
    ({"ucx_config": {"bad key": 1}}, ["not a UCX setting name"]),
    ({"inline_post_bytes": -5}, ["inline_post_bytes"]),
    ({"liveness_interval_s": 0}, ["liveness_interval_s"]),
])
def test_bad_options_are_refused_naming_the_problem(opts, words):
    with pytest.raises(errors.BackendOptionError) as ei:
        kvt.open("nixl", name="nx-bad", **opts)
    for w in words:
        assert w in str(ei.value), str(ei.value)


def test_a_ucx_setting_the_plugin_refuses_is_a_typed_error():
    with pytest.raises(errors.BackendOptionError, match="plugin UCX failed to start with UCX settings"):
        kvt.open("nixl", name="nx-bad-ucx", tls="no_such_transport_xyz")


def test_plugin_params_reach_nixl_and_data_still_moves():
    with kvt.open("nixl", name="nx-a", plugin_params={"UCX": {"num_workers": 2}}, progress_thread=False) as a, \
            kvt.open("nixl", name="nx-b") as b:
        assert a.describe()["plugin_params"] == {"UCX": {"num_workers": "2"}}
        src, dst = pattern(3, SIZE), np.zeros(SIZE, np.uint8)
        ra, rb = a.register(dst), b.register(src)
        peer = a.connect(b.metadata())
        assert a.read(peer, ra.whole(), peer.region(rb.id).whole()).wait(60).ok
        assert dst.tobytes() == src.tobytes()


def test_tcp_user_timeout_bounds_a_transfer_nixl_cannot_abort():
    """NIXL cannot abort a posted transfer; over tcp across a dead link it would wait for the
    kernel's retransmissions (~15 min). The agent's UCX gets TCP_USER_TIMEOUT (default 30 s)
    unless the caller or the environment chose one; 0 leaves the kernel's default. (The
    link-flap test, tests/e2e/test_link_flap.py, shows the effect across a real cut.)"""
    from kvtransport_nixl.options import parse_options

    def env(options, environ=None):
        return parse_options(options, environ={} if environ is None else environ,
                             kinds_here=frozenset).ucx_env

    assert env({})["TCP_USER_TIMEOUT"] == "30000ms"
    assert env({"tcp_user_timeout_s": 2.5})["TCP_USER_TIMEOUT"] == "2500ms"
    assert "TCP_USER_TIMEOUT" not in env({"tcp_user_timeout_s": 0})
    assert env({"ucx_config": {"TCP_USER_TIMEOUT": "5s"}})["TCP_USER_TIMEOUT"] == "5s"  # the caller's own
    assert "TCP_USER_TIMEOUT" not in env({}, {"UCX_TCP_USER_TIMEOUT": "1m"})  # the environment's stands
    with pytest.raises(errors.BackendOptionError, match="tcp_user_timeout_s"):
        parse_options({"tcp_user_timeout_s": -1}, environ={}, kinds_here=frozenset)


def _threads() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def test_close_stops_nixls_progress_threads_while_the_agent_is_still_referenced():
    """NIXL joins its progress thread only in the agent's destructor, and that thread polls
    without pausing: an agent closed but still referenced (a user's attribute, a fixture)
    used to keep a core busy until garbage collection."""
    before = _threads()
    a, b = kvt.open("nixl", name="nx-close-a"), kvt.open("nixl", name="nx-close-b")
    src, dst = pattern(5, SIZE), np.zeros(SIZE, np.uint8)
    ra, rb = a.register(dst), b.register(src)
    peer = a.connect(b.metadata())
    assert a.read(peer, ra.whole(), peer.region(rb.id).whole()).wait(60).ok
    started = _threads() - before
    assert started, "NIXL started no thread: nothing to check"
    a.close()
    b.close()
    left = started & _threads()
    assert not left, f"threads of the closed agents still run: {sorted(left)}"
    assert a.closed and b.closed  # both objects are still referenced here


def test_cuda_memory_refused_naming_the_kind_without_a_gpu():
    with kvt.open("nixl", name="nx-kind") as a:
        if "cuda" in a.capabilities.memory_kinds:
            pytest.skip("this host has a GPU and NIXL reports VRAM: the refusal does not apply")
        with pytest.raises(errors.InvalidSegmentsError, match="'cuda'"):
            a.register((0x10000, 4096), kind="cuda", device=0)


def test_corrupt_nixl_metadata_inside_a_valid_envelope_is_refused_agent_keeps_serving():
    with kvt.open("nixl", name="nx-c1") as a, kvt.open("nixl", name="nx-c2") as b:
        src, dst = pattern(4, SIZE), np.zeros(SIZE, np.uint8)
        ra, rb = a.register(dst), b.register(src)
        good = b.metadata()
        md = md_mod.decode_metadata(good)
        blob = CODEC.decode(md.blob)
        for bad_md in (b"", os.urandom(200), blob.nixl_md[: len(blob.nixl_md) // 2]):
            forged = msgspec.structs.replace(md, blob=CODEC.encode(msgspec.structs.replace(blob, nixl_md=bad_md)))
            with pytest.raises(errors.PeerMetadataError, match="NIXL refused the metadata"):
                a.connect(md_mod.encode_metadata(forged))
        extra = msgspec.structs.replace(md, blob=msgspec.msgpack.encode([*msgspec.msgpack.decode(md.blob), 1]))
        with pytest.raises(errors.PeerMetadataError, match="malformed"):
            a.connect(md_mod.encode_metadata(extra))
        peer = a.connect(good)
        assert a.read(peer, ra.whole(), peer.region(rb.id).whole()).wait(60).ok
        assert dst.tobytes() == src.tobytes()


# -- probe and listing --------------------------------------------------------------------

_BLOCK_NIXL = """
import sys
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('nixl', 'nixl_cu12', 'nixl_cu13', 'nixl_rocm'):
            raise ImportError('blocked for this test: ' + name)
sys.meta_path.insert(0, _Block())
"""


def _child(code: str, env: dict[str, str] | None = None) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, **(env or {})})
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_probe_names_a_missing_install_and_the_hint():
    out = _child(_BLOCK_NIXL + "from kvtransport_nixl.backend import NixlBackend\n"
                 "import json; a = NixlBackend.probe(); print(json.dumps([a.usable, a.reason, a.install_hint]))")
    usable, reason, hint = json.loads(out.strip().splitlines()[-1])
    assert usable is False
    assert "NIXL is not installed" in reason and "nixl_cu12" in reason
    assert "pip install 'kvtransport[nixl]'" in hint


def test_probe_names_missing_plugins():
    out = _child("from kvtransport_nixl.backend import NixlBackend\n"
                 "import json; a = NixlBackend.probe(); print(json.dumps([a.usable, a.reason]))",
                 env={"NIXL_PLUGIN_DIR": "/nonexistent-nixl-plugins"})
    usable, reason = json.loads(out.strip().splitlines()[-1])
    assert usable is False and "NIXL_PLUGIN_DIR=/nonexistent-nixl-plugins" in reason and "plugins" in reason


def test_cli_lists_nixl_with_the_reason_when_it_cannot_run():
    out = _child(_BLOCK_NIXL + "from kvtransport.cli import main; main(['backends', '--json'])")
    rows = {r["name"]: r for r in json.loads(out)}
    assert rows["nixl"]["usable"] is False
    assert "NIXL is not installed" in rows["nixl"]["reason"]
    assert "kvtransport[nixl]" in rows["nixl"]["install_hint"]


def test_cli_lists_nixl_usable_here():
    out = _child("from kvtransport.cli import main; main(['backends', '--json'])")
    rows = {r["name"]: r for r in json.loads(out)}  # stdout is pure JSON: NIXL's INFO lines are quiet
    assert rows["nixl"]["usable"] is True, rows["nixl"]


def test_prepared_transfer_reposted_moves_fresh_bytes_and_only_its_own_notifications(two_proc):
    """Posting one preparation again re-posts its finished NIXL request. NIXL keeps a
    request's message across re-posts, so a post without ``notify`` after one with it
    must not send the old message again; every post moves the bytes as they are now."""
    local, buf, region, far, peer = two_proc
    remote = peer.region(far.region_id)
    lids, rids = _blocks(12, 64)
    prep = local.prepare(kvt.Op.WRITE, peer, _segs(region, lids), _segs(remote, rids))
    far.notifications(0, 0)
    # The last post carries a sentinel: a stale message re-sent by any earlier post would
    # arrive before it (each post is waited for before the next).
    sent = [b"first", None, None, b"", b"fifth", None, b"sentinel"]
    for k, note in enumerate(sent):
        buf[:] = pattern(100 + k, SIZE)
        t = local.post(prep, notify=note)
        assert t.wait(60).ok, t.status()
        t.release()
        theirs = np.frombuffer(far.bytes(), np.uint8).reshape(NBLOCKS, BLOCK)
        assert np.array_equal(theirs[rids], buf.reshape(NBLOCKS, BLOCK)[lids]), f"post {k}"
    want = [("nx-local", n) for n in sent if n is not None]
    got = far.notifications(len(want), 10)
    assert got == want


def test_two_preparations_sharing_one_lengths_array_each_move_their_own_blocks(two_proc):
    """A re-posted NIXL request is bound to its preparation's addresses: preparations whose
    Segments share the caller's lengths array must never re-post each other's request."""
    local, buf, region, far, peer = two_proc
    remote = peer.region(far.region_id)
    lens = np.full(8, BLOCK)
    a_ids, b_ids = np.arange(0, 16, 2), np.arange(100, 116, 2)
    preps = {name: local.prepare(kvt.Op.WRITE, peer, region.segments(ids * BLOCK, lens),
                                 remote.segments(ids * BLOCK, lens))
             for name, ids in (("a", a_ids), ("b", b_ids))}
    for k, (name, ids) in enumerate([("a", a_ids), ("b", b_ids), ("a", a_ids), ("b", b_ids)]):
        far.fill(40 + k)
        buf[:] = pattern(60 + k, SIZE)
        t = local.post(preps[name])
        assert t.wait(60).ok, t.status()
        t.release()
        theirs = np.frombuffer(far.bytes(), np.uint8).reshape(NBLOCKS, BLOCK)
        mine = buf.reshape(NBLOCKS, BLOCK)
        assert np.array_equal(theirs[ids], mine[ids]), f"post {k} ({name}) moved other blocks"
        others = np.setdiff1d(np.arange(NBLOCKS), ids)
        assert np.array_equal(theirs[others], pattern(40 + k, SIZE).reshape(NBLOCKS, BLOCK)[others])


def test_one_local_segments_object_written_to_two_remote_places(two_proc):
    """One-off writes reuse the caller's Segments objects: the same local Segments sent to two
    remote places must land in each (the core may hand the backend the caller's own length
    array for an unmerged transfer, so a request cache keyed on it would re-post the wrong
    remote addresses)."""
    local, buf, region, far, peer = two_proc
    remote = peer.region(far.region_id)
    src = region.segments([5 * BLOCK], [BLOCK])
    for k, dst_block in enumerate([30, 31, 30, 200]):
        far.fill(80 + k)
        buf[:] = pattern(90 + k, SIZE)
        t = local.write(peer, src, remote.segments([dst_block * BLOCK], [BLOCK]))
        assert t.wait(60).ok, t.status()
        t.release()
        theirs = np.frombuffer(far.bytes(), np.uint8).reshape(NBLOCKS, BLOCK)
        assert np.array_equal(theirs[dst_block], buf.reshape(NBLOCKS, BLOCK)[5]), f"write {k}"


def test_inline_posts_finished_by_nixl_hold_no_request_per_transfer(two_proc):
    """A transfer NIXL finished inside ``post`` (the inline path) gives its request back at
    once: 200 posts of one preparation whose Transfers the caller keeps (unreleased) leave
    no NIXL request tracked for those and at most ``IDLE_PER_PREP`` kept for re-posting; the
    last post moved the bytes as they were when it was posted; releasing the rest leaves
    nothing tracked."""
    from kvtransport_nixl import reuse as _reuse
    from kvtransport_nixl.xfer import DONE_INLINE

    local, buf, region, far, peer = two_proc
    be = local._backend
    before = len(be._data.live)  # unreleased transfers of earlier tests on this module's agent
    remote = peer.region(far.region_id)
    lids, rids = _blocks(21, 32)
    prep = local.prepare(kvt.Op.WRITE, peer, _segs(region, lids), _segs(remote, rids))
    kept = []
    for k in range(200):
        buf[lids[0] * BLOCK:(lids[0] + 1) * BLOCK] = k % 251
        t = local.post(prep)
        assert t.wait(60).ok, t.status()
        kept.append(t)
    theirs = np.frombuffer(far.bytes(), np.uint8).reshape(NBLOCKS, BLOCK)
    assert np.array_equal(theirs[rids], buf.reshape(NBLOCKS, BLOCK)[lids])
    # Tracked until released: only requests NIXL had not finished when post returned
    # (with cma nearly none; the first post of a new request may still be in flight).
    unfinished = [t for t in kept if t.backend_handle is not DONE_INLINE]
    assert len(be._data.live) - before == len(unfinished)
    if be.opts.inline_post_bytes >= 32 * BLOCK:
        assert len(unfinished) < len(kept) // 2, len(unfinished)
        entry = be._data._reuse._d[id(prep.request.local_addr)]
        assert 1 <= len(entry.idle) <= _reuse.IDLE_PER_PREP
    for t in kept:
        t.release()
    assert len(be._data.live) == before
    assert local.stats()["pending"] == 0
