"""Glue tests of the moriio backend, driven through the SPI against a FAKE mori.io.

What these prove: our translation between kvtransport and the mori.io surface
(descriptors, grouped offsets, status and failure mapping, metadata). What they do not
prove: that mori moves bytes over RDMA. That is test_hardware_moriio.py and
bench/moriio_validate.py, on MI300X nodes.
"""

from __future__ import annotations

import time

import msgspec
import numpy as np
import pytest

from kvtransport.errors import BackendOptionError, PeerMetadataError
from kvtransport.spi import LocalRegion, Op, PollState, PostRequest, RemoteRegion
from kvtransport_moriio.backend import MoriioBackend
from kvtransport_moriio.wire import decode_agent_blob, encode_agent_blob

from .conftest import Side
from .fake_mori_io import MemoryDesc, MemoryLocationType, PeerFailureReason, StatusCode, make_fake_mori_io


def make_req(op, tid, peer, peer_name, local: Side, remote: Side, lr, lo, rr, ro, ln, notify=None):
    lr, rr = np.asarray(lr, np.int64), np.asarray(rr, np.int64)
    lo, ro, ln = (np.asarray(x, np.uint64) for x in (lo, ro, ln))
    laddr_base = {r.id: r.addr for r in local.regions}
    raddr_base = {r.id: r.addr for r in remote.regions}
    laddr = np.array([laddr_base[int(i)] for i in lr], np.uint64) + lo
    raddr = np.array([raddr_base[int(i)] for i in rr], np.uint64) + ro
    return PostRequest(op, tid, peer, peer_name, lr, lo, laddr, rr, ro, raddr, ln, notify)


def buf_of(side: Side, region_id: int) -> np.ndarray:
    return side.bufs[[r.id for r in side.regions].index(region_id)]


def wait_notifications(be, n=1, timeout=5.0):
    out, end = [], time.monotonic() + timeout
    while len(out) < n and time.monotonic() < end:
        out += be.notifications()
        if len(out) < n:
            time.sleep(0.005)
    return out


# ----------------------------------------------------------------------------- descriptors
def test_register_cpu_region_translates_to_register_memory_fake_mori(fake_io):
    a = Side("a", fake_io, sizes=(4096,))
    r = a.regions[0]
    calls = [c for c in fake_io.fabric.calls if c[2] == "register_memory"]
    assert len(calls) == 1 and calls[0][3] == 4  # (ptr, size, device_id, mem_loc)
    md = MemoryDesc.unpack(a.blobs[0])
    assert (md.data, md.size, md.device_id, md.loc) == (r.addr, r.length, -1, MemoryLocationType.CPU)
    assert md.engine_key == a.be.describe()["engine_key"]
    a.be.deregister(r)
    assert [c[2] for c in fake_io.fabric.calls].count("deregister_memory") == 1
    a.be.close()


def test_register_gpu_kind_uses_gpu_location_and_device_fake_mori(fake_io):
    be = MoriioBackend("g", {"mori_module": fake_io, "host": "127.0.0.1"})
    seen = []
    orig = be._engine.register_memory

    def spy(ptr, size, device_id, mem_loc):  # the fake refuses GPU memory; record the translation
        seen.append((ptr, size, device_id, mem_loc))
        return MemoryDesc(be._engine.key, 99, device_id, ptr, size, mem_loc)

    be._engine.register_memory = spy
    be.register(LocalRegion(5, 0x7F0000000000, 1 << 20, kind="cuda", device=3))
    be.register(LocalRegion(6, 0x7F0000100000, 1 << 20, kind="rocm", device=1))
    assert seen == [
        (0x7F0000000000, 1 << 20, 3, MemoryLocationType.GPU),
        (0x7F0000100000, 1 << 20, 1, MemoryLocationType.GPU),
    ]
    with pytest.raises(ValueError, match="no device index"):
        be.register(LocalRegion(7, 0x7F0000200000, 64, kind="cuda", device=-1))
    with pytest.raises(ValueError, match="kind 'nvme'"):
        be.register(LocalRegion(8, 0x7F0000300000, 64, kind="nvme"))
    be._engine.register_memory = orig
    be.close()


