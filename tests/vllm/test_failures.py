"""Failure tests (acceptance 3): every remote load ends — done, or failed and then
recomputed / failed per policy — within its deadline, with no leaked block on either
side. Invariants: R2 (never stranded), R3 (signals once, live requests only), R4 (no
leak), R5 (aborts propagate), T2/T3 via the core, stale-read and stale-write hazards.
"""

import time

import pytest

import kvtransport_vllm.side_channel as sc
from harness import finish_reason, prompt_of
from kvtransport_vllm.consumer import RecvState
from kvtransport_vllm.messages import Done, Written
from kvtransport_vllm.producer import HoldState
from vllm.v1.request import RequestStatus

POLICIES = ["recompute", "fail"]


def _outcome(pair, rid, prompt, policy, started, deadline_s):
    """Run to the end and check the policy's outcome, the deadline and R4."""
    pair.run(lambda: pair.C.status(rid) is None, timeout=deadline_s + 10)
    elapsed = time.monotonic() - started
    reason = finish_reason(pair.C, rid)
    if policy == "recompute":
        assert reason == "length", f"expected a recomputed, normally finished request, got {reason}"
    else:
        assert reason == "error", f"expected FINISHED_ERROR under policy=fail, got {reason}"
    # R2: ended within the transfer deadline (plus scheduling slack, not a perf bound)
    assert elapsed < deadline_s + 5.0
    fails = sum(o.kv_connector_stats.data["failures"] for o in pair.C.kv_outputs if o.kv_connector_stats)
    assert fails >= 1
    pair.drain()
    pair.assert_no_leak()
    # R3: reported at most once
    assert sum(rid in (o.finished_recving or ()) for o in pair.C.kv_outputs) == 1


def _start(pair, prompt, max_tokens=3, params=None):
    params = params or pair.prefill("p1", prompt)
    t0 = time.monotonic()
    pair.C.add("c1", prompt, max_tokens, params)
    pair.C.step()
    assert "c1" not in pair.C.scheduled_log[-1]  # R1: async load, not scheduled
    assert pair.C.status("c1") in (RequestStatus.WAITING_FOR_REMOTE_KVS, None)  # None: failed at once (policy=fail)
    return t0


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("mode", ["read", "write"])
def test_transfer_failure(pairs, mode, policy):
    faults = {"backend_options": {"faults": {"fail_rate": 1.0, "seed": 1}}}
    pair = pairs(mode, policy=policy, **({"c_extra": faults} if mode == "read" else {"p_extra": faults}))
    prompt = prompt_of(50)
    t0 = _start(pair, prompt)
    _outcome(pair, "c1", prompt, policy, t0, 5.0)
    if policy == "recompute":
        pass  # recomputed locally: the stand-in model wrote correct KV itself


@pytest.mark.parametrize("mode", ["read", "write"])
def test_timeout_transfer_never_completes(pairs, mode):
    faults = {"backend_options": {"faults": {"hang_rate": 1.0, "seed": 1}}}
    pair = pairs(mode, policy="recompute", timeout_s=1.0, lease_s=2.0,
                 **({"c_extra": faults} if mode == "read" else {"p_extra": faults}))
    prompt = prompt_of(50)
    t0 = _start(pair, prompt)
    _outcome(pair, "c1", prompt, "recompute", t0, 1.0)


def _drop(monkeypatch, kind, limit=None):
    """Drop side-channel messages of ``kind`` (all, or the first ``limit``)."""
    real = sc.SideChannelClient.send
    dropped = []

    def send(self, msg):
        if isinstance(msg, kind) and (limit is None or len(dropped) < limit):
            dropped.append(msg)
            msg.cid = next(self._cids)
            return msg.cid
        return real(self, msg)

    monkeypatch.setattr(sc.SideChannelClient, "send", send)
    return dropped


