"""One failed transfer must not fail its siblings (vllm#56104's trigger, the other way round).

A failed write retires the producer's connection to that consumer, to be re-made before the
next write (how a connection reset heals, docs/RELIABILITY.md). Re-making it disconnects the
old connection, which fails every transfer still on it. So the producer waits until nothing
is in flight on the old connection before re-making it: the write that was in flight lands,
and the write asked for meanwhile waits, then goes over the new connection.

Real Schedulers and connectors on loopback (tests/vllm/harness.py); the fault wrapper makes
the first write slow (its completion reported 3 s late: bytes landed on time), the second
fail at its post, the third normal.
"""

from __future__ import annotations

import pytest
from harness import Pair, prompt_of
from vllm.v1.request import RequestStatus

from kvtransport_vllm.producer import Producer

pytestmark = pytest.mark.timeout(120)

LOOP = {"side_channel_host": "127.0.0.1"}
SLOW_S = 3.0


def _plan(pair: Pair):
    return pair.P.worker._worker.agent.faults.plan


@pytest.mark.parametrize("variant", ["as_built", "broken_reconnect_at_once"])
def test_a_failed_write_leaves_the_write_in_flight_beside_it_alone(monkeypatch, variant):
    if variant.startswith("broken"):  # the old rule: re-make the connection at the next write
        monkeypatch.setattr(Producer, "_writes_in_flight_on", lambda self, peer: False)
    faults = {"backend_options": {"faults": {"seed": 1}}, **LOOP}
    pair = Pair("write", policy="recompute", timeout_s=10.0, lease_s=30.0, p_extra=faults, c_extra=LOOP)
    try:
        prompts = {rid: prompt_of(40 + 8 * i, seed=i + 11) for i, rid in enumerate("abc")}
        params = {rid: pair.prefill(f"p{rid}", prompts[rid]) for rid in "abc"}
        plan = _plan(pair)
        checks: dict[str, list[int]] = {}

        def record() -> None:
            for rid, prompt in prompts.items():
                req = pair.C.scheduler.requests.get(rid)
                if (rid not in checks and req is not None and pair.C.status(rid) == RequestStatus.RUNNING
                        and req.num_computed_tokens >= len(prompt)):
                    checks[rid] = pair.C.check_kv(rid, prompt, len(prompt))

        # a: its write is in flight for SLOW_S
        plan.delay_s = SLOW_S
        pair.C.add("a", prompts["a"], 3, params["a"])
        pair.run(lambda: (record(), plan.injected.get("delay", 0) == 1)[1], timeout=20.0)
        # b: its write fails at its post; wait until the decode engine learnt it
        plan.delay_s, plan.fail_rate = 0.0, 1.0
        pair.C.add("b", prompts["b"], 3, params["b"])
        pair.run(lambda: (record(), pair.C.status("b") != RequestStatus.WAITING_FOR_REMOTE_KVS
                          and plan.injected.get("fail", 0) == 1)[1], timeout=20.0)
        # c: asked for while a's write is still in flight on the connection b's failure retired
        plan.fail_rate = 0.0
        pair.C.add("c", prompts["c"], 3, params["c"])
        pair.run(lambda: (record(), not pair.C.scheduler.requests)[1], timeout=40.0)
        pair.drain()

        assert plan.injected == {"delay": 1, "fail": 1}, plan.injected

        def loaded(rid: str) -> bool:
            return pair.C.first_start.get(rid, 0) >= len(prompts[rid]) - 1 and checks.get(rid) == []

        if variant == "as_built":
            assert loaded("a"), f"a's write, in flight when b's failed, did not load: {checks.get('a')}"
            assert loaded("c"), f"c was not loaded over the re-made connection: {checks.get('c')}"
            assert pair.C.first_start.get("b") == 0 and checks.get("b") == [], "b was not recomputed"
        else:
            assert not loaded("a"), "the broken rule did not fail the sibling write: the test shows nothing"
        pair.assert_no_leak()
    finally:
        pair.close()
