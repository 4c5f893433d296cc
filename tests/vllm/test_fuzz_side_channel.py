"""Hostile input at the connector's side channel (issue 7, point 4 / acceptance 3).

A live producer (real vLLM Scheduler + connector worker + SideChannelServer) is sent random
bytes, truncated / bit-flipped / oversized / replayed sealed messages, messages with a
valid seal but a malformed body or another protocol version, and well-formed messages with
hostile contents. Every frame is accounted for by the server's counters, nothing it was
not authenticated for reaches the handler, no reply carries the agent metadata, the
server thread never dies, no traceback is logged, and afterwards a good peer still
hand-shakes and loads a request byte-exact.
"""

from __future__ import annotations

import logging
import time

import msgspec
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness import TEST_SECRET, Pair, prompt_of
from kvtransport.auth import Authenticator
from kvtransport_vllm.config import AUTH_CHANNEL
from kvtransport_vllm.messages import (
    Aborted, Cancel, Done, Hello, LayoutInfo, Release, Renew, WriteReq, Written, decode, encode,
)
from kvtransport_vllm.side_channel import TokenBucket, endpoint_name

pytestmark = pytest.mark.timeout(120)

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))


class _Tracebacks(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info:
            self.records.append(self.format(record))


@pytest.fixture(scope="module")
def live():
    pair = Pair("read", timeout_s=3.0, lease_s=6.0)
    tb = _Tracebacks()
    logging.getLogger("kvtransport_vllm").addHandler(tb)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{pair.p_port}")
    auth = Authenticator(TEST_SECRET.encode(), AUTH_CHANNEL)
    state = {"pair": pair, "sock": sock, "auth": auth, "tb": tb, "to": endpoint_name("127.0.0.1", pair.p_port),
             "server": pair.P.worker._worker.server, "md": pair.P.worker._worker.ctx.agent_md,
             "layout": pair.C.worker._worker.layout, "c_md": pair.C.worker._worker.ctx.agent_md}
    yield state
    logging.getLogger("kvtransport_vllm").removeHandler(tb)
    sock.close(0)
    pair.close()


def _total(srv) -> int:
    c = srv.counters
    return c["served"] + c["auth"] + c["malformed"] + c["version"]


def _send(live, frames: list[bytes]) -> dict[str, int]:
    """Send frames, wait until the server accounted for each, return the counter deltas;
    check every reply that came back."""
    srv = live["server"]
    before = dict(srv.counters)
    t0 = _total(srv)
    for f in frames:
        live["sock"].send(f)
    deadline = time.monotonic() + 10
    while _total(srv) < t0 + len(frames) and time.monotonic() < deadline:
        time.sleep(0.0005)
    assert _total(srv) == t0 + len(frames), "the server lost frames (thread dead?)"
    assert srv._thread.is_alive()
    while live["sock"].poll(0):
        reply = live["sock"].recv()
        assert live["md"] not in reply or _sealed_ok(live, reply), "agent metadata left without authentication"
    return {k: srv.counters[k] - before[k] for k in before}


def _sealed_ok(live, reply: bytes) -> bool:
    """Authentic (sealed) replies may carry metadata: only to holders of the secret."""
    try:
        live["auth"].open(reply, "rep", to=live["to"])
        return True
    except Exception:
        return False


def _seal(live, body: bytes) -> bytes:
    return live["auth"].seal(body, "req", to=live["to"])


# ------------------------------------------------------------------------------ fuzz


@FUZZ
@given(blob=st.binary(max_size=2048))
def test_random_bytes_never_reach_the_handler(live, blob):
    d = _send(live, [blob])
    assert d["served"] == 0 and d["auth"] == 1


@FUZZ
@given(body=st.binary(max_size=2048))
def test_sealed_random_body_is_malformed(live, body):
    d = _send(live, [_seal(live, body)])
    assert d["served"] == 0 and d["malformed"] + d["version"] == 1


def _valid_bodies(live) -> list[bytes]:
    lay = live["layout"]
    return [encode(m) for m in (
        Renew(keys=["k1"]), Done(keys=["k2"]), Release(keys=["k3"]), Cancel(keys=["k4"]),
        Aborted(keys=["k5"]), Written(key="k6", ok=True),
        WriteReq(key="k7", block_ids=[1, 2], engine_id="fuzz", reply_host="127.0.0.1", reply_port=1),
        Hello(engine_id="fuzz-consumer", tp_rank=0, agent_md=live["c_md"], layout=lay,
              reply_host="127.0.0.1", reply_port=1),
    )]


@FUZZ
@given(data=st.data())
def test_mutated_sealed_messages_refused(live, data):
    body = data.draw(st.sampled_from(_valid_bodies(live)))
    frame = bytearray(_seal(live, body))
    kind = data.draw(st.sampled_from(["flip", "truncate", "extend", "splice"]))
    if kind == "flip":
        i = data.draw(st.integers(0, len(frame) - 1))
        frame[i] ^= data.draw(st.integers(1, 255))
    elif kind == "truncate":
        frame = frame[: data.draw(st.integers(0, len(frame) - 1))]
    elif kind == "extend":
        frame += data.draw(st.binary(min_size=1, max_size=64))
    else:
        i = data.draw(st.integers(0, len(frame)))
        frame[i:i] = data.draw(st.binary(min_size=1, max_size=32))
    d = _send(live, [bytes(frame)])
    assert d["served"] == 0 and d["auth"] == 1  # any change breaks the MAC (or the header)


@FUZZ
@given(doc=st.dictionaries(
    st.sampled_from(["t", "v", "cid", "keys", "key", "ok", "engine_id", "block_ids", "agent_md", "layout",
                     "reply_host", "reply_port", "instance", "status", "token", "x"]),
    st.one_of(st.sampled_from(["hello", "done", "renew", "release", "write_req", "cancel", "written",
                               "aborted", "reply", "error", "welcome"]),
              st.integers(-2**64, 2**64 - 1), st.text(max_size=20), st.binary(max_size=20),
              st.lists(st.one_of(st.integers(), st.text(max_size=5)), max_size=5), st.none(), st.booleans()),
    max_size=8))
def test_sealed_structured_garbage(live, doc):
    """Valid seal, msgpack map of plausible fields with wrong types / missing / unknown ones:
    refused as malformed or wrong version, or (if it happens to be a valid message) served
    with a reply; never a crash."""
    try:
        body = msgspec.msgpack.encode(doc)
    except OverflowError:
        return
    d = _send(live, [_seal(live, body)])
    assert d["served"] + d["malformed"] + d["version"] == 1 and d["auth"] == 0


@FUZZ
@given(keys=st.lists(st.text(max_size=64), max_size=50), ids=st.lists(st.integers(-2**63, 2**63 - 1), max_size=50),
       kind=st.sampled_from(["done", "renew", "release", "cancel", "aborted", "write_req", "written", "hello"]),
       md=st.binary(max_size=256))
def test_wellformed_hostile_contents_are_served_safely(live, keys, ids, kind, md):
    msg = {
        "done": lambda: Done(keys=keys, instance="f" * 16),
        "renew": lambda: Renew(keys=keys),
        "release": lambda: Release(keys=keys),
        "cancel": lambda: Cancel(keys=keys),
        "aborted": lambda: Aborted(keys=keys),
        "write_req": lambda: WriteReq(key=keys[0] if keys else "", block_ids=ids, engine_id="fuzz",
                                      reply_host="127.0.0.1", reply_port=1),
        "written": lambda: Written(key=keys[0] if keys else "", ok=bool(ids)),
        "hello": lambda: Hello(engine_id="fuzz-hello", tp_rank=0, agent_md=md,
                               layout=LayoutInfo(1, "x", 1, 1, 1, 1), reply_host="h", reply_port=0),
    }[kind]()
    d = _send(live, [_seal(live, encode(msg))])
    assert d["served"] == 1


def test_wrong_version_with_valid_seal(live):
    d = _send(live, [_seal(live, encode(Renew(keys=["a"], v=7)))])
    assert d["version"] == 1 and d["served"] == 0


def test_replayed_sealed_messages_refused(live):
    frame = _seal(live, encode(Renew(keys=["replay"])))
    d = _send(live, [frame] + [frame] * 20)
    assert d["served"] == 1 and d["auth"] == 20


def test_oversized_frame_dropped_unread(live):
    srv = live["server"]
    t0 = _total(srv)
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    mon = s.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    s.connect(f"tcp://127.0.0.1:{live['pair'].p_port}")
    s.send(b"\x00" * (live["pair"].P.worker._worker.cfg.max_message_bytes + 1))
    # Ordering fact: the server's ZMQ read the frame's size and dropped the connection.
    assert mon.poll(10_000), "the oversized frame's connection was never dropped"
    assert recv_monitor_message(mon)["event"] == zmq.EVENT_DISCONNECTED
    mon.close(0)
    s.close(0)
    # the next frame is served and is the only one accounted for: the oversized one never was
    assert _send(live, [_seal(live, encode(Renew(keys=["after-oversize"])))])["served"] == 1
    assert _total(srv) == t0 + 1


def test_flood_then_good_peer_still_served(live):
    """Last: a flood of junk (rate-limited: no replies past the burst), then the real
    consumer hand-shakes and loads a request byte-exact; no traceback was logged."""
    srv = live["server"]
    bucket = srv._fail_bucket
    srv._fail_bucket = TokenBucket(rate=0.0, burst=20)  # never refills: exact counts, however slow the flood
    try:
        d = _send(live, [b"junk-%d" % i for i in range(500)])
    finally:
        srv._fail_bucket = bucket
    assert d["auth"] == 500 and d["dropped"] == 480
    pair = live["pair"]
    prompt = prompt_of(70, seed=9)
    params = pair.prefill("fz1", prompt)
    pair.C.add("fzc1", prompt, 2, params)
    pair.run(lambda: any("fzc1" in (o.finished_recving or ()) for o in pair.C.kv_outputs), timeout=20)
    assert not any(o.invalid_block_ids for o in pair.C.kv_outputs)
    assert pair.C.check_kv("fzc1", prompt, len(prompt)) == []
    pair.drain()
    pair.assert_no_leak()
    assert not live["tb"].records, live["tb"].records[:3]
    assert isinstance(decode(encode(Renew(keys=[]))), Renew)
