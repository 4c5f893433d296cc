"""Lifecycle tests against real vLLM Schedulers (acceptance 2, issue points 2, 3, 5).

Invariants named: R1 (never scheduled before arrival), R3 (signals once, only for live
requests), R4 (no leak).
"""

import pytest

from kvtransport_vllm.consumer import RecvState
from harness import finish_reason, prompt_of, run_until
from vllm.v1.request import RequestStatus


def _status_trace(pair, rid):
    trace = []

    def cond():
        st = pair.C.status(rid)
        if not trace or trace[-1] != st:
            trace.append(st)
        return st is None

    return trace, cond


@pytest.mark.parametrize("mode", ["read", "write"])
def test_lifecycle_waiting_remote_running_finished_no_leak(pairs, mode):
    pair = pairs(mode)
    prompt = prompt_of(70)
    params = pair.prefill("p1", prompt)
    assert params["do_remote_prefill"] and params["kvtransport_mode"] == mode
    # R4 precondition: producer keeps its blocks (delayed free) until the consumer is done
    assert pair.P.free_blocks() < pair.P.free0
    held = pair.P.free_blocks()

    req = pair.C.add("c1", prompt, 3, params)
    trace, done = _status_trace(pair, "c1")
    trace.append(req.status)
    pair.C.step()
    trace.append(pair.C.status("c1"))
    # Uniform async load: WAITING_FOR_REMOTE_KVS in READ and WRITE alike.
    assert pair.C.status("c1") == RequestStatus.WAITING_FOR_REMOTE_KVS
    saw_running = []

    def until_running():
        st = pair.C.status("c1")
        if st == RequestStatus.RUNNING and not saw_running:
            saw_running.append(pair.C.check_kv("c1", prompt, len(prompt)))
        # producer frees only after the consumer is done with its blocks (LIFECYCLE.md
        # section 2): READ, once the read is DONE and "done" sent (the load is confirming or
        # over); WRITE, once the consumer has the producer's "written". (Not "after
        # done_recving": P frees on its "ok", which C may report one step later.)
        if pair.P.free_blocks() != held:
            r = pair.C.worker._worker.consumer.recv.get("c1")
            assert r is None or r.state is RecvState.CONFIRM or r.written is True, \
                f"producer freed its blocks while the consumer was still {r.state.value}"
        return done()

    pair.run(until_running)
    assert trace[:3] == [RequestStatus.WAITING, RequestStatus.WAITING_FOR_REMOTE_KVS, RequestStatus.RUNNING]
    assert saw_running == [[]], "loaded KV differs from the producer's in some block"
    assert finish_reason(pair.C, "c1") == "length"
    # R1: c1 was never in num_scheduled_tokens before it reached done_recving
    first_done = next(i for i, o in enumerate(pair.C.kv_outputs) if "c1" in (o.finished_recving or ()))
    assert all("c1" not in s for s in pair.C.scheduled_log[: first_done + 1])
    # R3: reported exactly once
    assert sum("c1" in (o.finished_recving or ()) for o in pair.C.kv_outputs) == 1
    pair.drain()
    assert sum("p1" in (o.finished_sending or ()) for o in pair.P.kv_outputs) == 1
    pair.assert_no_leak()


@pytest.mark.parametrize("mode", ["read", "write"])
def test_router_compound_ids_route_without_params_address(pairs, mode):
    """MoRIIO-router style: addresses come from the request id, not from kv_transfer_params."""
    pair = pairs(mode)
    uuid = "feedfacecafebeef0123456789abcdef"
    rid = (f"___prefill_addr_host:127.0.0.1,handshake:{pair.p_port},notify:1"
           f"___decode_addr_host:127.0.0.1,handshake:{pair.c_port},notify:2_{uuid}")
    prompt = prompt_of(40, seed=5)
    params = pair.prefill(f"cmpl-{rid}-0-aa", prompt)
    assert params["transfer_id"] == uuid
    # The consumer's params carry no address: only what the router would send.
    c_params = {"do_remote_prefill": True, "remote_block_ids": params["remote_block_ids"]}
    pair.C.add(f"cmpl-{rid}-0-bb", prompt, 2, c_params)
    pair.run(lambda: pair.C.status(f"cmpl-{rid}-0-bb") == RequestStatus.RUNNING)
    assert pair.C.check_kv(f"cmpl-{rid}-0-bb", prompt, len(prompt)) == []
    pair.drain()
    pair.assert_no_leak()


def test_write_mode_concurrent_router_flow_consumer_first(pairs):
    """WRITE with the router sending to both engines at once: the consumer's block ids
    reach the producer before its prefill is done; the producer queues them."""
    pair = pairs("write")
    uuid = "00000000000000000000000000000abc"
    rid = (f"___prefill_addr_host:127.0.0.1,handshake:{pair.p_port},notify:1"
           f"___decode_addr_host:127.0.0.1,handshake:{pair.c_port},notify:2_{uuid}")
    prompt = prompt_of(64, seed=9)
    pair.C.add("c-" + rid, prompt, 2, {"do_remote_prefill": True})
    for _ in range(5):
        pair.C.step()
    assert pair.C.status("c-" + rid) == RequestStatus.WAITING_FOR_REMOTE_KVS
    pair.P.add("p-" + rid, prompt, 1, {"do_remote_decode": True})
    pair.run(lambda: pair.C.status("c-" + rid) == RequestStatus.RUNNING)
    assert pair.C.check_kv("c-" + rid, prompt, len(prompt)) == []
    pair.drain()
    pair.assert_no_leak()


