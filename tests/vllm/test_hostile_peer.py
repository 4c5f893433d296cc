"""An authenticated peer that lies (a bug, or a stolen secret): real connector workers on
real vLLM Schedulers, messages sent over the side channel. The engine step never raises,
a lying layout is refused at the hand-shake, and nothing a peer chooses grows without bound."""

from __future__ import annotations

import time

import msgspec
import pytest

from harness import ask_producer, prompt_of
from kvtransport_vllm import producer as producer_mod
from kvtransport_vllm.compat import shape_problem
from kvtransport_vllm.messages import Error, Hello, Release, Welcome, WriteReq
from kvtransport_vllm.producer_peers import PeerConn
from kvtransport import notify


def _hello(pair, engine_id: str, layout=None, agent_md: bytes | None = None):
    cw = pair.C.worker._worker
    md = cw.ctx.agent_md if agent_md is None else agent_md
    return ask_producer(pair, Hello(engine_id=engine_id, tp_rank=0, agent_md=md,
                                    layout=cw.ctx.layout if layout is None else layout, reply_host="127.0.0.1",
                                    reply_port=pair.c_port))


def test_a_write_request_for_absurd_block_ids_is_refused_and_the_step_goes_on(pairs):
    """Block id 2**63 (a valid msgpack uint64) raised OverflowError out of every later step."""
    pair = pairs("write")
    key = pair.prefill("p1", prompt_of(40))["transfer_id"]
    pair.P.step()
    name = pair.C.worker._worker.ctx.name
    assert isinstance(_hello(pair, name), Welcome)
    ask_producer(pair, WriteReq(key=key, block_ids=[2**63] * 3, engine_id=name, reply_host="127.0.0.1",
                                reply_port=pair.c_port))
    for _ in range(3):
        pair.P.step()  # raised before
    hold = pair.P.worker._worker.producer.holds.get(key)
    assert hold is None or (not hold.write_ok and "write refused" in hold.write_reason)


def test_a_hand_shake_with_a_lying_layout_is_refused(pairs):
    """block_stride 0 passed the hand-shake and divided by zero in the producer's step."""
    pair = pairs("write")
    layout = pair.C.worker._worker.ctx.layout
    lying = msgspec.structs.replace(layout, block_stride=[0] * len(layout.block_stride))
    reply = _hello(pair, "liar", layout=lying)
    assert isinstance(reply, Error) and "not a KV cache" in reply.message and "block stride 0" in reply.message


@pytest.mark.parametrize("change", [dict(block_bytes=0), dict(num_layers=-1), dict(part_regions=[[(0, -5)]]),
                                    dict(block_stride=[1]), dict(part_regions=[])])
def test_shape_problem_names_what_a_layout_gets_wrong(pairs, change):
    pair = pairs("read")
    layout = pair.P.worker._worker.ctx.layout
    assert shape_problem(layout) == ""
    assert shape_problem(msgspec.structs.replace(layout, **change))


def test_a_welcome_with_a_lying_layout_fails_the_producer_not_the_consumer(pairs):
    """The consumer side of the same lie (a Welcome injected through a stand-in client):
    ZeroDivisionError escaped ProducerPeers.poll before."""
    pair = pairs("read")
    layout = pair.P.worker._worker.ctx.layout
    lying = msgspec.structs.replace(layout, block_stride=[0] * len(layout.block_stride))

    class StandInClient:  # delivers one Welcome, as the network would
        def poll(self):
            return [Welcome(engine_id="liar", agent_md=pair.P.worker._worker.ctx.agent_md, layout=lying, cid=77)]

    peers = pair.C.worker._worker.consumer.producers
    conn = PeerConn("10.0.0.1", 1, StandInClient(), state="hello", hello_cid=77)
    peers.peers[("10.0.0.1", 1)] = conn
    try:
        peers.poll()
        assert conn.state != "ready" and "not a KV cache" in conn.error
    finally:
        del peers.peers[("10.0.0.1", 1)]


def test_releases_of_unknown_keys_stay_within_the_remembered_bound(pairs, monkeypatch):
    monkeypatch.setattr(producer_mod, "_RECENT", 100)  # the same code path, a bound a test can reach
    pair = pairs("read")
    for i in range(5):
        ask_producer(pair, Release(keys=[f"k{i}-{j}" for j in range(100)]))
    assert len(pair.P.worker._worker.producer.ended) <= 100


def test_hand_shakes_under_made_up_engine_ids_stay_within_a_bound(pairs, monkeypatch):
    monkeypatch.setattr(producer_mod, "_MAX_CONSUMERS", 10)
    pair = pairs("read")
    for i in range(30):
        assert isinstance(_hello(pair, f"made-up-{i}", agent_md=b"x" * 10_000), Welcome)
    p = pair.P.worker._worker.producer
    assert len(p.consumer_md) <= 10 and len(p.consumer_layouts) <= 10 and len(p.consumer_peers) <= 10
    # the real consumer still loads (it hand-shakes again when it was forgotten)
    prompt = prompt_of(50, seed=2)
    params = pair.prefill("p2", prompt)
    pair.C.add("c2", prompt, 2, params)
    assert pair.run_to_end_checking_kv("c2", prompt) == [[]]


def test_notifications_nobody_drains_are_bounded(pairs, monkeypatch):
    """The connector does not use notifications; a secret holder sending them made the
    engine's receiver queue grow without bound."""
    monkeypatch.setattr(notify, "MAX_QUEUED", 50)
    pair = pairs("read")
    cw, pw = pair.C.worker._worker, pair.P.worker._worker
    peer = cw.ctx.agent.connect(pw.ctx.agent_md)
    for _ in range(200):
        cw.ctx.agent.send_notification(peer, b"z" * 1000)
    rx = pw.ctx.agent._backend._rx
    end = time.monotonic() + 10
    while len(rx._queue) + rx.dropped < 200 and time.monotonic() < end:
        time.sleep(0.01)
    assert len(rx._queue) <= 50 and rx.dropped == 150
    got = pw.ctx.agent.notifications()
    assert len(got) == 50 and all(n.payload == b"z" * 1000 for n in got)