# ----------------------------------------------------------------------------- metadata
def test_metadata_round_trip_registers_remote_engine_fake_mori(fake_io):
    a = Side("a", fake_io, sizes=(4096,))
    b = Side("b", fake_io, sizes=(8192,), first_id=4)
    blob = decode_agent_blob(b.be.export(), "b")
    assert blob.engine_key == b.be.describe()["engine_key"]
    assert blob.notify_address == b.be.describe()["notify_address"]
    peer = a.connect(b)
    registered = [c for c in fake_io.fabric.calls if c[0] == a.be.describe()["engine_key"] and c[2] == "register_remote_engine"]
    assert len(registered) == 1
    engine_a = fake_io.fabric.engines[a.be.describe()["engine_key"]]
    desc = engine_a._remote[blob.engine_key]
    assert desc == fake_io.fabric.engines[blob.engine_key].get_engine_desc()
    assert desc.port == b.be.describe()["port"] != 0  # read after create_backend bound the port
    assert set(peer.remote_mds) == {4}
    assert peer.remote_mds[4] == MemoryDesc.unpack(b.blobs[0])
    a.be.close()
    b.be.close()


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda blob, regions: (b"\x93garbage", regions), "malformed moriio blob"),
        (lambda blob, regions: (b"x" * 70000, regions), "over the"),
        (
            lambda blob, regions: (
                encode_agent_blob(msgspec.structs.replace(blob, v=99)),
                regions,
            ),
            "has version 99",
        ),
        (
            lambda blob, regions: (
                encode_agent_blob(msgspec.structs.replace(blob, engine_desc=b"\xc1junk")),
                regions,
            ),
            "engine descriptor mori cannot unpack",
        ),
        (
            lambda blob, regions: (
                encode_agent_blob(msgspec.structs.replace(blob, engine_key="someone-else")),
                regions,
            ),
            "but its blob names",
        ),
        (
            lambda blob, regions: (
                encode_agent_blob(blob),
                [RemoteRegion(r.id, r.addr, r.length * 2, r.kind, r.blob) for r in regions],
            ),
            "covers only",
        ),
        (
            lambda blob, regions: (
                encode_agent_blob(blob),
                [RemoteRegion(r.id, r.addr, r.length, r.kind, b"not a memory desc") for r in regions],
            ),
            "no valid mori MemoryDesc",
        ),
        (  # a blob from before authenticated notifications: nothing we seal would be accepted
            lambda blob, regions: (encode_agent_blob(msgspec.structs.replace(blob, notify_key=b"")), regions),
            "no notification key",
        ),
    ],
)
def test_bad_peer_metadata_is_a_typed_error_fake_mori(fake_io, mutate, match):
    a = Side("a", fake_io, sizes=(4096,))
    b = Side("b", fake_io, sizes=(4096,), first_id=4)
    blob = decode_agent_blob(b.be.export(), "b")
    data, regions = mutate(blob, b.remote_view())
    with pytest.raises(PeerMetadataError, match=match):
        a.be.connect("b", data, regions)
    # A refused peer changes nothing: no remote engine was registered.
    assert not [c for c in fake_io.fabric.calls if c[2] == "register_remote_engine"]
    a.be.close()
    b.be.close()


def test_region_of_another_engine_is_refused_fake_mori(fake_io):
    a = Side("a", fake_io, sizes=(4096,))
    b = Side("b", fake_io, sizes=(4096,), first_id=4)
    c = Side("c", fake_io, sizes=(4096,), first_id=4)
    with pytest.raises(PeerMetadataError, match="belongs to mori engine"):
        a.be.connect("b", b.be.export(), c.remote_view())
    for s in (a, b, c):
        s.be.close()


