"""Side channel: versioned msgspec messages sealed with the cluster secret; malformed,
wrong-version, unauthenticated, replayed and oversized input is refused and never reaches
the handler (docs/LIFECYCLE.md section 5)."""

import hashlib
import hmac
import itertools
import os
import struct
import time

import msgspec
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from harness import free_port_base
from kvtransport.auth import Authenticator
from kvtransport_vllm.config import AUTH_CHANNEL
from kvtransport_vllm.messages import PROTOCOL_VERSION, Done, Error, Renew, Reply, decode, encode
from kvtransport_vllm.side_channel import SideChannelClient, SideChannelServer, TokenBucket, endpoint_name

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


def _to(port):
    """The destination a request to the test server at ``port`` is sealed for."""
    return endpoint_name("127.0.0.1", port)


def _raw(port, payload: bytes, timeout=5.0, host="127.0.0.1"):
    """Send one frame from a bare DEALER; the raw reply bytes (None: no reply)."""
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(f"tcp://{host}:{port}")
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


def _poll_until(client, n_accepted: int, n_refused: int, timeout=5.0) -> list:
    """Poll until ``n_accepted`` replies were accepted and ``n_refused`` refused (frames of
    one connection arrive in order: when the last delivered frame is accounted for, every
    earlier one is)."""
    got: list = []
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got += client.poll()
        if len(got) >= n_accepted and client.counters["auth"] >= n_refused:
            break
        time.sleep(0.002)
    return got


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
        c.send(Done(keys=["a"]))
        # the server's unsealed refusal arrives and is dropped as not authentic to us
        assert _poll_until(c, 0, 1) == []
        assert not seen and srv.counters["auth"] == 1 and c.counters["auth"] == 1 and c.pending == 1
    finally:
        c.close()


def test_unsealed_message_gets_auth_error_only(server):
    port, srv, seen = server
    r = decode(_raw(port, encode(Done(keys=["a"]))))
    assert isinstance(r, Error) and r.code == "auth" and "side_channel_secret" in r.message and not seen


def test_replayed_message_refused(server):
    port, srv, seen = server
    frame = _auth().seal(encode(Renew(keys=["r"])), "req", to=_to(port))
    first = _raw(port, frame)
    assert isinstance(decode(_auth().open(first, "rep", to=_to(port))), Reply)
    again = decode(_raw(port, frame))
    assert isinstance(again, Error) and again.code == "auth" and "replayed" in again.message
    assert [m.keys for m in seen] == [["r"]]


def test_reply_sealed_as_request_is_refused(server):
    """Direction is bound into the MAC: a captured reply cannot be replayed as a request."""
    port, srv, seen = server
    r = decode(_raw(port, _auth().seal(encode(Renew(keys=["x"])), "rep", to=_to(port))))
    assert isinstance(r, Error) and r.code == "auth" and not seen


def test_malformed_body_with_valid_seal_refused(server):
    port, srv, seen = server
    r = decode(_raw(port, _auth().seal(b"\x00garbage\xff", "req", to=_to(port))))
    assert isinstance(r, Error) and r.code == "malformed" and not seen


def test_unknown_field_refused(server):
    port, srv, seen = server
    body = msgspec.msgpack.encode({"t": "renew", "v": PROTOCOL_VERSION, "cid": 3, "keys": ["a"], "token": "x"})
    r = decode(_raw(port, _auth().seal(body, "req", to=_to(port))))
    assert isinstance(r, Error) and r.code == "malformed" and "token" in r.message and not seen


def test_wrong_version_refused(server):
    port, srv, seen = server
    r = decode(_raw(port, _auth().seal(encode(Done(keys=["a"], v=99)), "req", to=_to(port))))
    assert isinstance(r, Error) and r.code == "version" and "version 99" in r.message and not seen


def _dealer_watching_disconnect(port: int) -> tuple[zmq.Socket, zmq.Socket]:
    """A DEALER connected to ``port`` and a monitor reporting when the server drops it."""
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    mon = s.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    s.connect(f"tcp://127.0.0.1:{port}")
    return s, mon


def _wait_disconnected(mon: zmq.Socket, timeout=10.0) -> None:
    """Ordering fact: the server's ZMQ read the frame's header and dropped the connection."""
    assert mon.poll(int(timeout * 1000)), "the server never dropped the oversized frame's connection"
    assert recv_monitor_message(mon)["event"] == zmq.EVENT_DISCONNECTED


