"""Side channel: versioned msgspec messages; malformed, wrong-version, unauthenticated and
oversized input is refused and never reaches the handler (lifecycle.md section 5)."""

import time

import msgspec
import pytest
import zmq

from harness import free_port_base
from kvtransport_vllm.messages import Done, Error, Renew, Reply, decode, encode
from kvtransport_vllm.side_channel import SideChannelClient, SideChannelServer

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def server():
    seen = []

    def handler(msg):
        seen.append(msg)
        return Reply(status={k: "ok" for k in msg.keys})

    port = free_port_base(1)
    srv = SideChannelServer("127.0.0.1", port, handler, token="s3cret", max_message_bytes=4096)
    yield port, srv, seen
    srv.close()


def _raw(port, payload: bytes, timeout=5.0):
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(f"tcp://127.0.0.1:{port}")
    s.send(payload)
    if s.poll(int(timeout * 1000)):
        out = decode(s.recv())
    else:
        out = None
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


def test_valid_message_with_token(server):
    port, _, seen = server
    c = SideChannelClient("127.0.0.1", port, token="s3cret")
    try:
        r = _roundtrip(c, Renew(keys=["a"]))
        assert isinstance(r, Reply) and r.status == {"a": "ok"} and len(seen) == 1
    finally:
        c.close()


def test_wrong_token_refused(server):
    port, srv, seen = server
    c = SideChannelClient("127.0.0.1", port, token="nope")
    try:
        r = _roundtrip(c, Done(keys=["a"]))
        assert isinstance(r, Error) and r.code == "auth" and not seen
    finally:
        c.close()


def test_malformed_refused(server):
    port, _, seen = server
    r = _raw(port, b"\x00garbage\xff")
    assert isinstance(r, Error) and r.code == "malformed" and not seen


def test_wrong_version_refused(server):
    port, _, seen = server
    r = _raw(port, encode(Done(keys=["a"], v=99, token="s3cret")))
    assert isinstance(r, Error) and r.code == "version" and "version" in r.message and not seen


def test_oversized_dropped_server_keeps_serving(server):
    port, _, seen = server
    assert _raw(port, encode(Done(keys=["x" * 10000], token="s3cret")), timeout=0.5) is None
    c = SideChannelClient("127.0.0.1", port, token="s3cret")
    try:
        assert isinstance(_roundtrip(c, Renew(keys=["b"])), Reply)
        assert [m.keys for m in seen] == [["b"]]
    finally:
        c.close()


def test_unknown_tag_is_a_decode_error():
    with pytest.raises(msgspec.ValidationError):
        decode(msgspec.msgpack.encode({"t": "launch_missiles"}))