# ----------------------------------------------------------------------------- merged offsets
def test_segments_grouped_into_one_batch_per_region_pair_fake_mori(sides, fake_io):
    a, b, peer, _ = sides
    # Interleave 4 region pairs; within each pair the order must survive.
    lr = [1, 2, 1, 2, 1, 1, 2]
    rr = [10, 10, 11, 11, 10, 11, 10]
    lo = [0, 100, 200, 300, 400, 500, 600]
    ro = [1000, 2000, 3000, 4000, 5000, 6000, 7000]
    ln = [10, 20, 30, 40, 50, 60, 70]
    h = a.be.post(make_req(Op.READ, 1, peer, "b", a, b, lr, lo, rr, ro, ln))
    assert a.be.poll(h).state is PollState.DONE
    got = {(x.local_mem_id, x.remote_mem_id): (x.local_offsets, x.remote_offsets, x.sizes) for x in fake_io.fabric.batches}
    mem = {r.id: MemoryDesc.unpack(bl).id for r, bl in zip(a.regions + b.regions, a.blobs + b.blobs)}
    assert got == {
        (mem[1], mem[10]): ([0, 400], [1000, 5000], [10, 50]),
        (mem[2], mem[10]): ([100, 600], [2000, 7000], [20, 70]),
        (mem[1], mem[11]): ([200, 500], [3000, 6000], [30, 60]),
        (mem[2], mem[11]): ([300], [4000], [40]),
    }
    assert all(x.op == "read" for x in fake_io.fabric.batches)
    # Every segment's bytes landed where the glue said (remote -> local for READ).
    for l_, r_, o1, o2, n in zip(lr, rr, lo, ro, ln):
        assert np.array_equal(buf_of(a, l_)[o1:o1 + n], buf_of(b, r_)[o2:o2 + n])
    # Sessions are cached per pair: a second transfer opens no new session.
    sessions = a.be.describe()["sessions_created"]
    h2 = a.be.post(make_req(Op.WRITE, 2, peer, "b", a, b, [1], [0], [10], [64], [8]))
    assert a.be.poll(h2).state is PollState.DONE
    assert a.be.describe()["sessions_created"] == sessions == 4
    assert fake_io.fabric.batches[-1].op == "write"
    assert np.array_equal(buf_of(b, 10)[64:72], buf_of(a, 1)[0:8])


def test_write_moves_local_to_remote_only_fake_mori(sides):
    a, b, peer, _ = sides
    before_a = [x.copy() for x in a.bufs]
    before_b = [x.copy() for x in b.bufs]
    h = a.be.post(make_req(Op.WRITE, 3, peer, "b", a, b, [2, 2], [0, 4096], [11, 11], [8192, 100], [4096, 16]))
    assert a.be.poll(h).state is PollState.DONE
    for x, y in zip(a.bufs, before_a):
        assert np.array_equal(x, y)  # source untouched
    expect = before_b[1].copy()
    expect[8192:12288] = before_a[1][0:4096]
    expect[100:116] = before_a[1][4096:4112]
    assert np.array_equal(b.bufs[1], expect)
    assert np.array_equal(b.bufs[0], before_b[0])


# ----------------------------------------------------------------------------- status mapping
def test_pending_until_mori_reports_success_fake_mori():
    io = make_fake_mori_io(mode="deferred")
    a, b = Side("a", io, sizes=(4096,)), Side("b", io, sizes=(4096,), first_id=4)
    peer = a.connect(b)
    b.connect(a)
    h = a.be.post(make_req(Op.READ, 1, peer, "b", a, b, [1], [0], [4], [0], [128], notify=b"done-1"))
    for _ in range(3):
        assert a.be.poll(h).state is PollState.PENDING
    assert not np.array_equal(a.bufs[0][:128], b.bufs[0][:128])
    assert b.be.notifications() == []  # no notification before the data moved
    assert a.be.cancel(h) is False  # in flight: cannot promise quiescence
    io.fabric.complete_all()
    # cancel() above marked it; un-cancelled path is exercised below with a fresh transfer
    h2 = a.be.post(make_req(Op.READ, 2, peer, "b", a, b, [1], [256], [4], [256], [64], notify=b"done-2"))
    assert a.be.poll(h2).state is PollState.PENDING
    io.fabric.complete_all()
    assert a.be.poll(h2).state is PollState.DONE
    assert np.array_equal(a.bufs[0][256:320], b.bufs[0][256:320])
    assert wait_notifications(b.be) == [("a", b"done-2")]
    a.be.close()
    b.be.close()


def test_mori_failure_maps_to_failed_with_code_and_message_fake_mori(sides, fake_io):
    a, b, peer, _ = sides
    fake_io.fabric.fail_next(StatusCode.ERR_RDMA_OP, "remote access error on qp 17")
    h = a.be.post(make_req(Op.READ, 1, peer, "b", a, b, [1], [0], [10], [0], [64], notify=b"never"))
    res = a.be.poll(h)
    assert res.state is PollState.FAILED and res.quiesced
    assert "ERR_RDMA_OP" in res.reason and "remote access error on qp 17" in res.reason and "'b'" in res.reason
    assert a.be.poll(h) == res  # terminal state is stable
    # A failed transfer sends no notification: a sentinel sent afterwards on the same
    # socket is the first thing b receives.
    a.be.send_notification(peer, b"sentinel")
    assert wait_notifications(b.be) == [("a", b"sentinel")]