def test_oversized_dropped_server_keeps_serving(server):
    """ZMQ drops a frame over ``max_message_bytes`` unread (MAXMSGSIZE): once the server has
    dropped its connection, a good request is served and is the only one the handler saw."""
    port, srv, seen = server
    s, mon = _dealer_watching_disconnect(port)
    try:
        s.send(_auth().seal(encode(Done(keys=["x" * 10000])), "req", to=_to(port)))
        _wait_disconnected(mon)
    finally:
        mon.close(0)
        s.close(0)
    c = SideChannelClient("127.0.0.1", port, auth=_auth())
    try:
        assert isinstance(_roundtrip(c, Renew(keys=["b"])), Reply)
        assert [m.keys for m in seen] == [["b"]]
        assert sum(srv.counters[k] for k in ("served", "auth", "malformed", "version")) == 1
    finally:
        c.close()


def test_failed_authentications_are_rate_limited():
    """Past the burst, failures get no reply at all (a flood costs no replies); a good
    peer is still served. The bucket never refills here (rate 0), so the counts are exact
    however long the flood takes; a sealed request sent last on the same socket is the
    barrier: its reply means every junk frame before it was handled."""
    seen = []
    port = free_port_base(1)
    srv = SideChannelServer("127.0.0.1", port, lambda m: (seen.append(m), Reply(status={k: "ok" for k in m.keys}))[1],
                            auth=_auth(), auth_fail_rate=0.0, auth_fail_burst=20)
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(f"tcp://127.0.0.1:{port}")
    a = _auth()
    try:
        for i in range(200):
            s.send(b"junk-%d" % i)
        barrier = a.seal(encode(Renew(keys=["barrier"])), "req", to=_to(port))
        s.send(barrier)
        refusals = 0
        while True:
            assert s.poll(10_000), f"no reply to the barrier ({refusals} refusals seen)"
            r = s.recv()
            if r.startswith(b"KVTA"):
                body = a.open(r, "rep", to=_to(port), request_nonce=Authenticator.nonce_of(barrier))
                assert isinstance(decode(body), Reply)
                break
            assert decode(r).code == "auth"
            refusals += 1
        assert srv.counters["auth"] == 200
        assert refusals == 20 and srv.counters["dropped"] == 180
        c = SideChannelClient("127.0.0.1", port, auth=_auth())
        try:
            assert isinstance(_roundtrip(c, Renew(keys=["g"])), Reply)
            assert [m.keys for m in seen] == [["barrier"], ["g"]]
        finally:
            c.close()
    finally:
        s.close(0)
        srv.close()


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


# ----------------------------------------------------------------------------- reply binding


class _Mitm:
    """An active attacker on the path: a ROUTER at the server's advertised address that the
    client connects to, forwarding each request to the real server (listening elsewhere)
    and choosing which frames the client gets back."""

    def __init__(self, host: str, port: int, server_host: str):
        ctx = zmq.Context.instance()
        self.front = ctx.socket(zmq.ROUTER)
        self.front.setsockopt(zmq.LINGER, 0)
        self.front.bind(f"tcp://{host}:{port}")
        self.back = ctx.socket(zmq.DEALER)
        self.back.setsockopt(zmq.LINGER, 0)
        self.back.connect(f"tcp://{server_host}:{port}")
        self.ident = b""

    def relay_request(self, timeout=5.0) -> bytes:
        """Take one request from the client, forward it, return the server's raw reply."""
        assert self.front.poll(int(timeout * 1000)), "no request from the client"
        self.ident, frame = self.front.recv_multipart()
        self.back.send(frame)
        assert self.back.poll(int(timeout * 1000)), "no reply from the server"
        return self.back.recv()

    def deliver(self, *frames: bytes) -> None:
        for f in frames:
            self.front.send_multipart([self.ident, f])

    def close(self):
        self.front.close(0)
        self.back.close(0)


#: where the server behind the attacker really listens (it advertises 127.0.0.1)
_HIDDEN = "127.0.0.3"


