"""``kvtransport doctor`` against real connector workers (issue 17, point 5 / acceptance 4).

Each pair is a real vLLM Scheduler + connector worker per engine (tests/vllm/harness.py),
real KV tensors and real side channels; the doctor talks to them as it would to serving
engines: sealed side channel, its own loopback agent, one block moved both ways. Checked:
a healthy pair is called healthy and the block the doctor got is the engine's block;
a wrong secret, a closed port, a layout mismatch and an unusable backend are each named
with their fix; exit codes; the engines' KV caches are never written and they still
serve a load afterwards; a probe cannot pose as one of an engine's real peers; with TP 2
every rank is checked (workers built directly on real K/V-split tensors), and a TP size
mismatch is named.
"""

from __future__ import annotations

import time

import pytest
import torch

from harness import TEST_SECRET, free_port_base, prompt_of
from kvtransport.cli import main as cli_main
from kvtransport_vllm.doctor import (
    FIX_ADDRESS,
    FIX_BACKEND_HERE,
    FIX_LAYOUT,
    FIX_PORT,
    FIX_SECRET,
    run_doctor,
)
from kvtransport_vllm.messages import ProbeResult, ProbeWrite
from kvtransport_vllm.side_channel import SideChannelClient

SECRET = TEST_SECRET.encode()


def _addr(engine) -> tuple[str, int]:
    """The side-channel address an engine advertises (what an operator passes)."""
    w = engine.worker._worker
    return w.cfg.side_channel_host, w.port


def _arg(engine) -> str:
    host, port = _addr(engine)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _kv_snapshot(engine) -> dict[str, torch.Tensor]:
    return {k: t.clone() for k, t in engine.kv_caches.items()}


def _block_bytes(engine, block_id: int) -> bytes:
    """An engine's block as the layout orders it: every layer's block, layer by layer."""
    return b"".join(t[block_id].contiguous().numpy().tobytes() for t in engine.kv_caches.values())


@pytest.mark.parametrize("mode", ["read", "write"])
def test_healthy_pair_is_healthy_and_the_block_is_the_engines(pairs, mode):
    pair = pairs(mode)
    prompt = prompt_of(40)
    pair.prefill("p1", prompt)  # a held prefill: its first block carries the stand-in model's KV
    block = pair.P.block_ids("p1")[0]
    assert any(_block_bytes(pair.P, block)), "the prefill wrote no KV: the byte check below would prove nothing"
    before = {"P": _kv_snapshot(pair.P), "C": _kv_snapshot(pair.C)}

    v = run_doctor(_addr(pair.P), _addr(pair.C), SECRET, block_id=block)

    assert v.healthy, v.render()
    assert v.exit_code == 0
    assert v.render().endswith("verdict: healthy")
    checks = {(f.check, f.subject) for f in v.findings}
    for who in ("prefill rank 0", "decode rank 0"):
        assert {("side_channel", who), ("read", who), ("write", who), ("bytes", who)} <= checks
    assert ("compat", "pair") in checks
    # what the doctor moved both ways is the engine's block, byte for byte
    assert v.moved["prefill rank 0"] == _block_bytes(pair.P, block)
    assert v.moved["decode rank 0"] == _block_bytes(pair.C, block)
    # never written: both engines' KV caches are as they were
    for name, engine in (("P", pair.P), ("C", pair.C)):
        for layer, t in engine.kv_caches.items():
            assert torch.equal(t, before[name][layer]), f"the doctor changed {name}'s {layer}"
        assert not [p for p in engine.worker._worker.agent.peers if p.startswith("kvtransport-doctor-")], \
            "the doctor's agent is still connected to the engine"
    # and the pair still serves: the held prefill loads with its bytes intact
    pair.C.add("c1", prompt, 2, pair.params["p1"])
    assert pair.run_to_end_checking_kv("c1", prompt) == [[]]
    assert pair.C.first_start["c1"] >= len(prompt) - 1, "the KV was recomputed, not loaded"
    pair.drain()
    pair.assert_no_leak()


def test_cli_exit_codes_healthy_and_usage(pairs, capsys, monkeypatch):
    pair = pairs("read")
    monkeypatch.setenv("KVTRANSPORT_SECRET", TEST_SECRET)
    assert cli_main(["doctor", _arg(pair.P), _arg(pair.C), "--timeout", "20"]) == 0
    assert "verdict: healthy" in capsys.readouterr().out
    assert cli_main(["doctor", "no-port-here", _arg(pair.C)]) == 2
    assert "is not HOST:PORT" in capsys.readouterr().out
    monkeypatch.delenv("KVTRANSPORT_SECRET")
    monkeypatch.delenv("KVTRANSPORT_SECRET_FILE", raising=False)
    monkeypatch.delenv("KVTRANSPORT_AUTH", raising=False)
    assert cli_main(["doctor", _arg(pair.P), _arg(pair.C)]) == 2
    assert "KVTRANSPORT_SECRET" in capsys.readouterr().out


