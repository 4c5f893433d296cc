"""A producer restarted at the same address with the same engine id (new process, new
memory, no memory of past hand-shakes): the consumer's next loads must succeed, in both
modes (docs/LIFECYCLE.md section 5, "peer restarted with the same address")."""

import pytest

from harness import Engine, Pair, finish_reason, prompt_of

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("mode", ["read", "write"])
def test_loads_succeed_after_producer_restart_same_address(mode):
    pair = Pair(mode, timeout_s=2.0, lease_s=4.0)
    try:
        prompt = prompt_of(40, seed=3)
        params = pair.prefill("p1", prompt)
        pair.C.add("c1", prompt, 2, params)
        pair.run(lambda: any("c1" in (o.finished_recving or ()) for o in pair.C.kv_outputs), timeout=15)
        assert pair.C.check_kv("c1", prompt, len(prompt)) == []
        pair.drain()
        # restart: same port, same engine id, new agent and memory, no hand-shake history
        extra = dict(pair.P.vllm_config.kv_transfer_config.kv_connector_extra_config)
        pair.P.close()
        pair.P = Engine("kv_producer", extra, engine_id="P")
        pair.params.clear()
        for i in range(3):
            prompt = prompt_of(40 + i, seed=10 + i)
            params = pair.prefill(f"p{i + 2}", prompt)
            rid = f"c{i + 2}"
            pair.C.add(rid, prompt, 2, params)
            pair.run(lambda: any(rid in (o.finished_recving or ()) for o in pair.C.kv_outputs), timeout=15)
            loaded = not any(o.invalid_block_ids for o in pair.C.kv_outputs[-3:]) and \
                pair.C.check_kv(rid, prompt, len(prompt)) == []
            if i == 2:  # the first one after the restart may fail (stale connection); later ones must not
                assert loaded, f"{mode}: loads still fail after the producer restarted"
            pair.run(lambda: pair.C.status(rid) is None, timeout=15)
            assert finish_reason(pair.C, rid) == "length"
        pair.drain()
        pair.assert_no_leak()
    finally:
        pair.close()