@pytest.mark.parametrize("mode, kind", [("read", Done), ("write", Written)])
def test_dropped_notification_fails_by_deadline(pairs, monkeypatch, mode, kind):
    pair = pairs(mode, policy="recompute", timeout_s=1.0, lease_s=2.0)
    prompt = prompt_of(50)
    params = pair.prefill("p1", prompt)
    dropped = _drop(monkeypatch, kind)
    t0 = _start(pair, prompt, params=params)
    _outcome(pair, "c1", prompt, "recompute", t0, 1.0)
    assert dropped


@pytest.mark.parametrize("mode, kind", [("read", Done), ("write", Written)])
def test_one_dropped_notification_is_retransmitted(pairs, monkeypatch, mode, kind):
    pair = pairs(mode)
    prompt = prompt_of(50)
    params = pair.prefill("p1", prompt)
    dropped = _drop(monkeypatch, kind, limit=1)
    _start(pair, prompt, params=params)
    pair.run(lambda: pair.C.status("c1") == RequestStatus.RUNNING)
    assert dropped and pair.C.check_kv("c1", prompt, len(prompt)) == []
    assert not any(o.invalid_block_ids for o in pair.C.kv_outputs)
    pair.drain()
    pair.assert_no_leak()


@pytest.mark.parametrize("policy", POLICIES)
def test_expired_lease_late_read_refused_not_stale(pairs, policy):
    """Stale-read hazard (vllm#21570): the producer's lease lapses, it frees the blocks and
    reuses them for another request; the consumer's late READ gets those other bytes, but
    the confirmation answers "expired", so they are reported as load errors, never used."""
    pair = pairs("read", policy=policy, timeout_s=2.0, lease_s=3.0)
    prompt = prompt_of(50, seed=21)
    params = pair.prefill("p1", prompt)
    w = pair.P.worker._worker
    pair.P.step()  # the hold reaches the producer's worker with the next step's metadata
    assert len(w._holds) == 1
    with w._lock:
        for h in w._holds.values():
            h.expiry = 0.0  # lease lapsed (consumer made no progress)
    pair.P.step()
    assert pair.P.free_blocks() == pair.P.free0  # freed on lapse
    other = prompt_of(50, seed=22)
    pair.prefill("p2", other)  # reuses the freed blocks: different KV now
    assert set(pair.P.block_ids("p2")) & set(params["remote_block_ids"])
    t0 = _start(pair, prompt, params=params)
    pair.run(lambda: pair.C.status("c1") != RequestStatus.WAITING_FOR_REMOTE_KVS)
    assert any(o.invalid_block_ids for o in pair.C.kv_outputs), "stale bytes were accepted"
    if policy == "recompute":
        pair.run(lambda: pair.C.status("c1") == RequestStatus.RUNNING or pair.C.status("c1") is None)
        if pair.C.status("c1") == RequestStatus.RUNNING:
            pair.run(lambda: pair.C.scheduler.requests["c1"].num_computed_tokens >= len(prompt))
            assert pair.C.check_kv("c1", prompt, len(prompt)) == []
    _outcome(pair, "c1", prompt, policy, t0, 2.0)


@pytest.mark.parametrize("policy", POLICIES)
def test_producer_abort_tells_waiting_consumer(pairs, policy):
    """Router WRITE flow: the consumer waits for a push; the producer aborts the request
    during its prefill and tells the consumer, which ends it long before its deadline."""
    pair = pairs("write", policy=policy, timeout_s=30.0, lease_s=60.0)
    uuid = "abab0000000000000000000000000abc"
    rid = (f"___prefill_addr_host:127.0.0.1,handshake:{pair.p_port},notify:1"
           f"___decode_addr_host:127.0.0.1,handshake:{pair.c_port},notify:2_{uuid}")
    prompt = prompt_of(300, seed=2)
    crid = "c-" + rid
    t0 = time.monotonic()
    pair.C.add(crid, prompt, 2, {"do_remote_prefill": True})
    pair.C.step()
    assert pair.C.status(crid) == RequestStatus.WAITING_FOR_REMOTE_KVS
    pair.P.add("p-" + rid, prompt, 1, {"do_remote_decode": True})
    pair.P.step()  # chunked prefill: 256 of 300 tokens computed
    assert pair.P.status("p-" + rid) == RequestStatus.RUNNING
    pair.P.abort("p-" + rid)
    _outcome(pair, crid, prompt, policy, t0, 5.0)
    assert time.monotonic() - t0 < 15