@pytest.fixture
def server_behind_mitm():
    """A server advertising 127.0.0.1:P but listening on 127.0.0.3:P, and the attacker
    holding 127.0.0.1:P: clients address the advertised worker and reach the attacker."""
    seen = []

    def handler(msg):
        seen.append(msg)
        return Reply(status={k: "ok" for k in msg.keys})

    port = free_port_base(1)
    srv = SideChannelServer("127.0.0.1", port, handler, auth=_auth(), max_message_bytes=4096, bind_host=_HIDDEN)
    m = _Mitm("127.0.0.1", port, _HIDDEN)
    yield port, srv, seen, m
    m.close()
    srv.close()


def test_reply_to_another_request_is_refused_and_counted(server_behind_mitm, monkeypatch):
    """A reply captured from another client's request N (same cid, as a second process
    would use) is refused as the answer to this client's request M, and counted; M's own
    reply is then accepted. Control: the captured reply is authentic and carries M's cid,
    so a client that matched replies by cid alone would have taken it."""
    port, srv, seen, mitm = server_behind_mitm
    # Request N: another process's client (own authenticator, own replay memory).
    other = _auth()
    req_n = other.seal(encode(Renew(keys=["n"], cid=500)), "req", to=_to(port))
    reply_n = _raw(port, req_n, host=_HIDDEN)
    body_n = other.open(reply_n, "rep", to=_to(port), request_nonce=Authenticator.nonce_of(req_n))
    assert isinstance(decode(body_n), Reply)

    monkeypatch.setattr(SideChannelClient, "_cids", itertools.count(500))
    c = SideChannelClient("127.0.0.1", port, auth=_auth())
    try:
        assert c.send(Renew(keys=["m"])) == 500
        reply_m = mitm.relay_request()
        mitm.deliver(reply_n, reply_m)  # the attacker's answer first
        got = _poll_until(c, 1, 1)
        assert [(type(r), r.cid, r.status) for r in got] == [(Reply, 500, {"m": "ok"})]
        assert c.counters["misbound"] == 1 and c.counters["auth"] == 1 and c.pending == 0
        # The same reply again, now that M is answered: refused too.
        mitm.deliver(reply_m)
        assert _poll_until(c, 0, 2) == [] and c.counters["auth"] == 2
    finally:
        c.close()
    control = decode(_auth().open(reply_n, "rep", to=_to(port)))
    assert isinstance(control, Reply) and control.cid == 500  # what a cid-only match accepts
    assert [m.keys for m in seen] == [["n"], ["m"]]


def test_tampered_reply_refused_and_the_genuine_one_still_accepted(server_behind_mitm):
    """A reply whose ciphertext was altered is refused (and does not cancel the request:
    the genuine reply delivered after it is accepted)."""
    port, srv, seen, mitm = server_behind_mitm
    c = SideChannelClient("127.0.0.1", port, auth=_auth())
    try:
        cid = c.send(Done(keys=["t"]))
        genuine = mitm.relay_request()
        tampered = genuine[:-20] + bytes([genuine[-20] ^ 0x40]) + genuine[-19:]
        mitm.deliver(tampered, genuine)
        got = _poll_until(c, 1, 1)
        assert [(r.cid, r.status) for r in got] == [(cid, {"t": "ok"})]
        assert c.counters["auth"] == 1 and c.counters["misbound"] == 0 and c.pending == 0
    finally:
        c.close()


def test_pending_requests_are_bounded(server):
    """At most ``max_pending`` unanswered requests are remembered: a reply to one that was
    forgotten is refused and counted, the others are accepted."""
    port, srv, seen = server
    c = SideChannelClient("127.0.0.1", port, auth=_auth(), max_pending=4)
    try:
        cids = [c.send(Renew(keys=[f"b{i}"])) for i in range(10)]
        assert c.pending == 4
        got = _poll_until(c, 4, 6)
        assert sorted(r.cid for r in got) == cids[-4:]
        assert c.counters["misbound"] == 6 and c.pending == 0
    finally:
        c.close()


def test_old_format_request_refused_with_a_clear_message(server):
    """A peer still sealing with the previous framing (KVTA1: HMAC only, metadata in the
    clear) gets an unsealed refusal naming the fix; the handler never sees it."""
    port, srv, seen = server
    key = hashlib.sha256(b"kvtransport-auth-v1|" + SECRET).digest()
    body, ts, nonce = encode(Renew(keys=["old"])), int(time.time() * 1000), os.urandom(16)
    mac = hmac.new(key, AUTH_CHANNEL.encode() + b"|req|" + struct.pack(">Q", ts) + nonce + body,
                   hashlib.sha256).digest()
    r = decode(_raw(port, struct.pack(">5sQ16s32s", b"KVTA1", ts, nonce, mac) + body))
    assert isinstance(r, Error) and r.code == "auth"
    assert "KVTA1" in r.message and "same kvtransport version" in r.message and "secret" not in r.message
    assert not seen and srv.counters["auth"] == 1


