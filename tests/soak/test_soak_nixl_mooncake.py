"""The soak's short mode with ``backend: nixl`` and ``backend: mooncake`` (as
``test_soak.py`` runs ``ucx``): 150 requests per mode through a real vLLM Scheduler pair
under injected core and side-channel faults, the soak's invariants (I1..I6) checked after
every step; zero violations, no leak. Mooncake also with its producer killed and restarted."""

from __future__ import annotations

import os
import sys

import pytest

from kvtransport.testing.required import skip_unless_usable

SOAK_TESTS = os.path.dirname(os.path.abspath(__file__))

pytestmark = pytest.mark.timeout(1800)


@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
@pytest.mark.parametrize("mode", ["read", "write"])
def test_soak_short_over(backend, mode):
    skip_unless_usable(backend)
    pytest.importorskip("vllm")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("KVTRANSPORT_SECRET", "kvtransport-test-cluster-secret")
    if SOAK_TESTS not in sys.path:
        sys.path.insert(0, SOAK_TESTS)
    from soak_harness import Soak, SoakConfig

    res = Soak(SoakConfig(mode=mode, requests=150, seed=301, backend=backend)).run()
    s = res.summary()
    print(f"\nSOAK-{backend.upper()} {s}")
    assert not res.violations, f"{len(res.violations)} invariant violations, first: " + "\n".join(res.violations[:10])
    assert all(v == 0 for v in res.leaks.values()), f"leaks at the end: {res.leaks}"
    assert sum(s["outcomes"].values()) == 150
    assert res.faults.get("core_fail") and res.faults.get("sc_drop"), f"faults not injected: {res.faults}"
    assert res.loads_ok > 75, f"too few loads succeeded: {res.loads_ok}"
    assert res.blocks_verified > 0


@pytest.mark.parametrize("mode", ["read", "write"])
def test_soak_producer_killed_and_restarted_over_mooncake(mode):
    """The producer runs in a child that is SIGKILLed twice and restarted on the same side-
    channel port (its Mooncake engine gets new ports): loads in flight fail, none violates
    an invariant, nothing leaks."""
    skip_unless_usable("mooncake")
    pytest.importorskip("vllm")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("KVTRANSPORT_SECRET", "kvtransport-test-cluster-secret")
    if SOAK_TESTS not in sys.path:
        sys.path.insert(0, SOAK_TESTS)
    from soak_harness import Soak, SoakConfig

    cfg = SoakConfig(mode=mode, requests=150, seed=401, backend="mooncake", child_producer=True,
                     kill_at=(0.3, 0.6), p_abort_rate=0.04, late_forward_rate=0.04, never_forward_rate=0.03)
    res = Soak(cfg).run()
    s = res.summary()
    print(f"\nSOAK-MOONCAKE-KILL {s}")
    assert not res.violations, f"{len(res.violations)} invariant violations, first: " + "\n".join(res.violations[:10])
    assert all(v == 0 for v in res.leaks.values()), f"leaks at the end: {res.leaks}"
    # how many loads fail depends on how long each restart takes; every process must serve
    res.assert_every_producer_served()
    assert res.producer_kills == 2
    assert res.blocks_verified > 0
