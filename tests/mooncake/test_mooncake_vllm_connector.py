"""The vLLM connector (real vLLM Schedulers and the kvtransport connector on both sides, as
``tests/vllm`` builds them, no API server) with ``backend: mooncake``, READ and WRITE: the
consumer's request waits for its KV, reaches RUNNING with KV byte-identical to the producer's,
finishes, and neither side leaks a block."""

from __future__ import annotations

import os
import sys

import pytest

from kvtransport.testing.required import skip_unless_usable

VLLM_TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "vllm")


@pytest.fixture
def harness():
    skip_unless_usable("mooncake")
    pytest.importorskip("vllm")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("KVTRANSPORT_SECRET", "kvtransport-test-cluster-secret")
    if VLLM_TESTS not in sys.path:
        sys.path.insert(0, VLLM_TESTS)
    import harness as h

    return h


@pytest.mark.parametrize("mode", ["read", "write"])
def test_connector_loads_kv_byte_exact_over_mooncake(harness, mode):
    from vllm.v1.request import RequestStatus

    extra = {"backend": "mooncake"}
    pair = harness.Pair(mode, p_extra=extra, c_extra=extra)
    try:
        prompt = harness.prompt_of(70, seed=3)
        params = pair.prefill("mp1", prompt)
        assert params["do_remote_prefill"] and params["kvtransport_mode"] == mode
        pair.C.add("mc1", prompt, 3, params)
        pair.C.step()
        assert pair.C.status("mc1") == RequestStatus.WAITING_FOR_REMOTE_KVS
        checks = pair.run_to_end_checking_kv("mc1", prompt, timeout=60)
        assert checks == [[]], "loaded KV differs from the producer's in some block"
        assert harness.finish_reason(pair.C, "mc1") == "length"
        assert sum("mc1" in (o.finished_recving or ()) for o in pair.C.kv_outputs) == 1
        pair.drain()
        pair.assert_no_leak()
    finally:
        pair.close()
