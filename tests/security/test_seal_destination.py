"""A sealed side-channel message is bound to its destination worker.

What a user checks: a request captured on its way to one worker and replayed to another
worker of the cluster is refused there, counted (server counters and the connector's
statistics, which feed ``/metrics``), and changes nothing: a replayed ``Release`` does
not end the other worker's hold, which still serves its load byte-exact. The original
request, to the worker it was sealed for, still works. Frames of the previous framing
(``KVTA2``, no destination) are refused naming the fix.

The capture is real: a real client (the class every connector worker uses) addresses
worker A by its advertised name; a relay standing at that address (A itself listens on
another loopback address) records the exact frame on its way and forwards it to A.
"""

from __future__ import annotations

import os
import sys
import time

import pytest
import zmq

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "vllm"))

from harness import Engine, finish_reason, free_port_base, prompt_of, run_until
from kvtransport.auth import (
    HEADER_BYTES,
    AuthError,
    Authenticator,
    AuthVersionError,
    MisdirectedError,
)
from kvtransport_vllm.config import AUTH_CHANNEL
from kvtransport_vllm.messages import Error, Release, Renew, Reply, decode, encode
from kvtransport_vllm.side_channel import OwnNames, SideChannelClient, SideChannelServer, endpoint_name
from vllm.v1.request import RequestStatus

pytestmark = pytest.mark.timeout(120)

SECRET = b"seal-destination-test-secret-0123"
#: workers listen here; the relay holds 127.0.0.1 with worker A's port
HIDDEN = "127.0.0.3"


# ----------------------------------------------------------------------------- the seal itself


def test_a_message_sealed_for_one_receiver_is_refused_by_another_naming_both():
    a = Authenticator(SECRET, "hs")
    frame = a.seal(b"body", "req", to="10.0.0.1:5600")
    with pytest.raises(MisdirectedError, match=r"sealed for 10\.0\.0\.1:5600, not for 10\.0\.0\.2:5600"):
        Authenticator(SECRET, "hs").open(frame, "req", to="10.0.0.2:5600")
    with pytest.raises(MisdirectedError, match=r"sealed for 10\.0\.0\.1:5600, not for \(no destination\)"):
        Authenticator(SECRET, "hs").open(frame, "req")
    # control: the same frame is authentic, and opens for the receiver it names
    assert Authenticator(SECRET, "hs").open(frame, "req", to="10.0.0.1:5600") == b"body"


def test_a_reply_names_the_worker_that_answered():
    server, client = Authenticator(SECRET, "hs"), Authenticator(SECRET, "hs")
    req = client.seal(b"q", "req", to="10.0.0.1:5600")
    rep = server.seal(b"a", "rep", to=Authenticator.dest_of(req), request_nonce=Authenticator.nonce_of(req))
    with pytest.raises(MisdirectedError):
        Authenticator(SECRET, "hs").open(rep, "rep", to="10.0.0.1:5601", request_nonce=Authenticator.nonce_of(req))
    assert client.open(rep, "rep", to="10.0.0.1:5600", request_nonce=Authenticator.nonce_of(req)) == b"a"


def test_the_destination_cannot_be_rewritten():
    """The destination is associated data: rewriting it (same length, so the frame still
    parses) breaks the tag; it is not taken as a frame for the new name."""
    frame = bytearray(Authenticator(SECRET, "hs").seal(b"body", "req", to="10.0.0.1:5600"))
    at = frame.index(b"10.0.0.1:5600")
    assert at == HEADER_BYTES
    frame[at:at + 13] = b"10.0.0.2:5600"
    with pytest.raises(AuthError, match="bad authentication tag"):
        Authenticator(SECRET, "hs").open(bytes(frame), "req", to="10.0.0.2:5600")


def test_previous_framing_without_destination_refused_with_a_clear_message():
    old = b"KVTA2" + bytes(8 + 16 + 16) + b"ciphertext and tag of a KVTA2 frame"
    with pytest.raises(AuthVersionError, match=r"KVTA2 did not name the destination.*same kvtransport version"):
        Authenticator(SECRET, "hs").open(old, "req", to="10.0.0.1:5600")


def test_names_a_worker_answers_to():
    """Peers elsewhere must use the advertised name; a peer on this host may use a
    loopback name when the worker listens on loopback."""
    remote = OwnNames("10.0.0.1", 5600, "0.0.0.0", local_peer=False)
    local = OwnNames("10.0.0.1", 5600, "0.0.0.0", local_peer=True)
    assert "10.0.0.1:5600" in remote and "10.0.0.1:5600" in local
    for other in ("10.0.0.1:5601", "10.0.0.2:5600", "127.0.0.1:5600", "localhost:5600", ""):
        assert other not in remote
    assert "127.0.0.1:5600" in local and "localhost:5600" in local and "[::1]:5600" in local
    assert "127.0.0.1:5601" not in local and "10.0.0.2:5600" not in local
    only_there = OwnNames("10.0.0.1", 5600, "10.0.0.1", local_peer=True)  # not listening on loopback
    assert "127.0.0.1:5600" not in only_there
    assert endpoint_name("[::1]", 5600) == endpoint_name("0:0::1", 5600) == "[::1]:5600"
    assert endpoint_name("Prefill-0.Example.", 5600) == "prefill-0.example:5600"