def test_one_failed_pair_with_sibling_in_flight_is_not_quiesced_fake_mori(sides, fake_io):
    a, b, peer, _ = sides
    fake_io.fabric.fail_next(StatusCode.ERR_RDMA_OP, "boom")  # first pair (1,10) fails
    fake_io.fabric.hang_next()  # hang_next applies after fail_next is consumed: second pair hangs
    h = a.be.post(make_req(Op.READ, 1, peer, "b", a, b, [1, 2], [0, 0], [10, 10], [0, 64], [32, 32]))
    res = a.be.poll(h)
    assert res.state is PollState.FAILED and not res.quiesced  # bytes of pair 2 may still land
    assert a.be.cancel(h) is False and a.be.quiesced(h) is False
    fake_io.fabric.complete_all()
    assert a.be.quiesced(h) is True
    assert a.be.poll(h).quiesced


# ----------------------------------------------------------------------------- failure mapping
def test_peer_failure_fails_inflight_and_condemns_connection_fake_mori():
    io = make_fake_mori_io(mode="deferred")
    a, b = Side("a", io, sizes=(4096,)), Side("b", io, sizes=(4096,), first_id=4)
    c = Side("c", io, sizes=(4096,), first_id=7)
    pb, pc = a.connect(b), a.connect(c)
    h_b = a.be.post(make_req(Op.READ, 1, pb, "b", a, b, [1], [0], [4], [0], [64]))
    h_c = a.be.post(make_req(Op.READ, 2, pc, "c", a, c, [1], [64], [7], [0], [64]))
    key_a, key_b = a.be.describe()["engine_key"], b.be.describe()["engine_key"]
    io.fabric.inject_peer_failure(key_a, key_b, PeerFailureReason.PEER_UNREACHABLE, "IBV_EVENT_QP_FATAL qp 7")
    res = a.be.poll(h_b)
    assert res.state is PollState.FAILED
    assert "PEER_UNREACHABLE" in res.reason and "IBV_EVENT_QP_FATAL" in res.reason and "'b'" in res.reason
    assert not res.quiesced  # mori has not flushed the batch yet
    io.fabric.fail_inflight_to(key_b)  # the QP flush completes the batch with an error
    assert a.be.quiesced(h_b) and a.be.poll(h_b).quiesced
    assert a.be.poll(h_c).state is PollState.PENDING  # another peer is unaffected
    with pytest.raises(RuntimeError, match="failed earlier"):
        a.be.post(make_req(Op.READ, 3, pb, "b", a, b, [1], [0], [4], [0], [8]))
    # Reconnecting (fresh metadata) gives a usable connection again.
    pb2 = a.connect(b)
    h3 = a.be.post(make_req(Op.READ, 4, pb2, "b", a, b, [1], [0], [4], [0], [8]))
    io.fabric.complete_all()
    assert a.be.poll(h3).state is PollState.DONE
    assert a.be.poll(h_c).state is PollState.DONE
    for s in (a, b, c):
        s.be.close()


def test_device_wide_failure_fails_all_peers_but_condemns_none_fake_mori():
    io = make_fake_mori_io(mode="deferred")
    a, b = Side("a", io, sizes=(4096,)), Side("b", io, sizes=(4096,), first_id=4)
    pb = a.connect(b)
    h = a.be.post(make_req(Op.WRITE, 1, pb, "b", a, b, [1], [0], [4], [0], [64]))
    io.fabric.inject_peer_failure(a.be.describe()["engine_key"], "", PeerFailureReason.LOCAL_PORT_DOWN, "port 1 down")
    res = a.be.poll(h)
    assert res.state is PollState.FAILED and "LOCAL_PORT_DOWN" in res.reason
    io.fabric.complete_all()
    # The port can come back: the connection is not condemned.
    h2 = a.be.post(make_req(Op.WRITE, 2, pb, "b", a, b, [1], [0], [4], [0], [64]))
    io.fabric.complete_all()
    assert a.be.poll(h2).state is PollState.DONE
    a.be.close()
    b.be.close()


