"""Timing of the vLLM connector's lifecycle, with a real Scheduler pair (tests/vllm/harness).

The tests in tests/vllm and tests/reliability check only ordering facts (a silent load is
reported after its deadline and for that reason; a lease lapses after the lease the
producer last granted). How *late* after those deadlines things happen is a timing
target, measured here; the targets are the bounds the unit tests used to assert:

* a load whose transfer never completes is reported within 5 s of the worker's deadline;
* a lapsed producer lease frees the blocks within 3 s of its expiry, never before it.

Run: ``.venv/bin/python -m pytest bench/test_bench_vllm_lifecycle.py --benchmark-only -s``.
"""

from __future__ import annotations

import itertools
import os
import sys
import time

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "vllm"))

from harness import Pair, prompt_of  # noqa: E402

_ids = itertools.count(1)


@pytest.fixture(scope="module")
def read_pair():
    pair = Pair("read", timeout_s=1.0, lease_s=2.0, c_extra={"backend_options": {"faults": {"seed": 1}}})
    yield pair
    pair.close()


def _summary(name: str, values: list[float]) -> str:
    return (f"\n{name}: median {float(np.median(values)) * 1e3:.1f} ms, "
            f"worst {max(values) * 1e3:.1f} ms over {len(values)} rounds")


def test_silent_load_reported_after_deadline(benchmark, read_pair):
    """Consumer's READ never completes (injected hang): seconds from the worker's own
    deadline for the load to the end of the consumer step that reported it failed."""
    pair = read_pair
    cw = pair.C.worker._worker
    plan = cw.agent.faults.plan
    lateness: list[float] = []

    def once():
        n = next(_ids)
        prompt = prompt_of(50, seed=100 + n)
        params = pair.prefill(f"p{n}", prompt)
        plan.hang_rate = 1.0
        try:
            pair.C.add(f"c{n}", prompt, 2, params)
            deadline = None
            while True:
                r = cw.consumer.recv.get(f"c{n}")
                if r is not None:
                    deadline = r.deadline
                pair.C.step()
                ended = time.monotonic()
                pair.P.step()
                if any(f"c{n}" in (o.finished_recving or ()) for o in pair.C.kv_outputs[-1:]):
                    break
                time.sleep(0.002)
            lateness.append(ended - deadline)  # the reporting step ended this long after it
        finally:
            plan.hang_rate = 0.0
        pair.drain()

    benchmark.pedantic(once, rounds=5)
    print(_summary("silent load reported after its deadline", lateness))
    benchmark.extra_info["worst_lateness_s"] = max(lateness)
    assert min(lateness) >= 0 and max(lateness) < 5.0
    pair.assert_no_leak()


def test_lapsed_lease_frees_after_expiry(benchmark, read_pair):
    """A prefill whose consumer never comes: seconds from the hold's lease expiry to the
    end of the producer step that freed its blocks."""
    pair = read_pair
    pw = pair.P.worker._worker
    lateness: list[float] = []

    def once():
        n = next(_ids)
        params = pair.prefill(f"q{n}", prompt_of(50, seed=300 + n))
        key = params["transfer_id"]
        while key not in pw.producer.holds:
            pair.P.step()
        expiry = pw.producer.holds[key].expiry
        while key in pw.producer.holds:
            pair.P.step()
            ended = time.monotonic()
            time.sleep(0.002)
        lateness.append(ended - expiry)  # the freeing step ended this long after it
        assert pw.producer.ended.get(key) == "expired"

    benchmark.pedantic(once, rounds=5)
    print(_summary("lapsed lease freed after its expiry", lateness))
    benchmark.extra_info["worst_lateness_s"] = max(lateness)
    assert min(lateness) >= 0 and max(lateness) < 3.0
    pair.drain()
    pair.assert_no_leak()
