"""Agent metadata: strict, bounded decoding (it arrives from the network) and the
compatibility checks ``connect`` applies. Every refusal is a typed error naming what
is wrong, and a refused peer changes nothing for the agent."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

import kvtransport as kvt
from kvtransport import errors
from kvtransport import metadata as md

GOOD_REGION = dict(id=1, addr=0x10000, length=4096, kind="cpu", blob=b"rk")


def _fields(**over) -> dict:
    d = dict(magic=md.MAGIC, protocol=md.PROTOCOL_VERSION, agent="prefill-0", instance="abcd",
             backend="loopback", backend_version="1", blob=b"\x01\x02",
             regions=[[GOOD_REGION[k] for k in ("id", "addr", "length", "kind", "blob")]], layout=None)
    d.update(over)
    return d


def _raw(**over) -> bytes:
    """Metadata encoded from a plain dict, so tests can write what the schema forbids."""
    return msgspec.msgpack.encode(_fields(**over))


def test_round_trip():
    m = md.AgentMetadata(magic=md.MAGIC, protocol=md.PROTOCOL_VERSION, agent="a", instance="i1",
                         backend="loopback", backend_version="1", blob=b"xyz",
                         regions=[md.RegionDesc(3, 4096, 8192, "cpu", b"k"),
                                  md.RegionDesc(9, 1 << 40, 1, "cuda", b"")],
                         layout={"block_size": 16, "dtype": "float16"})
    assert md.decode_metadata(md.encode_metadata(m)) == m
    assert md.decode_metadata(_raw()).regions[0] == md.RegionDesc(**GOOD_REGION)


def test_agent_metadata_round_trip_through_connect():
    buf = np.zeros(8192, np.uint8)
    with kvt.open("loopback", name="rt-a") as a, kvt.open("loopback", name="rt-b") as b:
        r = a.register(buf)
        decoded = md.decode_metadata(a.metadata())
        assert decoded.agent == "rt-a" and decoded.backend == "loopback"
        assert [(x.id, x.addr, x.length, x.kind) for x in decoded.regions] == [(r.id, r.addr, 8192, "cpu")]
        peer = b.connect(a.metadata())
        assert peer.name == "rt-a"
        assert [(x.id, x.addr, x.length) for x in peer.regions] == [(r.id, r.addr, 8192)]


def _refused(blob, match: str | None = None, max_bytes: int = md.MAX_METADATA_BYTES):
    with pytest.raises(errors.PeerMetadataError, match=match):
        md.decode_metadata(blob, max_bytes)


def test_oversized_refused_before_parsing():
    good = _raw()
    _refused(good, "over the 16-byte limit", max_bytes=16)
    _refused(good + b"\x00" * (md.MAX_METADATA_BYTES + 1), "limit")


@pytest.mark.parametrize("cut", [1, 5, 20])
def test_truncated(cut):
    _refused(_raw()[:-cut])


def test_not_bytes():
    _refused("a string", "must be bytes")
    _refused(None, "must be bytes")


def test_garbage_and_trailing_bytes():
    _refused(b"", "not kvtransport metadata")
    _refused(b"\xff" * 64, "not kvtransport metadata")
    _refused(_raw() + b"xx")


def test_wrong_magic():
    _refused(_raw(magic="nixl"), "bad magic")
    _refused(msgspec.msgpack.encode({"hello": 1}), "bad magic")


def test_foreign_protocol_version_named():
    with pytest.raises(errors.PeerMetadataError) as ei:
        md.decode_metadata(_raw(protocol=md.PROTOCOL_VERSION + 1))
    assert f"protocol {md.PROTOCOL_VERSION + 1}" in str(ei.value)
    assert f"speaks {md.PROTOCOL_VERSION}" in str(ei.value)


def test_unknown_fields_refused():
    _refused(msgspec.msgpack.encode({**_fields(), "extra": 1}), "extra")
    region = [GOOD_REGION[k] for k in ("id", "addr", "length", "kind", "blob")] + ["surplus"]
    _refused(_raw(regions=[region]))


def test_missing_field_refused():
    f = _fields()
    del f["backend"]
    _refused(msgspec.msgpack.encode(f), "backend")


def test_duplicate_region_ids_refused():
    r = [GOOD_REGION[k] for k in ("id", "addr", "length", "kind", "blob")]
    _refused(_raw(regions=[r, r]), "duplicate region ids")


@pytest.mark.parametrize("field, value", [
    ("id", -1), ("addr", -4096), ("length", -1), ("length", 0),
    ("addr", 2**64 - 1), ("id", 2**63), ("length", 2**63),
])
def test_negative_and_huge_ints_refused(field, value):
    reg = dict(GOOD_REGION, **{field: value})
    _refused(_raw(regions=[[reg[k] for k in ("id", "addr", "length", "kind", "blob")]]), "malformed")


@pytest.mark.parametrize("over", [
    dict(agent=""), dict(agent="x" * 257), dict(instance="i" * 65), dict(backend_version="v" * 65),
    dict(layout=["block_size", 16]), dict(layout={"block_size": 1.5}), dict(blob="not-bytes"),
    dict(regions=[[1, 2, 3]]), dict(regions="none"),
])
def test_wrong_types_and_lengths_refused(over):
    _refused(_raw(**over), "malformed")


def test_too_many_regions_refused():
    regions = [[i, 4096 * (i + 1), 1, "cpu", b""] for i in range(md.MAX_REGIONS + 1)]
    _refused(_raw(regions=regions), "malformed")


# -- compatibility at connect --------------------------------------------------------------

def _retag(blob: bytes, **over) -> bytes:
    """Re-encode a real agent's metadata with some fields changed."""
    m = md.decode_metadata(blob)
    return md.encode_metadata(msgspec.structs.replace(m, **over))