def test_disconnect_and_close_fail_inflight_fake_mori():
    io = make_fake_mori_io(mode="deferred")
    a, b = Side("a", io, sizes=(4096,)), Side("b", io, sizes=(4096,), first_id=4)
    pb = a.connect(b)
    h = a.be.post(make_req(Op.READ, 1, pb, "b", a, b, [1], [0], [4], [0], [64]))
    a.be.disconnect(pb)
    res = a.be.poll(h)
    assert res.state is PollState.FAILED and "disconnected" in res.reason and not res.quiesced
    assert [c[2] for c in io.fabric.calls].count("deregister_remote_engine") == 1
    with pytest.raises(RuntimeError, match="no longer connected"):
        a.be.post(make_req(Op.READ, 2, pb, "b", a, b, [1], [0], [4], [0], [8]))
    io.fabric.complete_all()
    assert a.be.poll(h).quiesced
    pb2 = a.connect(b)
    h2 = a.be.post(make_req(Op.READ, 3, pb2, "b", a, b, [1], [0], [4], [0], [8]))
    a.be.close()
    assert a.be.poll(h2).state is PollState.FAILED and "closed" in a.be.poll(h2).reason
    b.be.close()


def test_reconnect_same_engine_keeps_inflight_restart_fails_it_fake_mori():
    io = make_fake_mori_io(mode="deferred")
    a, b = Side("a", io, sizes=(4096,)), Side("b", io, sizes=(4096,), first_id=4)
    pb = a.connect(b)
    h = a.be.post(make_req(Op.READ, 1, pb, "b", a, b, [1], [0], [4], [0], [64]))
    pb_again = a.connect(b)  # same engine, re-exported regions
    assert a.be.poll(h).state is PollState.PENDING
    assert [c[2] for c in io.fabric.calls].count("register_remote_engine") == 1
    io.fabric.complete_all()
    assert a.be.poll(h).state is PollState.DONE
    h2 = a.be.post(make_req(Op.READ, 2, pb_again, "b", a, b, [1], [0], [4], [0], [64]))
    b.be.close()
    b2 = Side("b", io, sizes=(4096,), first_id=4)  # restarted: same name, new engine
    a.connect(b2)
    res = a.be.poll(h2)
    assert res.state is PollState.FAILED and "restarted" in res.reason
    a.be.close()
    b2.be.close()


def test_post_failure_after_partial_post_reports_failed_not_raise_fake_mori(sides, fake_io):
    a, b, peer, _ = sides
    fake_io.fabric.hang_next()
    orig = a.be._data._session
    n = {"calls": 0}

    def flaky(p, lid, rid):
        n["calls"] += 1
        if n["calls"] == 2:
            raise RuntimeError("mori CreateSession failed")
        return orig(p, lid, rid)

    a.be._data._session = flaky
    h = a.be.post(make_req(Op.READ, 1, peer, "b", a, b, [1, 2], [0, 0], [10, 10], [0, 0], [8, 8]))
    res = a.be.poll(h)
    assert res.state is PollState.FAILED and "CreateSession failed" in res.reason and not res.quiesced
    fake_io.fabric.complete_all()
    assert a.be.poll(h).quiesced
    n["calls"] = 1
    with pytest.raises(RuntimeError, match="CreateSession failed"):  # nothing in flight: raise
        a.be.post(make_req(Op.READ, 2, peer, "b", a, b, [2], [0], [10], [0], [8]))


# ----------------------------------------------------------------------------- options
def test_rdma_knobs_reach_mori_config_and_defaults_are_moris_fake_mori(fake_io):
    be = MoriioBackend("k", {"mori_module": fake_io, "host": "127.0.0.1", "qp_per_transfer": 4,
                             "post_batch_size": 32, "num_worker_threads": 2, "enable_transfer_chunking": True,
                             "chunk_bytes": 1 << 20, "poll_cq_mode": "event"})
    (create,) = [c for c in fake_io.fabric.calls if c[2] == "create_backend"]
    cfg = be._backend_config
    assert (cfg.qp_per_transfer, cfg.post_batch_size, cfg.num_worker_threads) == (4, 32, 2)
    assert cfg.enable_transfer_chunking is True and cfg.chunk_bytes == 1 << 20
    assert cfg.poll_cq_mode == fake_io.PollCqMode.EVENT
    untouched = fake_io.RdmaBackendConfig()
    assert cfg.max_chunks_per_transfer == untouched.max_chunks_per_transfer
    assert be.describe()["backend_config"]["qp_per_transfer"] == 4
    be.close()
    d = MoriioBackend("d", {"mori_module": fake_io, "host": "127.0.0.1"})
    eff = d.describe()["backend_config"]
    fresh = fake_io.RdmaBackendConfig()
    assert {k: v for k, v in eff.items() if k != "poll_cq_mode"} == {k: getattr(fresh, k) for k in eff if k != "poll_cq_mode"}
    d.close()


