"""Data parallelism (issue 14, point 2 and acceptance 4) and the once-per-peer logging of a
refused hand-shake (acceptance 5, logging part).

Side-channel ports: worker (DP rank d, TP rank r) listens on
``side_channel_port + d * tp_size + r``; a producer's ``kv_transfer_params`` name
``remote_port = side_channel_port + d * tp_size`` (its DP rank's base) and the consumer
adds its own TP rank. Here two producer engines are DP ranks 0 and 1 of one deployment on
one host, configured with the SAME base port, as are two consumer engines; each request
is loaded by the consumer rank the "router" picked, from the producer rank that
prefilled it, with the bytes checked block by block and no block leaked anywhere.
"""

from __future__ import annotations

import logging
import types

import pytest

from harness import Engine, finish_reason, free_port_base, prompt_of, run_until
from kvtransport_vllm.config import ConnectorConfig, ConnectorConfigError, data_parallel_rank, rank_port
from kvtransport_vllm.producer_peers import PeerConn
from vllm.v1.request import RequestStatus


# -- port layout ------------------------------------------------------------------------

def test_port_layout_dp_by_tp_is_distinct_and_contiguous():
    base, dp_size, tp_size = 5600, 3, 2
    ports = {(d, r): rank_port(base, d, tp_size, r) for d in range(dp_size) for r in range(tp_size)}
    assert sorted(ports.values()) == list(range(base, base + dp_size * tp_size))
    assert ports[(1, 0)] == 5602 and ports[(2, 1)] == 5605
    for d in range(dp_size):
        advertised = rank_port(base, d, tp_size)  # what the producer's kv_transfer_params name
        for r in range(tp_size):
            assert advertised + r == ports[(d, r)]  # the consumer's "+ tp_rank" lands on that worker


def test_port_layout_dp1_unchanged():
    """DP=1 keeps the layout from before data parallelism: TP rank r on base + r."""
    assert [rank_port(5600, 0, 4, r) for r in range(4)] == [5600, 5601, 5602, 5603]
    assert rank_port(5600, 0, 1) == 5600


def test_port_past_65535_refused_naming_the_setting():
    assert rank_port(65532, 1, 2, 1) == 65535
    with pytest.raises(ConnectorConfigError, match=r"side_channel_port 65533 .* = 65536 is not a TCP port.*lower "
                                                   r"side_channel_port"):
        rank_port(65533, 1, 2, 1)


@pytest.mark.parametrize("dp_rank, tp_size, tp_rank", [(-1, 1, 0), (0, 0, 0), (0, 2, 2), (0, 2, -1)])
def test_invalid_rank_refused(dp_rank, tp_size, tp_rank):
    with pytest.raises(ConnectorConfigError, match="invalid rank"):
        rank_port(5600, dp_rank, tp_size, tp_rank)


def test_dp_rank_read_as_vllm_sets_it():
    """A dense model's DP rank survives vLLM resetting ``data_parallel_rank`` to 0 (each
    rank becomes an independent engine); only ``data_parallel_index`` keeps it."""
    from vllm.config import ParallelConfig

    assert data_parallel_rank(types.SimpleNamespace(parallel_config=ParallelConfig())) == 0
    pc = ParallelConfig(data_parallel_size=2, data_parallel_rank=1)
    assert data_parallel_rank(types.SimpleNamespace(parallel_config=pc)) == 1  # MoE: rank kept
    pc.reconfigure_for_independent_dp_rank()  # what EngineCoreProc does for a dense model
    assert pc.data_parallel_rank == 0
    assert data_parallel_rank(types.SimpleNamespace(parallel_config=pc)) == 1


