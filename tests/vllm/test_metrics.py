"""Connector statistics and Prometheus series (issue 13 point 3, issue 17 point 1).

Real Scheduler pairs move real bytes; their per-step ``kv_connector_stats`` are fed, as
vLLM's API server does, through ``KVTransportStats`` into the connector's
``build_prom_metrics`` object built on real ``prometheus_client`` metric classes (bound to
a registry of the test's own). What is checked is what an operator reads on ``/metrics``:
one ``ok`` outcome per load and per hold, one transfer per load with its bytes and blocks,
the phases of every load, in-flight gauges back to zero, and an injected failure counted
under its cause.
"""

from __future__ import annotations

import pytest
from harness import make_vllm_config, prompt_of
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvtransport_vllm.connector import KVTransportConnector
from kvtransport_vllm.load_stats import PHASES
from kvtransport_vllm.stats import KVTransportStats


def _prom(extra: dict) -> tuple[object, CollectorRegistry]:
    reg = CollectorRegistry()

    def bound(cls: type) -> type:
        class Bound(cls):  # type: ignore[misc,valid-type]
            def __init__(self, *a, **k):
                super().__init__(*a, registry=reg, **k)
        return Bound

    types = {Gauge: bound(Gauge), Counter: bound(Counter), Histogram: bound(Histogram)}
    cfg = make_vllm_config("kv_consumer", extra)
    prom = KVTransportConnector.build_prom_metrics(cfg, types, ["model_name", "engine"], {0: ["tiny", "0"]})
    return prom, reg


def _feed(engine, prom) -> KVTransportStats:
    """Observe every step's stats of ``engine`` (as vLLM's logger does) and return their sum."""
    total = KVTransportStats()
    for kvo in engine.kv_outputs:
        s = kvo.kv_connector_stats
        if s is not None and not s.is_empty():
            prom.observe(s.data, 0)
            total.aggregate(s)
    engine.kv_outputs.clear()
    return total


def _value(reg: CollectorRegistry, name: str, **labels: str) -> float:
    v = reg.get_sample_value(name, {"model_name": "tiny", "engine": "0", **labels})
    return 0.0 if v is None else v


@pytest.mark.parametrize("mode", ["read", "write"])
def test_series_count_the_loads_and_holds(pairs, mode):
    pair = pairs(mode)
    prompts = {f"r{i}": prompt_of(40 + 30 * i, seed=i) for i in range(3)}
    for rid, prompt in prompts.items():
        params = pair.prefill(rid, prompt)
        pair.C.add(rid, prompt, 3, params)
    pair.drain()
    labels = {"backend": "loopback", "mode": mode}
    c_prom, c_reg = _prom({"backend": "loopback", "mode": mode})
    p_prom, p_reg = _prom({"backend": "loopback", "mode": mode})
    c_total, p_total = _feed(pair.C, c_prom), _feed(pair.P, p_prom)

    assert _value(c_reg, "vllm:kvtransport_outcomes_total", side="load", cause="ok", **labels) == 3
    assert _value(p_reg, "vllm:kvtransport_outcomes_total", side="hold", cause="ok", **labels) == 3
    assert _value(c_reg, "vllm:kvtransport_remote_kv_wait_seconds_count", **labels) == 3
    for phase in PHASES:
        assert _value(c_reg, "vllm:kvtransport_load_phase_seconds_count", phase=phase, **labels) == 3
    # the phases add up to the wait (same observations, summed)
    parts = sum(_value(c_reg, "vllm:kvtransport_load_phase_seconds_sum", phase=p, **labels) for p in PHASES[:-1])
    assert parts == pytest.approx(_value(c_reg, "vllm:kvtransport_remote_kv_wait_seconds_sum", **labels), rel=1e-6)
    # one transfer per request, on the side that posts it, with its bytes and blocks
    mover_reg, mover_total = (c_reg, c_total) if mode == "read" else (p_reg, p_total)
    assert _value(mover_reg, "vllm:kvtransport_transfer_seconds_count", **labels) == 3
    assert _value(mover_reg, "vllm:kvtransport_transfer_bytes_sum", **labels) == mover_total.data["bytes"] > 0
    assert _value(mover_reg, "vllm:kvtransport_transfer_blocks_sum", **labels) == sum(mover_total.data["transfer_blocks"]) >= 3
    # WRITE: each write's time after the prefill, on the prefill side (READ has none)
    assert _value(p_reg, "vllm:kvtransport_write_after_prefill_seconds_count", **labels) == (3 if mode == "write" else 0)
    assert len(p_total.data["write_after_prefill_s"]) == (3 if mode == "write" else 0)
    # nothing left in flight on either side
    assert _value(c_reg, "vllm:kvtransport_loads_in_flight", **labels) == 0
    assert _value(p_reg, "vllm:kvtransport_holds_in_flight", **labels) == 0
    # and the log line vLLM prints carries the phase means
    assert "avg_transfer_ms" in c_total.reduce() and "avg_total_ms" in c_total.reduce()