@pytest.fixture
def pair():
    a = kvt.open("loopback", name="cmp-a", layout={"block_size": 16, "dtype": "bfloat16", "layers": 32})
    b = kvt.open("loopback", name="cmp-b", layout={"block_size": 16, "dtype": "bfloat16", "layers": 32})
    a.register(np.zeros(4096, np.uint8))
    yield a, b
    a.close()
    b.close()


def test_backend_mismatch_names_both_backends(pair):
    a, b = pair
    with pytest.raises(errors.IncompatiblePeerError) as ei:
        b.connect(_retag(a.metadata(), backend="ucx"))
    assert not isinstance(ei.value, errors.LayoutMismatchError)
    assert "'ucx'" in str(ei.value) and "'loopback'" in str(ei.value)
    assert b.stats()["peers_refused"] == 1 and b.peers == {}


def test_backend_version_mismatch_names_versions(pair):
    a, b = pair
    with pytest.raises(errors.IncompatiblePeerError, match="version 7") as ei:
        b.connect(_retag(a.metadata(), backend_version="7"))
    assert "runs 1" in str(ei.value)


def test_layout_mismatch_names_exactly_the_differing_fields(pair):
    a, b = pair
    theirs = {"block_size": 32, "dtype": "float16", "layers": 32}
    with pytest.raises(errors.LayoutMismatchError) as ei:
        b.connect(_retag(a.metadata(), layout=theirs))
    msg = str(ei.value)
    assert "block_size: ours=16 theirs=32" in msg
    assert "dtype: ours='bfloat16' theirs='float16'" in msg
    assert "layers" not in msg
    assert isinstance(ei.value, errors.IncompatiblePeerError)


def test_layout_field_missing_on_one_side_is_a_mismatch(pair):
    a, b = pair
    with pytest.raises(errors.LayoutMismatchError, match="layers: ours=32 theirs=None"):
        b.connect(_retag(a.metadata(), layout={"block_size": 16, "dtype": "bfloat16"}))


def test_refused_peer_changes_nothing(pair):
    """After refusals of every kind the agent still connects and moves bytes."""
    a, b = pair
    good = a.metadata()
    for blob in (good[:-3], _retag(good, backend="ucx"), _retag(good, layout={"block_size": 1})):
        with pytest.raises(errors.KVTransportError):
            b.connect(blob)
    assert b.stats()["peers_refused"] == 3
    dst = np.zeros(4096, np.uint8)
    rb = b.register(dst)
    peer = b.connect(good)
    a.regions[0].owner[:] = 7
    assert b.read(peer, rb.whole(), peer.regions[0].whole()).wait(10).ok
    assert (dst == 7).all()