# ----------------------------------------------------------------------------- real servers


class _Relay:
    """Stands at worker A's advertised address and forwards each request to A (listening
    on :data:`HIDDEN`), keeping a copy of every frame that passes: a tap on the path."""

    def __init__(self, port: int) -> None:
        ctx = zmq.Context.instance()
        self.front = ctx.socket(zmq.ROUTER)
        self.front.setsockopt(zmq.LINGER, 0)
        self.front.bind(f"tcp://127.0.0.1:{port}")
        self.back = ctx.socket(zmq.DEALER)
        self.back.setsockopt(zmq.LINGER, 0)
        self.back.connect(f"tcp://{HIDDEN}:{port}")
        self.captured: list[bytes] = []

    def relay_one(self, timeout: float = 20.0) -> bytes:
        """Forward one request and its reply; the request frame as it crossed."""
        assert self.front.poll(int(timeout * 1000)), "no request reached the relay"
        ident, frame = self.front.recv_multipart()
        self.captured.append(frame)
        self.back.send(frame)
        assert self.back.poll(int(timeout * 1000)), "the worker did not answer"
        self.front.send_multipart([ident, self.back.recv()])
        return frame

    def close(self) -> None:
        self.front.close(0)
        self.back.close(0)


def _raw(host: str, port: int, frame: bytes, timeout: float = 20.0) -> bytes:
    """``frame`` sent as is to ``host:port`` (an attacker's replay); the raw answer."""
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(f"tcp://{host}:{port}")
    try:
        s.send(frame)
        assert s.poll(int(timeout * 1000)), "no answer to the replay"
        return s.recv()
    finally:
        s.close(0)


def _reply(client: SideChannelClient, cid: int, timeout: float = 20.0):
    end = time.monotonic() + timeout  # a hang guard, not a timing bound
    while True:
        for r in client.poll():
            if r.cid == cid:
                return r
        assert time.monotonic() < end, "no reply reached the client"
        time.sleep(0.002)


def test_request_replayed_to_another_worker_refused_and_counted_original_served():
    """Workers A and B (two ranks: ports P and P + 1) with their own handlers. A real client
    sends a request to A; the frame is captured on its way. Replayed to B it is refused
    (B's handler never sees it; counted as misdirected and in ``auth``) with a reply that
    names the cause and the fix; the original reached A and was answered."""
    base = free_port_base(2)
    seen: dict[str, list] = {"A": [], "B": []}

    def handler(name):
        def h(msg):
            seen[name].append(msg)
            return Reply(status={k: "ok" for k in msg.keys})
        return h

    a = SideChannelServer("127.0.0.1", base, handler("A"), auth=Authenticator(SECRET, AUTH_CHANNEL), bind_host=HIDDEN)
    b = SideChannelServer(HIDDEN, base + 1, handler("B"), auth=Authenticator(SECRET, AUTH_CHANNEL))
    relay = _Relay(base)
    client = SideChannelClient("127.0.0.1", base, auth=Authenticator(SECRET, AUTH_CHANNEL))
    try:
        cid = client.send(Renew(keys=["k"]))
        captured = relay.relay_one()
        r = _reply(client, cid)
        assert isinstance(r, Reply) and r.status == {"k": "ok"}, "the original request to A was not served"
        assert [m.keys for m in seen["A"]] == [["k"]]

        raw = _raw(HIDDEN, base + 1, captured)  # answered once B has handled it
        assert seen["B"] == [], "worker B handled a request sealed for worker A"
        answer = decode(raw)
        assert isinstance(answer, Error) and answer.code == "auth"
        assert "misdirected" in answer.message and f"127.0.0.1:{base}" in answer.message
        assert f"address it as {HIDDEN}:{base + 1}" in answer.message
        assert b.counters["misdirected"] == 1 and b.counters["auth"] == 1 and b.counters["served"] == 0
        assert a.counters["served"] == 1 and a.counters["auth"] == 0
    finally:
        client.close()
        relay.close()
        a.close()
        b.close()


def test_a_client_that_names_the_worker_otherwise_fails_closed_naming_the_cause():
    """A sender that reaches worker A through another port (a port forward) seals for
    that name: A refuses, naming what the request was sealed for and the address to use;
    the client counts the refusal and takes nothing from it."""
    base = free_port_base(2)
    seen: list = []
    a = SideChannelServer(HIDDEN, base, lambda m: (seen.append(m), Reply())[1], auth=Authenticator(SECRET, AUTH_CHANNEL))
    ctx = zmq.Context.instance()
    front, back = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)  # the port forward: base + 1 -> A
    for s in (front, back):
        s.setsockopt(zmq.LINGER, 0)
    front.bind(f"tcp://127.0.0.1:{base + 1}")
    back.connect(f"tcp://{HIDDEN}:{base}")
    client = SideChannelClient("127.0.0.1", base + 1, auth=Authenticator(SECRET, AUTH_CHANNEL))
    try:
        client.send(Renew(keys=["k"]))
        assert front.poll(20_000)
        ident, frame = front.recv_multipart()
        back.send(frame)
        assert back.poll(20_000)
        raw = back.recv()
        refusal = decode(raw)
        assert isinstance(refusal, Error) and refusal.code == "auth"
        assert f"sealed for 127.0.0.1:{base + 1}" in refusal.message and f"{HIDDEN}:{base}" in refusal.message
        front.send_multipart([ident, raw])
        end = time.monotonic() + 20  # a hang guard
        got: list = []
        while client.counters["auth"] == 0 and time.monotonic() < end:
            got += client.poll()
            time.sleep(0.002)
        assert got == [] and client.counters["auth"] == 1 and client.pending == 1
        assert seen == [] and a.counters["misdirected"] == 1
    finally:
        client.close()
        front.close(0)
        back.close(0)
        a.close()


