"""Hostile or inconsistent ``kv_transfer_params`` on a consumer (real vLLM Schedulers and the
connector's workers, loopback transport): nothing escapes into vLLM's scheduler or the
worker, the request ends by the load failure policy (here: recompute), no block leaks, and
a load that cannot fill every announced block is refused instead of running on blocks
nobody wrote (which vLLM would also put in its prefix cache)."""

from __future__ import annotations

import pytest

from harness import finish_reason, prompt_of

HOSTILE = {
    "blocks_not_a_list": {"remote_block_ids": {"a": 1}},  # plain JSON
    "port_infinite": {"remote_port": float("inf")},  # Python's json accepts Infinity
    "tokens_infinite": {"remote_num_tokens": float("inf")},
    "tp_infinite": {"tp_size": float("inf")},
    "block_infinite": {"remote_block_ids": [float("inf")]},
    "port_negative": {"remote_port": -5},
    "port_huge": {"remote_port": 10**30},
    "tp_huge": {"tp_size": 10**30},
    "tp_beyond_sockets": {"tp_size": 2**16},
    "block_ids_negative": {"remote_block_ids": [-1, -2, -3, -4]},
    "block_ids_huge": {"remote_block_ids": [10**40] * 4},
    "host_with_nul": {"remote_host": "h\x00x"},
    "host_not_utf8": {"remote_host": "\ud800"},
    "key_not_utf8": {"transfer_id": "\ud800"},
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_params_end_the_request_by_policy_and_leak_nothing(pairs, name):
    pair = pairs("read", policy="recompute", timeout_s=1.0, lease_s=2.0)
    prompt = prompt_of(50, seed=4)
    params = dict(pair.prefill("p1", prompt))
    params.pop("transfer_id", None)
    params.update(HOSTILE[name])
    pair.C.add("c1", prompt, 2, params)
    pair.run(lambda: "c1" not in pair.C.scheduler.requests, timeout=15)
    assert finish_reason(pair.C, "c1") == "length"
    pair.drain(timeout=15)
    pair.assert_no_leak()


@pytest.mark.parametrize("router_drops_num_tokens", [False, True])
def test_a_short_block_list_is_refused_never_run_on_unwritten_blocks(pairs, router_drops_num_tokens):
    pair = pairs("read", policy="recompute", timeout_s=2.0, lease_s=4.0)
    prompt = prompt_of(70, seed=3)  # 5 blocks of 16
    params = dict(pair.prefill("p1", prompt))
    params["remote_block_ids"] = params["remote_block_ids"][:1]
    if router_drops_num_tokens:
        params.pop("remote_num_tokens")
    pair.C.add("c1", prompt, 3, params)
    assert pair.run_to_end_checking_kv("c1", prompt) == [[]], "c1 ran on KV that is not its prompt's"
    assert [o.failed_recving for o in pair.C.kv_outputs if o.failed_recving], "the load was not refused"
    # the same prompt again, locally: whatever vLLM cached for it holds this prompt's KV
    pair.C.add("c2", prompt, 3, None)
    assert pair.run_to_end_checking_kv("c2", prompt) == [[]], "c2 was served unwritten cached blocks"
    pair.drain(timeout=15)
    pair.assert_no_leak()


@pytest.mark.parametrize("params", ["do_remote_prefill", ["do_remote_prefill"], 7])
def test_params_that_are_not_a_mapping_mean_a_local_prefill(pairs, params):
    """Offline ``extra_args`` reach the connector unchecked by vLLM."""
    pair = pairs("read", policy="recompute", timeout_s=1.0, lease_s=2.0)
    prompt = prompt_of(50, seed=4)
    pair.C.add("c1", prompt, 2, None).kv_transfer_params = params  # as given, not made a dict
    assert pair.run_to_end_checking_kv("c1", prompt) == [[]]
    assert finish_reason(pair.C, "c1") == "length"
    pair.drain(timeout=15)
    pair.assert_no_leak()


def test_do_remote_prefill_sent_as_text_false_is_no_remote_load(pairs):
    pair = pairs("read", policy="recompute", timeout_s=1.0, lease_s=2.0)
    prompt = prompt_of(50, seed=4)
    params = dict(pair.prefill("p1", prompt), do_remote_prefill="false")
    pair.C.add("c1", prompt, 2, params)
    assert pair.run_to_end_checking_kv("c1", prompt) == [[]]
    assert not pair.C.first_start.get("c1"), "c1 loaded remote KV although do_remote_prefill was 'false'"
    assert not [o.failed_recving for o in pair.C.kv_outputs if o.failed_recving]