def test_xgmi_transport_creates_xgmi_backend_fake_mori(fake_io):
    be = MoriioBackend("x", {"mori_module": fake_io, "host": "127.0.0.1", "transport": "xgmi", "xgmi_num_streams": 8})
    engine = fake_io.fabric.engines[be.describe()["engine_key"]]
    assert list(engine._backends) == [fake_io.BackendType.XGMI]
    assert engine._backends[fake_io.BackendType.XGMI].num_streams == 8
    be.close()


@pytest.mark.parametrize(
    "opts, match",
    [
        ({"qp_per_transfr": 2}, r"unknown option\(s\) \['qp_per_transfr'\]"),
        ({"qp_per_transfer": 0}, "must be an integer >= 1"),
        ({"qp_per_transfer": "4"}, "must be an int"),
        ({"enable_transfer_chunking": 1}, "must be True or False"),
        ({"transport": "tcp"}, "must be one of"),
        ({"transport": "xgmi", "qp_per_transfer": 2}, "with transport='xgmi'"),
        ({"xgmi_num_streams": 4}, "need transport='xgmi'"),
        ({"port": 70000}, "from 0 to 65535"),
        ({"poll_cq_mode": "busy"}, "must be one of"),
    ],
)
def test_bad_options_are_typed_errors_fake_mori(fake_io, opts, match):
    with pytest.raises(BackendOptionError, match=match):
        MoriioBackend("o", {"mori_module": fake_io, "host": "127.0.0.1", **opts})


def test_create_backend_failure_is_backend_unavailable_fake_mori(fake_io):
    from kvtransport.errors import BackendUnavailableError

    def boom(self, type, config=None):  # noqa: A002
        raise RuntimeError("no active RDMA device on this host")

    fake_io.IOEngine.create_backend = boom
    with pytest.raises(BackendUnavailableError, match="no active RDMA device"):
        MoriioBackend("u", {"mori_module": fake_io, "host": "127.0.0.1"})


# ----------------------------------------------------------------------------- notifications
def test_standalone_notification_and_malformed_input_fake_mori(sides):
    a, b, peer, _ = sides
    a.be.send_notification(peer, b"hello b")
    assert wait_notifications(b.be) == [("a", b"hello b")]
    import zmq

    from kvtransport.auth import Authenticator
    from kvtransport.notify import CHANNEL

    # Unsealed input (what was accepted before notifications were authenticated) is
    # refused; so is input sealed with b's key that does not decode. The last frame, on
    # the same socket, is the sentinel: once it arrives every frame before it was handled.
    seal = Authenticator(decode_agent_blob(b.be.export(), "b").notify_key, CHANNEL).seal
    s = zmq.Context.instance().socket(zmq.PUSH)
    s.connect(b.be.describe()["notify_address"])
    s.send(b"\xff\xfenot msgpack")
    s.send(msgspec.msgpack.encode((1, "a", b"unsealed, old format")))
    s.send(seal(b"\xff\xfenot msgpack"))
    s.send(seal(msgspec.msgpack.encode((7, "n", "a", b"wrong version"))))
    s.send(seal(msgspec.msgpack.encode((1, "n", "a", b"good"))))
    got = wait_notifications(b.be)
    s.close(linger=0)
    assert got == [("a", b"good")]
    d = b.be.describe()
    assert d["malformed_notifications"] == 2 and d["notification_refusals"] == 4


def test_finished_transfers_are_not_tracked_forever_fake_mori(sides):
    a, b, peer, _ = sides
    for tid in range(50):
        h = a.be.post(make_req(Op.READ, tid, peer, "b", a, b, [1], [0], [10], [0], [8]))
        assert a.be.poll(h).state is PollState.DONE
    assert not peer.inflight  # a vLLM worker that never calls release() does not leak handles


def test_disconnect_closes_the_notification_socket_fake_mori(sides):
    a, b, peer, _ = sides
    addr = peer.notify_address
    assert addr in a.be._peers.outboxes
    a.be.disconnect(peer)
    assert addr not in a.be._peers.outboxes
