"""Hostile input thrown at a live agent: random, truncated, oversized, mutated and
replayed metadata at ``connect``, junk frames at the loopback notification socket.
Only typed errors come out, nothing crashes, and a good peer is still served after."""

from __future__ import annotations

import time

import msgspec
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvtransport as kvt
from kvtransport import errors

#: What ``connect`` may raise for bad metadata. A flipped bit can turn a region's memory kind
#: into an unknown one ("cpu" -> "bpu"): that is refused as the documented
#: UnsupportedMemoryKindError, which names the kind and the backends that accept it.
REFUSALS = (errors.PeerMetadataError, errors.IncompatiblePeerError, errors.UnsupportedMemoryKindError)


@pytest.fixture(scope="module")
def agents():
    a = kvt.open("loopback", name="fuzz-target")
    good = kvt.open("loopback", name="fuzz-good")
    ba, bg = np.zeros(1 << 16, np.uint8), np.arange(1 << 16, dtype=np.uint64).view(np.uint8)[: 1 << 16].copy()
    ra, rg = a.register(ba), good.register(bg)
    yield a, good, ra, rg, ba, bg
    a.close()
    good.close()


def _still_serves(a, good, ra, rg, ba, bg):
    peer = a.connect(good.metadata())
    ba[:] = 0
    t = a.read(peer, ra.segments([0], [4096]), peer.region(rg.id).segments([4096], [4096]))
    assert t.wait(10).ok
    assert np.array_equal(ba[:4096], bg[4096:8192])


_settings = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@_settings
@given(blob=st.binary(max_size=4096))
def test_random_bytes_refused(agents, blob):
    a = agents[0]
    with pytest.raises(REFUSALS):
        a.connect(blob)


@_settings
@given(data=st.data())
def test_mutated_metadata_refused_or_sane(agents, data):
    a, good = agents[0], agents[1]
    md = bytearray(good.metadata())
    kind = data.draw(st.sampled_from(["flip", "truncate", "extend", "splice"]))
    if kind == "flip":
        i = data.draw(st.integers(0, len(md) - 1))
        md[i] ^= data.draw(st.integers(1, 255))
    elif kind == "truncate":
        md = md[: data.draw(st.integers(0, len(md) - 1))]
    elif kind == "extend":
        md += data.draw(st.binary(min_size=1, max_size=64))
    else:
        i = data.draw(st.integers(0, len(md)))
        md[i:i] = data.draw(st.binary(min_size=1, max_size=32))
    try:
        peer = a.connect(bytes(md))
    except REFUSALS:
        return
    # Accepted: then it still describes a live, same-host loopback peer; regions sane.
    assert all(r.length > 0 for r in peer.regions)


@_settings
@given(doc=st.dictionaries(st.sampled_from(["magic", "protocol", "agent", "instance", "backend",
                                             "backend_version", "blob", "regions", "layout", "x"]),
                           st.one_of(st.integers(-2**70, 2**70), st.text(max_size=20), st.binary(max_size=20),
                                     st.lists(st.integers(), max_size=5), st.none()), max_size=10))
def test_structured_garbage_refused(agents, doc):
    a = agents[0]
    try:
        blob = msgspec.msgpack.encode(doc)
    except OverflowError:
        return
    with pytest.raises(REFUSALS):
        a.connect(blob)


def test_foreign_version_and_oversized(agents):
    a, good = agents[0], agents[1]
    doc = msgspec.msgpack.decode(good.metadata())
    doc["protocol"] = 99
    with pytest.raises(errors.PeerMetadataError, match="protocol 99"):
        a.connect(msgspec.msgpack.encode(doc))
    with pytest.raises(errors.PeerMetadataError, match="limit"):
        a.connect(b"\x00" * (5 << 20))
    _still_serves(*agents)


def test_replayed_metadata_of_dead_peer_refused(agents):
    a = agents[0]
    ghost = kvt.open("loopback", name="ghost")
    ghost.register(np.zeros(4096, np.uint8))
    md = ghost.metadata()
    ghost.close()
    # Same process, so the pid lives on: the replay connects, but the ghost's memory is
    # only reachable through its registered regions, all range-checked. A replay from a
    # dead *process* is refused: covered by tests/core (pid + start time).
    peer = a.connect(md)
    assert [r.length for r in peer.regions] == [4096]
    _still_serves(*agents)


def test_junk_on_the_notification_socket(agents):
    a, good, ra, rg, ba, bg = agents
    addr = a.describe()["notify_addr"]
    refused0 = a.describe()["notification_refusals"]
    ctx = zmq.Context()
    s2 = ctx.socket(zmq.PUSH)
    s2.setsockopt(zmq.LINGER, 1000)
    s2.connect(addr)
    s2.send_multipart([b"big", b"x" * (2 << 20)])  # over MAXMSGSIZE: the connection is dropped unread
    s = ctx.socket(zmq.PUSH)
    s.setsockopt(zmq.LINGER, 1000)
    s.connect(addr)
    junk = ([b"one frame only"], [b"a", b"b", b"c"], [b"\xff\xfe", b""], [b"", b"x" * 1000])
    for frames in junk:
        s.send_multipart(frames)
    # Ordering fact, not a sleep: every junk message is refused and counted, one each.
    deadline = time.monotonic() + 10
    while a.describe()["notification_refusals"] < refused0 + len(junk) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert a.describe()["notification_refusals"] == refused0 + len(junk)
    assert a.notifications() == []  # none of it was delivered
    # A real peer's notification still arrives.
    peer_g = good.connect(a.metadata())
    good.send_notification(peer_g, b"genuine")
    deadline = time.monotonic() + 5
    seen = []
    while not seen and time.monotonic() < deadline:
        seen = [n for n in a.notifications() if n.payload == b"genuine"]
        time.sleep(0.01)
    assert seen and seen[0].peer == "fuzz-good"
    s.close(0)
    s2.close(0)
    ctx.term()
    _still_serves(*agents)
