"""kv_recompute_threshold: a decode engine computes a prompt locally when fewer tokens than
this could be loaded remotely, and the producer's hold ends at once (not at lease lapse).

Real vLLM Schedulers and connector workers (harness.Pair), READ and WRITE.
"""

import pytest

from harness import prompt_of
from kvtransport_vllm.config import ConnectorConfigError

#: far beyond every run's hang guard: a hold that ends inside the run was released, not lapsed
LONG_LEASE_S = 600.0


def _stat(engine, key: str) -> int:
    return sum(o.kv_connector_stats.data[key] for o in engine.kv_outputs if o.kv_connector_stats)


@pytest.mark.parametrize("mode", ["read", "write"])
def test_below_threshold_computes_locally_and_releases_producer(pairs, mode):
    pair = pairs(mode, lease_s=LONG_LEASE_S, c_extra={"kv_recompute_threshold": 64})
    prompt = prompt_of(50)  # 50 loadable tokens < 64
    params = pair.prefill("p1", prompt)
    assert pair.P.free_blocks() < pair.P.free0, "precondition: the producer holds the prefill's blocks"

    pair.C.add("c1", prompt, 3, params)
    checks = pair.run_to_end_checking_kv("c1", prompt)
    # finished normally, scheduled from token 0, its prompt KV the locally computed one
    pair.assert_recomputed("c1", prompt, checks)
    # the hold ends on the consumer's word, long before its lease could lapse
    pair.run(lambda: pair.P.free_blocks() == pair.P.free0, timeout=20.0)
    assert _stat(pair.P, "leases_expired") == 0
    pair.drain()
    pair.assert_no_leak()


@pytest.mark.parametrize("mode", ["read", "write"])
@pytest.mark.parametrize("n_prompt", [64, 100])
def test_at_or_above_threshold_loads(pairs, mode, n_prompt):
    pair = pairs(mode, lease_s=LONG_LEASE_S, c_extra={"kv_recompute_threshold": 64})
    prompt = prompt_of(n_prompt)
    params = pair.prefill("p1", prompt)
    pair.C.add("c1", prompt, 3, params)
    checks = pair.run_to_end_checking_kv("c1", prompt)
    assert checks == [[]], f"loaded KV differs from the prompt's in blocks {checks}"
    # loaded: the consumer computed only the prompt's last token, not the prompt
    assert pair.C.first_start.get("c1") == n_prompt - 1
    pair.run(lambda: pair.P.free_blocks() == pair.P.free0, timeout=20.0)
    assert _stat(pair.P, "leases_expired") == 0
    pair.drain()
    pair.assert_no_leak()


@pytest.mark.parametrize("mode", ["read", "write"])
def test_threshold_counts_tokens_beyond_the_local_prefix_hit(pairs, mode):
    """100 remote tokens, 64 of them already cached on the decode engine: 36 to load < 64."""
    pair = pairs(mode, lease_s=LONG_LEASE_S, c_extra={"kv_recompute_threshold": 64})
    prompt = prompt_of(100)
    pair.C.add("warm", prompt[:70], 1, None)  # caches the first 4 blocks (64 tokens) locally
    pair.run(lambda: pair.C.status("warm") is None)
    params = pair.prefill("p1", prompt)
    pair.C.add("c1", prompt, 3, params)
    checks = pair.run_to_end_checking_kv("c1", prompt)
    assert checks == [[]]
    assert pair.C.first_start.get("c1") == 64, "the rest of the prompt was not computed locally"
    pair.run(lambda: pair.P.free_blocks() == pair.P.free0, timeout=20.0)
    assert _stat(pair.P, "leases_expired") == 0
    pair.drain()
    pair.assert_no_leak()


@pytest.mark.parametrize("bad", [-1, "many", float("nan"), float("inf")])
def test_bad_threshold_refused_at_start_up(pairs, bad):
    with pytest.raises(ConnectorConfigError, match="kv_recompute_threshold must be"):
        pairs("read", c_extra={"kv_recompute_threshold": bad})
