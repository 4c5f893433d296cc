"""Side channel: versioned msgspec messages sealed with the cluster secret; malformed,
wrong-version, unauthenticated, replayed and oversized input is refused and never reaches
the handler (lifecycle.md section 5)."""

import time

import msgspec
import pytest
import zmq

from harness import free_port_base
from kvtransport.auth import Authenticator
from kvtransport_vllm.config import AUTH_CHANNEL
from kvtransport_vllm.messages import Done, Error, Renew, Reply, decode, encode
from kvtransport_vllm.side_channel import SideChannelClient, SideChannelServer, TokenBucket

pytestmark = pytest.mark.timeout(60)

SECRET = b"side-channel-test-secret-0123"


def _auth(secret=SECRET):
    return Authenticator(secret, AUTH_CHANNEL)


@pytest.fixture
def server():
    seen = []

    def handler(msg):
        seen.append(msg)
        return Reply(status={k: "ok" for k in msg.keys})

    port = free_port_base(1)
    srv = SideChannelServer("127.0.0.1", port, handler, auth=_auth(), max_message_bytes=4096)
    yield port, srv, seen
    srv.close()


def _raw(port, payload: bytes, timeout=5.0):
    """Send one frame from a bare DEALER; the raw reply bytes (None: no reply)."""
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(f"tcp://127.0.0.1:{port}")
    s.send(payload)
    out = s.recv() if s.poll(int(timeout * 1000)) else None
    s.close(0)
    return out


def _roundtrip(client, msg, timeout=5.0):
    cid = client.send(msg)
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for r in client.poll():
            if r.cid == cid:
                return r
        time.sleep(0.005)
    return None


def test_valid_sealed_message_served(server):
    port, srv, seen = server
    c = SideChannelClient("127.0.0.1", port, auth=_auth())
    try:
        r = _roundtrip(c, Renew(keys=["a"]))
        assert isinstance(r, Reply) and r.status == {"a": "ok"} and len(seen) == 1
        assert srv.counters["served"] == 1 and srv.counters["auth"] == 0
    finally:
        c.close()


def test_wrong_secret_refused_before_handler(server):
    port, srv, seen = server
    c = SideChannelClient("127.0.0.1", port, auth=_auth(b"not-the-cluster-secret-42"))
    try:
        assert _roundtrip(c, Done(keys=["a"]), timeout=1.0) is None  # the refusal is not authentic to us
        assert not seen and srv.counters["auth"] == 1 and c.counters["auth"] == 1
    finally:
        c.close()


def test_unsealed_message_gets_auth_error_only(server):
    port, srv, seen = server
    r = decode(_raw(port, encode(Done(keys=["a"]))))
    assert isinstance(r, Error) and r.code == "auth" and "side_channel_secret" in r.message and not seen


def test_replayed_message_refused(server):
    port, srv, seen = server
    frame = _auth().seal(encode(Renew(keys=["r"])), "req")
    first = _raw(port, frame)
    assert isinstance(decode(_auth().open(first, "rep")), Reply)
    again = decode(_raw(port, frame))
    assert isinstance(again, Error) and again.code == "auth" and "replayed" in again.message
    assert [m.keys for m in seen] == [["r"]]


def test_reply_sealed_as_request_is_refused(server):
    """Direction is bound into the MAC: a captured reply cannot be replayed as a request."""
    port, srv, seen = server
    r = decode(_raw(port, _auth().seal(encode(Renew(keys=["x"])), "rep")))
    assert isinstance(r, Error) and r.code == "auth" and not seen


def test_malformed_body_with_valid_seal_refused(server):
    port, srv, seen = server
    r = decode(_raw(port, _auth().seal(b"\x00garbage\xff", "req")))
    assert isinstance(r, Error) and r.code == "malformed" and not seen


def test_unknown_field_refused(server):
    port, srv, seen = server
    body = msgspec.msgpack.encode({"t": "renew", "v": 1, "cid": 3, "keys": ["a"], "token": "x"})
    r = decode(_raw(port, _auth().seal(body, "req")))
    assert isinstance(r, Error) and r.code == "malformed" and "token" in r.message and not seen


def test_wrong_version_refused(server):
    port, srv, seen = server
    r = decode(_raw(port, _auth().seal(encode(Done(keys=["a"], v=99)), "req")))
    assert isinstance(r, Error) and r.code == "version" and "version 99" in r.message and not seen


def test_oversized_dropped_server_keeps_serving(server):
    port, srv, seen = server
    assert _raw(port, _auth().seal(encode(Done(keys=["x" * 10000])), "req"), timeout=0.5) is None
    c = SideChannelClient("127.0.0.1", port, auth=_auth())
    try:
        assert isinstance(_roundtrip(c, Renew(keys=["b"])), Reply)
        assert [m.keys for m in seen] == [["b"]]
    finally:
        c.close()


def test_failed_authentications_are_rate_limited(server):
    """Past the burst, failures get no reply at all (a flood costs no replies); a good
    peer is still served."""
    port, srv, seen = server
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(f"tcp://127.0.0.1:{port}")
    try:
        for i in range(200):
            s.send(b"junk-%d" % i)
        deadline = time.monotonic() + 5
        while srv.counters["auth"] < 200 and time.monotonic() < deadline:
            time.sleep(0.01)
        replies = 0
        while s.poll(200):
            s.recv()
            replies += 1
        assert srv.counters["auth"] == 200
        assert srv.counters["dropped"] >= 150 and replies == 200 - srv.counters["dropped"]
        assert replies <= 40  # burst 20 + refill at 10/s during the flood
    finally:
        s.close(0)
    c = SideChannelClient("127.0.0.1", port, auth=_auth())
    try:
        assert isinstance(_roundtrip(c, Renew(keys=["g"])), Reply) and [m.keys for m in seen] == [["g"]]
    finally:
        c.close()


def test_token_bucket():
    b = TokenBucket(rate=0.0, burst=3)
    assert [b.take() for _ in range(5)] == [True, True, True, False, False]


def test_explicitly_open_server_accepts_plain_messages():
    """auth=None is the explicit "off" (side_channel_auth: off); plain messages work."""
    seen = []
    port = free_port_base(1)
    srv = SideChannelServer("127.0.0.1", port, lambda m: (seen.append(m), Reply())[1], auth=None)
    try:
        assert isinstance(decode(_raw(port, encode(Renew(keys=["p"])))), Reply) and len(seen) == 1
    finally:
        srv.close()


def test_unknown_tag_is_a_decode_error():
    with pytest.raises(msgspec.ValidationError):
        decode(msgspec.msgpack.encode({"t": "launch_missiles"}))