def test_injected_failure_counted_under_its_cause(pairs):
    faults = {"backend_options": {"faults": {"fail_rate": 1.0, "seed": 1}}}
    pair = pairs("read", policy="recompute", c_extra=faults)
    prompt = prompt_of(50)
    params = pair.prefill("f1", prompt)
    pair.C.add("f1", prompt, 2, params)
    pair.drain()
    prom, reg = _prom({"backend": "loopback", "mode": "read"})
    _feed(pair.C, prom)
    labels = {"backend": "loopback", "mode": "read", "side": "load"}
    assert _value(reg, "vllm:kvtransport_outcomes_total", cause="transport_failure", **labels) == 1
    assert _value(reg, "vllm:kvtransport_outcomes_total", cause="ok", **labels) == 0


def test_grafana_dashboard_uses_only_exported_series(pairs):
    """examples/grafana-kvtransport.json queries series the connector really exports."""
    import json
    import re
    from pathlib import Path

    pair = pairs("read")
    prompt = prompt_of(70)
    params = pair.prefill("g1", prompt)
    pair.C.add("g1", prompt, 2, params)
    pair.drain()
    c_prom, c_reg = _prom({"backend": "loopback", "mode": "read"})
    p_prom, p_reg = _prom({"backend": "loopback", "mode": "read"})
    _feed(pair.C, c_prom)
    _feed(pair.P, p_prom)
    exported = {s.name for reg in (c_reg, p_reg) for m in reg.collect() for s in m.samples}
    dash = json.loads((Path(__file__).resolve().parents[2] / "examples" / "grafana-kvtransport.json").read_text())
    used = {n for p in dash["panels"] for t in p["targets"] for n in re.findall(r"vllm:kvtransport_\w+", t["expr"])}
    assert used and not used - exported, f"dashboard series not exported: {sorted(used - exported)}"


def test_a_write_load_that_settles_during_a_forward_books_the_wait_as_step(pairs):
    """The producer's "written" arrives while the decode engine is not stepping (as inside a
    forward): vLLM can hear of the load only when the engine's step ends, so that wait is
    the ``step`` phase, not the connector's (confirm and report stay 0)."""
    from kvtransport_vllm.recv import RecvState
    from harness import run_until

    pair = pairs("write")
    prompt = prompt_of(70)
    params = pair.prefill("p1", prompt)
    producer, consumer = pair.P.worker._worker.producer, pair.C.worker._worker.consumer
    run_until([pair.P], lambda: bool(producer.holds))
    pair.C.add("c1", prompt, 3, params)
    run_until([pair.C], lambda: any(h.dest is not None for h in producer.holds.values()))
    # only the producer steps: the decode engine is "in a forward" until "written" is in
    run_until([pair.P], lambda: consumer.recv["c1"].state is RecvState.WRITE_WAIT and consumer.recv["c1"].written)
    run_until([pair.C], lambda: "c1" not in consumer.recv)
    pair.drain()
    total = _feed(pair.C, _prom({"backend": "loopback", "mode": "write"})[0])
    phases = {p: total.data["phase_s"][p] for p in PHASES}
    assert phases["confirm"] == [0.0] and phases["report"] == [0.0], phases
    assert phases["step"][0] > 0.0, phases
    assert sum(phases[p][0] for p in PHASES[:-1]) == pytest.approx(phases["total"][0], rel=1e-6)
    pair.assert_no_leak()