def test_wrong_secret_is_named_with_its_fix(pairs, tmp_path, capsys, monkeypatch):
    pair = pairs("read")
    v = run_doctor(_addr(pair.P), _addr(pair.C), b"not-the-cluster-secret-at-all", timeout_s=20.0)
    assert not v.healthy and v.exit_code == 1
    auth = [f for f in v.problems if f.check == "auth"]
    assert {f.subject for f in auth} == {"prefill rank 0", "decode rank 0"}, v.render()
    assert all("wrong secret" in f.message and f.fix == FIX_SECRET for f in auth)
    # no secret at all on the doctor's side (KVTRANSPORT_AUTH=off): the engines require one
    v = run_doctor(_addr(pair.P), _addr(pair.C), None, timeout_s=20.0)
    auth = [f for f in v.problems if f.check == "auth"]
    assert len(auth) == 2 and all("requires sealed messages" in f.message and f.fix == FIX_SECRET for f in auth)
    # through the command line, with the secret from a file
    wrong = tmp_path / "secret"
    wrong.write_text("not-the-cluster-secret-at-all\n")
    monkeypatch.delenv("KVTRANSPORT_SECRET", raising=False)
    assert cli_main(["doctor", _arg(pair.P), _arg(pair.C), "--secret-file", str(wrong), "--timeout", "20"]) == 1
    out = capsys.readouterr().out
    assert "wrong secret" in out and "KVTRANSPORT_SECRET" in out and "verdict: 2 problem(s): auth" in out


def test_closed_port_is_named_with_its_fix(pairs):
    pair = pairs("read")
    closed = free_port_base(1)
    host, _ = _addr(pair.C)
    v = run_doctor(_addr(pair.P), (host, closed), SECRET, timeout_s=20.0)
    assert v.exit_code == 1
    [reach] = [f for f in v.problems if f.check == "reach"]
    assert reach.subject == "decode rank 0"
    assert f"port closed: nothing listens on {host}:{closed}" in reach.message and reach.fix == FIX_PORT
    # the reachable engine is still checked on its own: its data path works
    assert any(f.check == "bytes" and f.subject == "prefill rank 0" and f.ok for f in v.findings), v.render()
    assert [f.check for f in v.problems] == ["reach"], v.render()


def test_layout_mismatch_is_named_with_its_fix(pairs):
    pair = pairs("read", c_block_size=24)  # 16 and 24: neither divides the other
    v = run_doctor(_addr(pair.P), _addr(pair.C), SECRET, timeout_s=20.0)
    assert v.exit_code == 1
    [layout] = [f for f in v.problems if f.check == "layout"]
    assert "block_size: prefill 16 vs decode 24" in layout.message and layout.fix == FIX_LAYOUT
    assert [f.check for f in v.problems] == ["layout"], v.render()


def test_unusable_backend_on_the_doctors_side_is_named_with_its_fix(pairs):
    pair = pairs("read")
    v = run_doctor(_addr(pair.P), _addr(pair.C), SECRET, backend_options={"no_such_option": 1}, timeout_s=20.0)
    assert v.exit_code == 1
    backend = [f for f in v.problems if f.check == "backend"]
    assert {f.subject for f in backend} == {"prefill rank 0", "decode rank 0"}, v.render()
    assert all("cannot open a loopback agent" in f.message and "no_such_option" in f.message
               and f.fix == FIX_BACKEND_HERE for f in backend)


def test_probe_write_cannot_pose_as_a_real_peer(pairs):
    """A ProbeWrite whose agent is not a doctor agent is refused: connecting it could
    replace one of the engine's real peers (and fail that peer's transfers)."""
    pair = pairs("read")
    cw = pair.C.worker._worker
    host, port = _addr(pair.P)
    client = SideChannelClient(host, port, auth=pair.P.worker._worker.cfg.make_authenticator())
    try:
        cid = client.send(ProbeWrite(agent_md=cw.agent.metadata(), block_id=0, region_id=0, offset=0))
        end = time.monotonic() + 20.0  # a hang guard, not a timing bound
        replies: list = []
        while not replies:
            replies = [r for r in client.poll() if r.cid == cid]
            assert time.monotonic() < end, "no answer to ProbeWrite"
            time.sleep(0.005)
    finally:
        client.close()
    [reply] = replies
    assert isinstance(reply, ProbeResult) and reply.state == "refused"
    assert "is not a doctor agent" in reply.detail
    assert cw.name not in pair.P.worker._worker.agent.peers