# ----------------------------------------------------------------------------- real workers

_COMMON = {"backend": "loopback", "mode": "read", "transfer_timeout_s": 5.0, "lease_s": 60.0,
           "load_failure_policy": "fail", "side_channel_host": HIDDEN}


def _stat(engine: Engine, key: str) -> int:
    return sum(o.kv_connector_stats.data.get(key, 0) for o in engine.kv_outputs if o.kv_connector_stats)


def test_replayed_release_does_not_end_another_workers_hold():
    """Producer workers A and B of one engine id ("P", as two ranks of one producer) hold
    the same key. A consumer's Release to A, captured on its way, is replayed to B: B
    refuses and counts it (in its connector statistics too), keeps its hold, and a
    consumer then loads B's blocks byte-exact. The original Release ended A's hold."""
    base = free_port_base(8)
    engines: list[Engine] = []
    relay = None
    client = None
    try:
        A = Engine("kv_producer", {**_COMMON, "side_channel_port": base}, engine_id="P")
        engines.append(A)
        B = Engine("kv_producer", {**_COMMON, "side_channel_port": base + 1}, engine_id="P")
        engines.append(B)
        C = Engine("kv_consumer", {**_COMMON, "side_channel_port": base + 4}, engine_id="C")
        engines.append(C)
        prompt = prompt_of(70, seed=5)
        params: dict[str, dict] = {}
        for p in (A, B):
            p.add("r1", prompt, 1, {"do_remote_decode": True})
            run_until([p], lambda: "r1" in params, on_params=params.update)
            if p is A:
                params_a = params.pop("r1")
        params_b = params["r1"]
        key = params_b["transfer_id"]
        assert key == params_a["transfer_id"] and params_b["remote_port"] == base + 1
        wa, wb = A.worker._worker, B.worker._worker
        run_until([A, B], lambda: key in wa.producer.holds and key in wb.producer.holds)  # next step: held

        # A consumer rank's Release to A, as its worker sends it, through a tap on the path.
        relay = _Relay(base)
        client = SideChannelClient("127.0.0.1", base, auth=C.worker._worker.cfg.make_authenticator())
        cid = client.send(Release(keys=[key], rank=0, readers=1))
        captured = relay.relay_one()
        r = _reply(client, cid)
        assert isinstance(r, Reply) and r.status == {key: "acked"}
        with wa.ctx.lock:
            assert key not in wa.producer.holds and wa.producer.ended.get(key) == "released"

        # The captured Release replayed to B: its answer comes after B handled it.
        C.worker.get_kv_connector_stats()
        B.worker.get_kv_connector_stats()  # fresh statistics interval
        answer = _raw(HIDDEN, base + 1, captured)
        with wb.ctx.lock:
            assert key in wb.producer.holds, "a Release replayed from another worker ended B's hold"
        refusal = decode(answer)
        assert isinstance(refusal, Error) and refusal.code == "auth" and "misdirected" in refusal.message
        assert wb.server.counters["misdirected"] == 1 and wb.server.counters["auth"] == 1
        stats = B.worker.get_kv_connector_stats()
        assert stats is not None and stats.reduce()["kv_side_channel_auth_failures"] == 1

        # B's hold still serves: a consumer loads it, every block equal to B's prefill.
        C.add("c1", prompt, 2, params_b)
        checks: list[list[int]] = []

        def loaded() -> bool:
            req = C.scheduler.requests.get("c1")
            if (not checks and req is not None and C.status("c1") == RequestStatus.RUNNING
                    and req.num_computed_tokens >= len(prompt)):
                checks.append(C.check_kv("c1", prompt, len(prompt)))
            return req is None

        run_until([B, C], loaded, timeout=30.0)
        assert checks == [[]], f"the KV loaded from B differs from its prefill in blocks {checks}"
        assert finish_reason(C, "c1") == "length" and C.first_start["c1"] > 0, "recomputed, not loaded"
        assert _stat(C, "loads_ok") == 1 and _stat(C, "failures") == 0
        run_until(engines, lambda: not any(e.scheduler.requests for e in engines), timeout=30.0)
        for e in engines:
            assert e.free_blocks() == e.free0, f"{e.engine_id} leaked blocks"
    finally:
        if client is not None:
            client.close()
        if relay is not None:
            relay.close()
        for e in engines:
            e.close()
