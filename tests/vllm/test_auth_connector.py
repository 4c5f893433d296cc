"""Side-channel authentication of the connector (issue 7, point 3 / acceptance 2).

A peer that does not hold the cluster secret gets no memory descriptor and no key: the
Welcome (which carries the agent metadata: addresses, backend blob, region blobs such as
UCX rkeys) is only ever sent sealed, in reply to a sealed, fresh request. Configuration:
``side_channel_secret`` or ``KVTRANSPORT_SECRET`` / ``KVTRANSPORT_SECRET_FILE``; off only
with ``side_channel_auth: off`` or ``KVTRANSPORT_AUTH=off``; otherwise start-up fails.
"""

import struct

import msgspec
import pytest
import zmq

from harness import Pair, finish_reason, prompt_of
from kvtransport.auth import Authenticator
from kvtransport.metadata import decode_metadata
from kvtransport_vllm.config import AUTH_CHANNEL, ConnectorConfig, ConnectorConfigError
from kvtransport_vllm.messages import Error, Hello, Renew, Reply, Welcome, decode, encode

pytestmark = pytest.mark.timeout(120)
TEST_SECRET = "kvtransport-test-cluster-secret"  # tests/vllm/conftest.py


# ----------------------------------------------------------------------------- config


@pytest.fixture
def no_env(monkeypatch):
    for k in ("KVTRANSPORT_SECRET", "KVTRANSPORT_SECRET_FILE", "KVTRANSPORT_AUTH"):
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


def test_no_secret_and_not_off_fails_at_startup(no_env):
    with pytest.raises(ConnectorConfigError, match="no cluster secret") as ei:
        ConnectorConfig.from_extra("kv_consumer", "e", {})
    for name in ("side_channel_secret", "KVTRANSPORT_SECRET", "side_channel_auth: off", "KVTRANSPORT_AUTH=off"):
        assert name in str(ei.value)


def test_secret_from_config_env_and_file(no_env, tmp_path):
    c = ConnectorConfig.from_extra("kv_consumer", "e", {"side_channel_secret": "x" * 20})
    assert c.side_channel_auth and c.side_channel_secret == b"x" * 20 and c.make_authenticator() is not None
    assert "x" * 20 not in repr(c)  # the secret never lands in logs
    no_env.setenv("KVTRANSPORT_SECRET", "y" * 20)
    assert ConnectorConfig.from_extra("kv_consumer", "e", {}).side_channel_secret == b"y" * 20
    no_env.delenv("KVTRANSPORT_SECRET")
    f = tmp_path / "secret"
    f.write_text("z" * 24 + "\n")
    no_env.setenv("KVTRANSPORT_SECRET_FILE", str(f))
    assert ConnectorConfig.from_extra("kv_consumer", "e", {}).side_channel_secret == b"z" * 24


@pytest.mark.parametrize("how", ["config", "env", "secret-off"])
def test_explicit_off(no_env, how):
    extra = {}
    if how == "config":
        extra = {"side_channel_auth": "off"}
    elif how == "env":
        no_env.setenv("KVTRANSPORT_AUTH", "off")
    else:
        extra = {"side_channel_secret": "off"}
    c = ConnectorConfig.from_extra("kv_consumer", "e", extra)
    assert not c.side_channel_auth and c.make_authenticator() is None


@pytest.mark.parametrize("extra, msg", [
    ({"side_channel_secret": "short"}, "side_channel_secret: .*at least 16 bytes"),
    ({"side_channel_secret": 12345678901234567}, "must be a string"),
    ({"side_channel_auth": "maybe", "side_channel_secret": "x" * 20}, "side_channel_auth must be"),
    ({"side_channel_token": "s3cret"}, "side_channel_token was replaced .*side_channel_secret.*KVTRANSPORT_SECRET"),
])
def test_bad_auth_config(no_env, extra, msg):
    with pytest.raises(ConnectorConfigError, match=msg):
        ConnectorConfig.from_extra("kv_consumer", "e", extra)


# ----------------------------------------------------------------------------- live


@pytest.fixture
def pair():
    p = Pair("read")
    yield p
    p.close()


def _secret_bytes(worker):
    """Every byte string that would let a peer read or write our memory."""
    agent = worker.agent
    md = worker._agent_md
    dm = decode_metadata(md)
    out = {"agent metadata": md, "backend blob": dm.blob, "instance id": dm.instance.encode()}
    for r in dm.regions:
        out[f"region {r.id} address"] = struct.pack(">Q", r.addr)
        if r.blob:
            out[f"region {r.id} key blob"] = r.blob
    assert agent is not None
    return out


def _hello(consumer_worker) -> bytes:
    w = consumer_worker
    return encode(Hello(engine_id="intruder", tp_rank=0, agent_md=w._agent_md, layout=w.layout,
                        reply_host="127.0.0.1", reply_port=1))


def _ask(port, frame: bytes, timeout=2.0):
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(f"tcp://127.0.0.1:{port}")
    try:
        s.send(frame)
        return s.recv() if s.poll(int(timeout * 1000)) else None
    finally:
        s.close(0)