def test_scheduler_advertises_its_dp_rank_base_and_worker_listens_on_its_port():
    """The scheduler's ``remote_port`` and the worker's port, DP rank 1 of TP 2."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    from kvtransport_vllm.scheduler import KVTransportScheduler
    from kvtransport_vllm.worker import KVTransportWorker

    cfg = ConnectorConfig.from_extra("kv_producer", "P", {"side_channel_port": 7000})

    def finished_params(sched: KVTransportScheduler) -> dict:
        req = Request(request_id="r1", prompt_token_ids=list(range(3, 40)), sampling_params=SamplingParams(max_tokens=1),
                      pooling_params=None)
        req.kv_transfer_params = {"do_remote_decode": True}
        req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        delay, params = sched.request_finished(req, [4, 5])
        assert delay and params is not None
        return params

    assert finished_params(KVTransportScheduler(cfg, 16, tp_size=2, dp_rank=1))["remote_port"] == 7002
    assert finished_params(KVTransportScheduler(cfg, 16, tp_size=2))["remote_port"] == 7000  # DP=1 as before
    for (d, r), port in {(0, 0): 7000, (0, 1): 7001, (1, 0): 7002, (1, 1): 7003}.items():
        w = KVTransportWorker(cfg, 16, 4, "float32", tp_rank=r, tp_size=2, dp_rank=d)
        try:
            assert w.port == port and w.ctx.port == port  # ctx.port: the reply address in our Hello
        finally:
            w.shutdown()


# -- two DP ranks per engine, real Schedulers and workers ----------------------------------------

def _run_loads(engines: list[Engine], loads: dict[str, tuple[Engine, list[int]]]) -> dict[str, list[list[int]]]:
    """Step every engine until each consumer request is gone; for each, the first time it is
    RUNNING with its whole prompt computed, record ``check_kv`` (blocks differing from
    what the producer computed)."""
    seen: dict[str, list[list[int]]] = {rid: [] for rid in loads}

    def ended() -> bool:
        done = True
        for rid, (c, prompt) in loads.items():
            req = c.scheduler.requests.get(rid)
            if (not seen[rid] and req is not None and c.status(rid) == RequestStatus.RUNNING
                    and req.num_computed_tokens >= len(prompt)):
                seen[rid].append(c.check_kv(rid, prompt, len(prompt)))
            done = done and req is None
        return done

    run_until(engines, ended, timeout=30.0)
    return seen


def _sent(engine: Engine) -> list[str]:
    return [rid for o in engine.kv_outputs for rid in (o.finished_sending or ())]


def _stat(engine: Engine, key: str) -> int:
    return sum(o.kv_connector_stats.data[key] for o in engine.kv_outputs if o.kv_connector_stats)


@pytest.mark.parametrize("mode", ["read", "write"])
def test_two_dp_ranks_same_base_port_each_load_reaches_its_rank(mode):
    base = free_port_base(8)
    common = {"backend": "loopback", "mode": mode, "transfer_timeout_s": 5.0, "lease_s": 10.0,
              "load_failure_policy": "fail"}
    engines: list[Engine] = []
    try:
        # vLLM names DP engines <engine_id>_dp<rank>; the harness takes the ids as given
        for role, port, name in (("kv_producer", base, "P"), ("kv_consumer", base + 4, "C")):
            for d in (0, 1):
                engines.append(Engine(role, {**common, "side_channel_port": port}, engine_id=f"{name}_dp{d}",
                                      dp_rank=d))
        P0, P1, C0, C1 = engines
        ports = [e.worker._worker.port for e in engines]
        assert ports == [base, base + 1, base + 4, base + 5]
        assert all(e.worker._worker.server is not None for e in engines)  # all four listening

        prompt_a, prompt_b = prompt_of(70, seed=1), prompt_of(53, seed=2)
        params: dict[str, dict] = {}
        P0.add("a", prompt_a, 1, {"do_remote_decode": True})
        P1.add("b", prompt_b, 1, {"do_remote_decode": True})
        run_until([P0, P1], lambda: "a" in params and "b" in params, on_params=params.update)
        assert params["a"]["remote_port"] == base and params["b"]["remote_port"] == base + 1
        assert params["a"]["remote_engine_id"] == "P_dp0" and params["b"]["remote_engine_id"] == "P_dp1"

        # the router crosses ranks: consumer rank 1 decodes producer rank 0's prefill and back
        C1.add("ca", prompt_a, 3, params["a"])
        C0.add("cb", prompt_b, 3, params["b"])
        seen = _run_loads(engines, {"ca": (C1, prompt_a), "cb": (C0, prompt_b)})

        assert seen == {"ca": [[]], "cb": [[]]}, f"loaded KV differs from the prefill's: {seen}"
        for c, rid in ((C1, "ca"), (C0, "cb")):
            assert finish_reason(c, rid) == "length"
            assert c.first_start[rid] > 0, f"{rid} was prefilled locally, not loaded"
            assert _stat(c, "loads_ok") == 1 and _stat(c, "failures") == 0
        # each load hand-shook with, and was served by, the producer rank that prefilled it
        host = params["a"]["remote_host"]
        assert set(C1.worker._worker.consumer.peers) == {(host, base)}
        assert set(C0.worker._worker.consumer.peers) == {(host, base + 1)}
        assert _sent(P0) == ["a"] and _sent(P1) == ["b"]

        run_until(engines, lambda: not any(e.scheduler.requests for e in engines))
        for e in engines:
            assert e.free_blocks() == e.free0, f"{e.engine_id} leaked blocks"
    finally:
        for e in engines:
            e.close()


# -- a refused hand-shake is logged once per peer -------------------------------------------------

def test_peer_conn_logs_repeated_refusal_once(caplog):
    caplog.set_level(logging.DEBUG, logger="kvtransport_vllm.producer_peers")
    p = PeerConn("127.0.0.1", 5600, client=None)
    for msg in ["refused: A", "refused: A", "refused: A", "refused: B", "refused: B"]:
        p.fail(msg)
        assert p.state == "failed" and p.error == msg  # every refusal still fails the hand-shake
    ours = [r for r in caplog.records if r.name == "kvtransport_vllm.producer_peers"]
    errors = [r.getMessage() for r in ours if r.levelno == logging.ERROR]
    debug = [r.getMessage() for r in ours if r.levelno == logging.DEBUG]
    assert errors == ["refused: A", "refused: B"]
    assert len(debug) == 3 and all("repeated" in m for m in debug)


def test_repeated_handshake_refusal_logged_once_per_peer(pairs, caplog):
    """Three loads one after another from a producer whose layout differs (block size): each
    load hand-shakes again and is refused, but the refusal is logged at error level once
    (16 and 24 tokens a block: neither divides the other)."""
    caplog.set_level(logging.DEBUG, logger="kvtransport_vllm.producer_peers")
    pair = pairs("read", c_block_size=24, timeout_s=5.0, lease_s=10.0, policy="recompute")
    for i in range(3):
        prompt = prompt_of(64, seed=10 + i)
        params = pair.prefill(f"p{i}", prompt)
        pair.C.add(f"c{i}", prompt, 2, params)
        pair.run(lambda rid=f"c{i}": rid not in pair.C.scheduler.requests, timeout=15.0)
        assert finish_reason(pair.C, f"c{i}") == "length" and pair.C.first_start[f"c{i}"] == 0  # recomputed
    ours = [r for r in caplog.records if r.name == "kvtransport_vllm.producer_peers"]
    errors = [r.getMessage() for r in ours if r.levelno == logging.ERROR]
    repeats = [r.getMessage() for r in ours if r.levelno == logging.DEBUG and "repeated" in r.getMessage()]
    assert len(errors) == 1 and "block_size" in errors[0] and "refused hand-shake" in errors[0], errors
    assert len(repeats) == 2, f"expected the two later refusals at debug level, got {repeats}"
    pair.drain()
    pair.assert_no_leak()