def test_block_the_engine_does_not_have_is_named(pairs):
    pair = pairs("read")
    v = run_doctor(_addr(pair.P), _addr(pair.C), SECRET, block_id=10**6, timeout_s=20.0)
    assert v.exit_code == 1
    read = [f for f in v.problems if f.check == "read"]
    assert {f.subject for f in read} == {"prefill rank 0", "decode rank 0"}, v.render()
    assert all(f"has no block {10**6}" in f.message and "--block below" in f.fix for f in read)


def test_engine_without_authentication_is_named(pairs):
    """The engines run with side_channel_auth off, the doctor seals: named, with both fixes."""
    pair = pairs("read", p_extra={"side_channel_auth": "off"}, c_extra={"side_channel_auth": "off"})
    v = run_doctor(_addr(pair.P), _addr(pair.C), SECRET, timeout_s=20.0)
    assert v.exit_code == 1
    auth = [f for f in v.problems if f.check == "auth"]
    assert {f.subject for f in auth} == {"prefill rank 0", "decode rank 0"}, v.render()
    assert all("side_channel_auth off" in f.message and "KVTRANSPORT_AUTH=off" in f.fix for f in auth)
    # and with authentication off on the doctor's side too, the pair is healthy
    assert run_doctor(_addr(pair.P), _addr(pair.C), None, timeout_s=20.0).healthy


# ----------------------------------------------------------------------------- TP > 1
def _tp_engine(role: str, tp_size: int, ranks: int, seed: int):
    """``ranks`` real connector workers of one engine (TP size ``tp_size``), each with its
    own K/V-split CPU cache of distinct bytes, listening on base port + rank."""
    from kvtransport_vllm.config import ConnectorConfig
    from kvtransport_vllm.worker import KVTransportWorker

    base = free_port_base(4)
    cfg = ConnectorConfig.from_extra(role, f"{role}-tp", {"side_channel_host": "127.0.0.1", "side_channel_port": base})
    gen = torch.Generator().manual_seed(seed)
    workers = []
    for r in range(ranks):
        w = KVTransportWorker(cfg, 16, 8, "float32", tp_rank=r, tp_size=tp_size)
        w.register_kv_caches({f"l{i}": torch.rand((2, 8, 16, 2, 32), generator=gen) for i in range(2)})
        workers.append(w)
    return base, workers


def _tp_block(w, block_id: int) -> bytes:
    """One rank's block as the layout orders it: per layer, the K part then the V part."""
    return b"".join(t[part, block_id].contiguous().numpy().tobytes()
                    for t in w._kv_caches.values() for part in (0, 1))


def test_every_tp_rank_is_checked():
    pre_base, pre = _tp_engine("kv_producer", 2, 2, 1)
    dec_base, dec = _tp_engine("kv_consumer", 2, 2, 2)
    try:
        v = run_doctor(("127.0.0.1", pre_base), ("127.0.0.1", dec_base), SECRET, block_id=3, timeout_s=20.0)
        assert v.healthy, v.render()
        for r in (0, 1):
            assert v.moved[f"prefill rank {r}"] == _tp_block(pre[r], 3)
            assert v.moved[f"decode rank {r}"] == _tp_block(dec[r], 3)
        assert v.moved["prefill rank 0"] != v.moved["prefill rank 1"]  # each rank's own cache
    finally:
        for w in pre + dec:
            w.shutdown()


def test_tp_sizes_that_do_not_map_are_named_and_every_rank_of_each_engine_is_checked():
    """Prefill TP 2 and decode TP 1 with caches that keep tokens outside heads (K/V halves
    first): different TP sizes cannot slice them, and the doctor says so with the
    hand-shake's own words; it checks both prefill ranks and the one decode rank (no
    decode rank 1 is looked for)."""
    pre_base, pre = _tp_engine("kv_producer", 2, 2, 1)
    dec_base, dec = _tp_engine("kv_consumer", 1, 1, 2)
    try:
        v = run_doctor(("127.0.0.1", pre_base), ("127.0.0.1", dec_base), SECRET, timeout_s=20.0)
        assert v.exit_code == 1
        [layout] = [f for f in v.problems if f.check == "layout"]
        assert "tp_size: prefill 2 vs decode 1" in layout.message and layout.fix == FIX_LAYOUT
        assert [f.check for f in v.problems] == ["layout"], v.render()
        assert set(v.moved) == {"prefill rank 0", "prefill rank 1", "decode rank 0"}, v.render()
    finally:
        for w in pre + dec:
            w.shutdown()