@pytest.mark.parametrize("mode", ["read", "write"])
def test_consumer_abort_while_loading_frees_both_sides(pairs, mode):
    # completions reported 1 s late keep the load in flight while we abort
    faults = {"backend_options": {"faults": {"delay_s": 1.0, "seed": 1}}}
    pair = pairs(mode, **({"c_extra": faults} if mode == "read" else {"p_extra": faults}))
    prompt = prompt_of(50)
    params = pair.prefill("p1", prompt)
    _start(pair, prompt, params=params)
    for _ in range(3):
        pair.P.step()
        pair.C.step()
    assert pair.C.status("c1") == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert pair.P.free_blocks() < pair.P.free0
    pair.C.abort("c1")
    assert pair.C.free_blocks() < pair.C.free0  # vLLM waits for our finished_recving
    pair.drain(timeout=10)
    pair.assert_no_leak()  # R5: the producer freed too (release / cancel reached it)
    assert sum("c1" in (o.finished_recving or ()) for o in pair.C.kv_outputs) == 1


def test_consumer_abort_before_allocation_releases_producer(pairs):
    pair = pairs("read")
    prompt = prompt_of(50)
    params = pair.prefill("p1", prompt)
    pair.C.add("c1", prompt, 2, params)
    pair.C.abort("c1")  # never scheduled: no block on C, producer must still free
    pair.drain()
    pair.assert_no_leak()


def test_late_and_duplicate_signals_are_dropped(pairs):
    """R3: after completion, a duplicate "written" / "done" must not reach vLLM (whose
    scheduler asserts on unknown ids: vllm#48615)."""
    pair = pairs("read")
    prompt = prompt_of(50)
    params = pair.prefill("p1", prompt)
    pair.C.add("c1", prompt, 2, params)
    pair.drain()
    # an authentic peer (holds the cluster secret) replaying stale signals
    to_c = sc.SideChannelClient("127.0.0.1", pair.c_port, auth=pair.C.worker._worker.cfg.make_authenticator())
    to_p = sc.SideChannelClient("127.0.0.1", pair.p_port, auth=pair.P.worker._worker.cfg.make_authenticator())
    try:
        to_c.send(Written(key=params["transfer_id"], ok=True))
        to_p.send(Done(keys=[params["transfer_id"]]))
        replies = []
        deadline = time.monotonic() + 5
        while len(replies) < 2 and time.monotonic() < deadline:
            replies += to_c.poll() + to_p.poll()
            time.sleep(0.01)
        statuses = sorted(r.status[params["transfer_id"]] for r in replies)
        assert statuses == ["ok", "unknown"]  # P: already done (idempotent); C: unknown, dropped
        n_before = (len(pair.C.kv_outputs), len(pair.P.kv_outputs))
        for _ in range(5):
            pair.C.step()
            pair.P.step()
        new = pair.C.kv_outputs[n_before[0]:] + pair.P.kv_outputs[n_before[1]:]
        assert not any(o.finished_recving or o.finished_sending for o in new)
    finally:
        to_c.close()
        to_p.close()
    pair.assert_no_leak()


def test_layout_mismatch_is_a_clear_error_and_recomputes(pairs, caplog):
    pair = pairs("read", c_block_size=32, timeout_s=2.0, lease_s=3.0)
    prompt = prompt_of(64)
    params = pair.prefill("p1", prompt)
    pair.C.add("c1", prompt, 2, params)
    pair.run(lambda: pair.C.status("c1") is None)
    assert finish_reason(pair.C, "c1") == "length"  # recomputed
    assert any("block_size" in r.getMessage() and "mismatch" in r.getMessage() for r in caplog.records)
    pair.drain()
    pair.assert_no_leak()