@pytest.mark.parametrize("how", ["unsealed", "wrong-secret", "replayed"])
def test_unauthenticated_peer_gets_no_descriptor_and_no_key(pair, how):
    pw, cw = pair.P.worker._worker, pair.C.worker._worker
    secrets = _secret_bytes(pw)
    good = Authenticator(TEST_SECRET.encode(), AUTH_CHANNEL)
    if how == "unsealed":
        frame = _hello(cw)
    elif how == "wrong-secret":
        frame = Authenticator(b"guessed-wrong-secret-0000", AUTH_CHANNEL).seal(_hello(cw), "req")
    else:  # a Hello captured on the wire, replayed by someone without the secret
        frame = good.seal(_hello(cw), "req")
        assert _ask(pair.p_port, frame) is not None
    reply = _ask(pair.p_port, frame)
    assert reply is not None  # a refusal (rate limit not hit here), not silence
    for what, blob in secrets.items():
        assert blob not in reply, f"{how} peer received the producer's {what}"
    msg = decode(reply)
    assert isinstance(msg, Error) and msg.code == "auth"
    assert pw.server.counters["auth"] >= 1


def test_control_authentic_peer_does_get_the_descriptor(pair):
    """The same search finds the descriptor in an authentic Welcome: the check above can fail."""
    pw, cw = pair.P.worker._worker, pair.C.worker._worker
    good = Authenticator(TEST_SECRET.encode(), AUTH_CHANNEL)
    reply = _ask(pair.p_port, good.seal(_hello(cw), "req"))
    msg = decode(good.open(reply, "rep"))
    assert isinstance(msg, Welcome)
    secrets = _secret_bytes(pw)
    assert all(blob in reply for blob in secrets.values())


def _flood(port, frames: list[bytes], barrier: bytes, timeout=10.0) -> tuple[list[bytes], bytes]:
    """Send ``frames`` then ``barrier`` on one socket; the server handles one peer's frames
    in order, so the barrier's reply means every frame before it was handled. Returns the
    replies to ``frames`` (a refusal the rate limit drops gets none) and the barrier's."""
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(f"tcp://127.0.0.1:{port}")
    try:
        for f in frames:
            s.send(f)
        s.send(barrier)
        replies = []
        while s.poll(int(timeout * 1000)):
            r = s.recv()
            try:
                if isinstance(decode(r), Error):
                    replies.append(r)  # the unsealed refusals
                    continue
            except msgspec.DecodeError:
                pass
            return replies, r  # sealed: the barrier's reply
        raise AssertionError(f"no reply to the barrier within {timeout}s ({len(replies)} refusals seen)")
    finally:
        s.close(0)


@pytest.mark.parametrize("n", [5, 100])
def test_auth_failures_reach_connector_stats(pair, n):
    """Bad-secret requests show in vLLM's metrics (``get_kv_connector_stats``), counted
    since the last report. 5 stay under the refusal rate limit (burst 20): each is refused
    with a reply. 100 at once exceed it: the ones beyond are dropped unanswered, and
    counted both as authentication failures and as dropped."""
    connector, cw = pair.P.worker, pair.C.worker._worker
    connector.get_kv_connector_stats()  # start a fresh interval
    wrong = Authenticator(b"guessed-wrong-secret-0000", AUTH_CHANNEL)
    good = Authenticator(TEST_SECRET.encode(), AUTH_CHANNEL)
    refusals, barrier = _flood(pair.p_port, [wrong.seal(_hello(cw), "req") for _ in range(n)],
                               good.seal(encode(Renew(keys=[])), "req"))
    assert isinstance(decode(good.open(barrier, "rep")), Reply)
    assert all(decode(r).code == "auth" for r in refusals)

    stats = connector.get_kv_connector_stats()
    assert stats is not None
    red = stats.reduce()
    assert red["kv_side_channel_auth_failures"] == n
    assert red["kv_side_channel_dropped"] == n - len(refusals)
    if n == 5:
        assert len(refusals) == 5
    else:
        assert red["kv_side_channel_dropped"] > 0, "the flood never hit the rate limit"
    assert red["kv_side_channel_malformed"] == red["kv_side_channel_version_mismatch"] == 0
    # the authentic barrier is served, not counted as a refusal; nothing new since: no report
    assert connector.get_kv_connector_stats() is None


def test_engines_with_different_secrets_never_connect(no_env):
    """Consumer with another secret: hand-shake never completes, the load fails within its
    deadline (recomputed per policy), no block leaks, the producer's memory was never exposed."""
    p = Pair("read", p_extra={"side_channel_secret": "producer-secret-0123456789"},
             c_extra={"side_channel_secret": "consumer-secret-0123456789"}, timeout_s=1.5, lease_s=3.0)
    try:
        prompt = prompt_of(50)
        params = p.prefill("p1", prompt)
        p.C.add("c1", prompt, 2, params)
        p.run(lambda: p.C.status("c1") is None, timeout=15)
        assert finish_reason(p.C, "c1") == "length"  # recomputed locally
        assert p.P.worker._worker.server.counters["auth"] >= 1
        assert not p.C.worker._worker.agent.peers  # never connected to the producer's agent
        p.drain()
        p.assert_no_leak()
    finally:
        p.close()


def test_both_sides_explicitly_off_still_work(no_env):
    p = Pair("read", p_extra={"side_channel_auth": "off"}, c_extra={"side_channel_auth": "off"})
    try:
        prompt = prompt_of(40)
        params = p.prefill("p1", prompt)
        p.C.add("c1", prompt, 2, params)
        p.run(lambda: any("c1" in (o.finished_recving or ()) for o in p.C.kv_outputs), timeout=15)
        assert p.C.check_kv("c1", prompt, 32) == []
        p.drain()
        p.assert_no_leak()
    finally:
        p.close()


def test_unknown_message_field_from_old_peer_is_refused():
    body = msgspec.msgpack.encode({"t": "renew", "v": 1, "cid": 1, "keys": [], "token": "old"})
    with pytest.raises(msgspec.ValidationError, match="token"):
        decode(body)