def _heads_outer_engine(role: str, tp_size: int, seed: int):
    """A real engine of ``tp_size`` ranks serving a model with 4 KV heads, CPU layout
    ``[num_blocks, heads of the rank, block_size, 2*head_size]`` (heads outside tokens)."""
    from kvtransport_vllm.config import ConnectorConfig
    from kvtransport_vllm.worker import KVTransportWorker, ModelInfo

    base = free_port_base(4)
    cfg = ConnectorConfig.from_extra(role, f"{role}-h{tp_size}", {"side_channel_host": "127.0.0.1",
                                                                  "side_channel_port": base})
    gen = torch.Generator().manual_seed(seed)
    workers = []
    for r in range(tp_size):
        model = ModelInfo("tiny", "float32", 4, 4 // tp_size, 32)
        w = KVTransportWorker(cfg, 16, 8, "float32", tp_rank=r, tp_size=tp_size, model=model)
        w.register_kv_caches({f"l{i}": torch.rand((8, 4 // tp_size, 16, 64), generator=gen) for i in range(2)})
        workers.append(w)
    return base, workers


def test_heterogeneous_tp_pair_that_maps_is_healthy():
    """Prefill TP 2 -> decode TP 1 on a heads-outer layout is a pair the connector serves
    (each decode rank gathers its heads from both prefill ranks): healthy, all ranks moved."""
    pre_base, pre = _heads_outer_engine("kv_producer", 2, 1)
    dec_base, dec = _heads_outer_engine("kv_consumer", 1, 2)
    try:
        v = run_doctor(("127.0.0.1", pre_base), ("127.0.0.1", dec_base), SECRET, block_id=3, timeout_s=20.0)
        assert v.healthy, v.render()
        assert set(v.moved) == {"prefill rank 0", "prefill rank 1", "decode rank 0"}
        for r, w in enumerate(pre):
            want = b"".join(t[3].contiguous().numpy().tobytes() for t in w._kv_caches.values())
            assert v.moved[f"prefill rank {r}"] == want
    finally:
        for w in pre + dec:
            w.shutdown()


def test_an_engine_addressed_by_another_name_is_named_not_blamed_on_the_secret(pairs):
    """The doctor reaching an engine through a port forward seals its request for the
    forward's address; the engine (advertising another one) refuses it as misdirected.
    The doctor says the address is wrong, not the secret, and names the fix."""
    import threading

    import zmq

    pair = pairs("read", p_extra={"side_channel_host": "127.0.0.3"})
    host, port = _addr(pair.P)
    assert host == "127.0.0.3"
    fwd = free_port_base(1)
    ctx = zmq.Context()
    front, back = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    front.bind(f"tcp://127.0.0.1:{fwd}")
    back.connect(f"tcp://{host}:{port}")
    stop = threading.Event()

    def forward() -> None:
        """A port forward for one client: frames on, answers back to whoever asked last."""
        poller = zmq.Poller()
        poller.register(front, zmq.POLLIN)
        poller.register(back, zmq.POLLIN)
        ident = None
        while not stop.is_set():
            for sock, _ in poller.poll(50):
                if sock is front:
                    ident, *frames = front.recv_multipart()
                    back.send_multipart(frames)
                elif ident is not None:
                    front.send_multipart([ident, *back.recv_multipart()])

    t = threading.Thread(target=forward, daemon=True)
    t.start()
    try:
        v = run_doctor(("127.0.0.1", fwd), _addr(pair.C), SECRET, timeout_s=20.0)
    finally:
        stop.set()
        t.join(10)
        front.close(0)
        back.close(0)
        ctx.term()
    assert not t.is_alive()
    found = [f for f in v.problems if f.subject == "prefill rank 0"]
    assert len(found) == 1, v.render()
    assert found[0].check == "side_channel" and "not the name this engine advertises" in found[0].message
    assert f"{host}:{port}" in found[0].message and found[0].fix == FIX_ADDRESS
    assert not any(f.check == "auth" for f in v.problems), v.render()