def test_producer_restarted_same_address(pairs):
    """A producer killed and restarted on the same side-channel port: the consumer
    hand-shakes again (new engine id in the params) and loads from the new one."""
    from harness import Engine

    pair = pairs("read")
    prompt = prompt_of(50)
    params = pair.prefill("p1", prompt)
    pair.C.add("c1", prompt, 2, params)
    pair.drain()
    extra = dict(pair.P.vllm_config.kv_transfer_config.kv_connector_extra_config)
    pair.P.close()
    pair.P = Engine("kv_producer", extra, engine_id="P2")
    pair.params.clear()
    params2 = pair.prefill("p2", prompt_of(60, seed=8))
    pair.C.add("c2", prompt_of(60, seed=8), 2, params2)
    pair.run(lambda: pair.C.status("c2") == RequestStatus.RUNNING)
    assert pair.C.check_kv("c2", prompt_of(60, seed=8), 60) == []
    assert not any(o.invalid_block_ids for o in pair.C.kv_outputs)
    pair.drain()
    pair.assert_no_leak()


def test_stale_write_hazard_consumer_keeps_blocks_until_producer_acks_cancel(pairs):
    """WRITE, lifecycle 3.3: the consumer gives up (deadline) while the producer's write
    is still in flight; it must keep its blocks aside until the producer acknowledges
    the cancel (no write can land any more), only then report the load error."""
    # the producer's write completes 2.5 s late; its own deadline (5 s) is longer than the
    # consumer's (1 s), so the consumer gives up first
    faults = {"backend_options": {"faults": {"delay_s": 2.5, "seed": 1}}, "transfer_timeout_s": 5.0}
    pair = pairs("write", policy="recompute", timeout_s=1.0, lease_s=5.0, p_extra=faults)
    prompt = prompt_of(50)
    params = pair.prefill("p1", prompt)
    t0 = _start(pair, prompt, params=params)
    w = pair.P.worker._worker
    pair.run(lambda: any(h.state is HoldState.POSTED for h in w._holds.values()))
    pair.run(lambda: time.monotonic() - t0 > 1.5)  # past the consumer's deadline
    assert pair.C.status("c1") == RequestStatus.WAITING_FOR_REMOTE_KVS  # blocks kept aside
    assert pair.C.worker._worker._recv["c1"].state is RecvState.CANCEL
    assert any(h.state is HoldState.POSTED for h in w._holds.values())  # write still in flight
    pair.run(lambda: pair.C.status("c1") != RequestStatus.WAITING_FOR_REMOTE_KVS)
    assert not w._holds  # producer's write ended before the consumer let go
    _outcome(pair, "c1", prompt, "recompute", t0, 4.0)


def test_producer_abort_before_consumer_asks(pairs):
    """Router WRITE flow, other order: the producer aborts before the consumer's request
    even arrives; the consumer's "write into" is answered "expired" and it ends early."""
    pair = pairs("write", policy="recompute", timeout_s=30.0, lease_s=60.0)
    uuid = "cdcd0000000000000000000000000abc"
    rid = (f"___prefill_addr_host:127.0.0.1,handshake:{pair.p_port},notify:1"
           f"___decode_addr_host:127.0.0.1,handshake:{pair.c_port},notify:2_{uuid}")
    prompt = prompt_of(300, seed=3)
    pair.P.add("p-" + rid, prompt, 1, {"do_remote_decode": True})
    pair.P.step()
    pair.P.abort("p-" + rid)
    pair.P.step()  # the abort notice goes out
    t0 = time.monotonic()
    pair.C.add("c-" + rid, prompt, 2, {"do_remote_prefill": True})
    _outcome(pair, "c-" + rid, prompt, "recompute", t0, 5.0)