def test_short_prompt_is_synchronous_zero_and_frees_producer(pairs):
    """Prompt shorter than a block: (0, False), never an async load of 0 tokens; the
    producer's held blocks are released anyway (R4, R5)."""
    pair = pairs("read")
    prompt = prompt_of(10, seed=3)
    params = pair.prefill("p1", prompt)
    req = pair.C.add("c1", prompt, 2, params)
    assert pair.C.connector.get_num_new_matched_tokens(req, 0) == (0, False)
    pair.C.step()
    assert pair.C.status("c1") == RequestStatus.RUNNING
    pair.drain()
    assert not any("c1" in (o.finished_recving or ()) for o in pair.C.kv_outputs)
    pair.assert_no_leak()


def test_fully_computed_locally_is_synchronous_zero(pairs):
    pair = pairs("read")
    prompt = prompt_of(48, seed=4)
    params = pair.prefill("p1", prompt)
    req = pair.C.add("c1", prompt, 2, params)
    assert pair.C.connector.get_num_new_matched_tokens(req, 48) == (0, False)
    assert pair.C.connector.get_num_new_matched_tokens(req, 32) == (16, True)
    pair.drain()
    pair.assert_no_leak()


def test_local_prefix_hit_loads_only_the_tail(pairs):
    """A local prefix-cache hit on the consumer: only the blocks beyond it are read, into
    the right local blocks (remote block ids sliced past the local hit)."""
    pair = pairs("read")
    prompt = prompt_of(40, seed=6)
    pair.C.add("warm", prompt, 1, None)
    pair.run(lambda: pair.C.status("warm") is None)
    # wipe every block that is not a cached (hashed) prefix block, so a stale copy of the
    # tail left by "warm" cannot make the check pass
    for blk in pair.C.scheduler.kv_cache_manager.block_pool.blocks:
        if blk.block_hash is None:
            for t in pair.C.kv_caches.values():
                t[blk.block_id].zero_()
    params = pair.prefill("p1", prompt)
    pair.C.kv_outputs.clear()
    pair.C.add("c1", prompt, 2, params)
    pair.C.step()
    assert pair.C.status("c1") == RequestStatus.WAITING_FOR_REMOTE_KVS
    pair.run(lambda: pair.C.status("c1") == RequestStatus.RUNNING)
    assert pair.C.check_kv("c1", prompt, len(prompt)) == []
    moved = sum(o.kv_connector_stats.data["bytes"] for o in pair.C.kv_outputs if o.kv_connector_stats)
    assert moved == 1 * 2 * (2 * 16 * 128 * 4)  # one block, two layers
    pair.drain()
    pair.assert_no_leak()


@pytest.mark.parametrize("mode", ["read", "write"])
def test_a_prefill_that_generated_tokens_offers_its_prompt_blocks_only(pairs, mode):
    """A prefill run with max_tokens > 1 holds blocks past the prompt; a WRITE pairs blocks by
    the ends of both lists, so the producer must offer the prompt's blocks only (before: every
    written block shifted by two, with no error)."""
    pair = pairs(mode, policy="recompute", timeout_s=2.0, lease_s=4.0)
    prompt = prompt_of(40, seed=3)  # 3 blocks of 16
    pair.P.add("p1", prompt, 30, {"do_remote_decode": True})  # 40 + 30 tokens: 5 blocks
    run_until([pair.P], lambda: "p1" in pair.params, on_params=pair.params.update)
    params = pair.params["p1"]
    assert len(params["remote_block_ids"]) == 3 and params["remote_num_tokens"] == 40
    pair.C.add("c1", prompt, 3, params)
    assert pair.run_to_end_checking_kv("c1", prompt) == [[]]
    assert not [o.failed_recving for o in pair.C.kv_outputs if o.failed_recving]
    pair.drain(timeout=15)
    pair.assert_no_leak()


def test_several_requests_interleaved(pairs):
    pair = pairs("read")
    prompts = {f"r{i}": prompt_of(20 + 17 * i, seed=i) for i in range(5)}
    for rid, pr in prompts.items():
        pair.prefill("p" + rid, pr)
    for rid, pr in prompts.items():
        pair.C.add("c" + rid, pr, 2, pair.params["p" + rid])
    pair.run(lambda: all(pair.C.status("c" + r) in (RequestStatus.RUNNING, None) for r in prompts))
    for rid, pr in prompts.items():
        if pair.C.status("c" + rid) == RequestStatus.RUNNING:
            assert pair.C.check_kv("c" + rid, pr, len(pr)) == []
    pair.drain()
    pair.assert_no_leak()
    stats = [o.kv_connector_stats for o in pair.C.kv_outputs if o.kv_connector_stats]
    total = stats[0]
    for s in stats[1:]:
        total = total.aggregate(s)
    red = total.reduce()
    assert red["kv_loads_ok"] == 5 and red["kv_load_failures"] == 0
    assert red["kv_bytes"] == sum(-(-len(p) // 16) for p in prompts.values()) * 2 * 16 * 2 * 128 * 4