def test_previous_framing_without_destination_refused_with_a_clear_message(server):
    """A peer of the previous release (KVTA2: sealed, but naming no destination) gets an
    unsealed refusal naming the version and the fix; the handler never sees it."""
    port, srv, seen = server
    r = decode(_raw(port, b"KVTA2" + os.urandom(8 + 16 + 16) + os.urandom(48)))
    assert isinstance(r, Error) and r.code == "auth"
    assert "KVTA2" in r.message and "destination" in r.message and "same kvtransport version" in r.message
    assert "secret" not in r.message and not seen and srv.counters["auth"] == 1


def test_requests_queued_for_a_silent_peer_are_dropped_not_delivered_to_its_restart():
    """ZMQ queues requests to a peer that is down and would deliver them all once it is
    back: a restarted producer would get its predecessor's requests (refused as stale, with
    a warning each). A client whose peer stayed silent replaces its
    socket before the next send, so only that send reaches the new server."""
    port = free_port_base(1)
    seen = []

    def handler(msg):
        seen.append(msg)
        return Reply(status={k: "ok" for k in msg.keys})

    c = SideChannelClient("127.0.0.1", port, auth=_auth(), reconnect_after_s=0.2)
    srv = None
    try:
        for i in range(5):  # nobody listens: these wait in the socket's queue
            c.send(Renew(keys=[f"old{i}"]))
        assert c.reconnects == 0
        time.sleep(0.3)  # the peer stays silent past the limit
        cid = c.send(Renew(keys=["new"]))  # replaces the socket first, then queues this one
        assert c.reconnects == 1
        srv = SideChannelServer("127.0.0.1", port, handler, auth=_auth(), max_message_bytes=4096)
        r = None
        end = time.monotonic() + 5
        while r is None and time.monotonic() < end:
            r = next((m for m in c.poll() if m.cid == cid), None)
            time.sleep(0.002)
        assert isinstance(r, Reply) and r.status == {"new": "ok"}
        assert [m.keys for m in seen] == [["new"]], "a request queued for the silent peer reached its restart"
        assert srv.counters["auth"] == 0
    finally:
        c.close()
        if srv is not None:
            srv.close()


def test_a_peer_that_answers_is_never_reconnected(server):
    """Silence is measured from the first unanswered request: a peer that answers (even if
    its answer is not polled yet) keeps its connection however long the client is idle."""
    port, srv, seen = server
    c = SideChannelClient("127.0.0.1", port, auth=_auth(), reconnect_after_s=0.1)
    try:
        assert isinstance(_roundtrip(c, Renew(keys=["a"])), Reply)
        time.sleep(0.2)  # idle past the limit, nothing waiting: no reconnect
        c.send(Renew(keys=["b"]))
        end = time.monotonic() + 5
        # the answer has reached our socket (the server counts a request served before it
        # sends the answer: waiting for the count alone let a slow send look like silence)
        while not c._sock.get(zmq.EVENTS) & zmq.POLLIN:
            assert time.monotonic() < end, "no answer to b"
            time.sleep(0.002)
        time.sleep(0.15)  # its answer waits unread past the limit
        assert isinstance(_roundtrip(c, Renew(keys=["c"])), Reply)
        assert c.reconnects == 0 and [m.keys for m in seen] == [["a"], ["b"], ["c"]]
        assert c.counters["auth"] == 0
    finally:
        c.close()


def test_a_stale_request_is_refused_without_blaming_the_secret(server, monkeypatch):
    """A request sealed with the right secret long ago (queued while this engine was down)
    is refused as stale; the hint names that, not a secret mismatch."""
    port, srv, seen = server
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() - 40)
    frame = _auth().seal(encode(Renew(keys=["late"])), "req", to=_to(port))
    monkeypatch.setattr(time, "time", real)
    reply = decode(_raw(port, frame))
    assert isinstance(reply, Error) and reply.code == "auth" and not seen
    assert "stale message" in reply.message and "waited in a queue" in reply.message
    assert "KVTRANSPORT_SECRET" not in reply.message
