"""Lease renewal (lifecycle 2.5), with a real vLLM Scheduler pair in READ mode.

While the consumer still intends to read X — queued in its scheduler, hand-shaking, or
reading — its progress renews the producer's lease on X, so a slow but live consumer
never loses X. A consumer that stops making progress (no engine steps) lets the lease
lapse: the producer frees X (``done_sending``) and the consumer's late confirmation is
answered "expired", so the bytes it read are never used. No block leaks on either side.

Timing: every scenario is built so that the time from the producer's hold to the
consumer's confirmation is clearly *longer* than ``lease_s`` (so without renewal the
lease would lapse — the ``renew dropped`` controls prove it does) while each transfer
stays clearly *inside* ``transfer_timeout_s``. The assertions compare events with the
producer worker's own lease expiry (the hold's ``expiry``), never with a wall-clock
margin chosen here.
"""

from __future__ import annotations

import time

import pytest

import kvtransport_vllm.side_channel as sc
from harness import finish_reason, prompt_of
from kvtransport_vllm.consumer import RecvState
from kvtransport_vllm.messages import Done, Hello, Renew
from vllm.v1.request import RequestStatus

#: long enough that a stall of a second or two of this (single) test process on a loaded
#: host leaves each load inside its deadline
TIMEOUT_S = 4.0
LEASE_S = 4.0  # == transfer_timeout_s: the smallest lease the connector accepts


def _drop_sends(monkeypatch, pred):
    """Drop side-channel messages for which ``pred(msg)`` is true (the wire loses them)."""
    real = sc.SideChannelClient.send
    dropped = []

    def send(self, msg):
        if pred(msg):
            dropped.append(type(msg).__name__)
            msg.cid = next(self._cids)
            return msg.cid
        return real(self, msg)

    monkeypatch.setattr(sc.SideChannelClient, "send", send)
    return dropped


def _producer_worker(pair):
    return pair.P.worker._worker


def _hold_of(pair, rid: str):
    w = _producer_worker(pair)
    with w.ctx.lock:
        return next((h for h in w.producer.holds.values() if h.req_id == rid), None)


def _hold_started(pair, rid: str) -> float:
    """Step the producer until its worker holds ``rid``'s blocks; returns the hold's
    original lease expiry (the producer's own clock)."""
    pair.run(lambda: _hold_of(pair, rid) is not None)
    return _hold_of(pair, rid).expiry


def _idle(pair, engines, seconds: float) -> None:
    """Keep stepping ``engines`` (only) for ``seconds``."""
    t_end = time.monotonic() + seconds
    while time.monotonic() < t_end:
        for e in engines:
            pair.params.update(e.step())
        time.sleep(0.005)


def _stat(engine, key: str) -> int:
    return sum(o.kv_connector_stats.data[key] for o in engine.kv_outputs if o.kv_connector_stats)


def _times_sent(engine, rid: str) -> int:
    return sum(rid in (o.finished_sending or ()) for o in engine.kv_outputs)


def _run_slow_read(pair, rid_p: str, rid_c: str, prompt, gap_s: float, watch_lease: bool = True):
    """Prefill on P, let ``gap_s`` pass (consumer not yet asked: proxy latency), then load
    on C. Returns (expiry, t_running, held_past_lease): the hold's original lease expiry,
    when C's request left the waiting states, and whether the producer still held the
    blocks at a moment later than that original expiry while C was loading."""
    params = pair.prefill(rid_p, prompt)
    expiry = _hold_started(pair, rid_p)
    _idle(pair, [pair.P], gap_s)
    pair.C.add(rid_c, prompt, 3, params)
    w = _producer_worker(pair)
    held_past_lease = False

    def cond():
        nonlocal held_past_lease
        if watch_lease and time.monotonic() > expiry:
            held_past_lease |= any(h.req_id == rid_p for h in w.producer.holds.values())
        return pair.C.status(rid_c) != RequestStatus.WAITING_FOR_REMOTE_KVS and pair.C.status(rid_c) is not None \
            and pair.C.status(rid_c) != RequestStatus.WAITING

    pair.run(cond, timeout=TIMEOUT_S + LEASE_S + 20)  # a hang guard, not a timing bound
    return expiry, time.monotonic(), held_past_lease


def _assert_loaded_ok(pair, rid_p, rid_c, prompt):
    """The load completed from the producer's bytes: no load error, right KV, P freed once."""
    assert not any(o.invalid_block_ids for o in pair.C.kv_outputs), "load reported as failed"
    assert pair.C.status(rid_c) == RequestStatus.RUNNING
    assert pair.C.check_kv(rid_c, prompt, len(prompt) - 1) == [], "consumer KV differs from the producer's"
    assert _stat(pair.P, "leases_expired") == 0
    assert _stat(pair.C, "loads_ok") == 1
    pair.drain()
    assert _times_sent(pair.P, rid_p) == 1
    assert finish_reason(pair.C, rid_c) == "length"
    pair.assert_no_leak()


# ------------------------------------------------------------------ slow but progressing


def test_slow_read_keeps_its_lease(pairs):
    """The READ completes (delayed by the backend) after the producer's original lease
    expiry; the consumer's progress renewed it, so the confirmation is "ok"."""
    gap, delay = 2.2, 2.5  # gap + delay > LEASE_S, delay well under TIMEOUT_S
    pair = pairs("read", timeout_s=TIMEOUT_S, lease_s=LEASE_S,
                 c_extra={"backend_options": {"faults": {"delay_s": delay, "seed": 3}}})
    prompt = prompt_of(50, seed=41)
    expiry, t_done, held = _run_slow_read(pair, "p1", "c1", prompt, gap)
    assert t_done > expiry, "scenario too fast to prove renewal: loaded before the original lease expiry"
    assert held, "producer dropped the hold at its original expiry despite consumer progress"
    _assert_loaded_ok(pair, "p1", "c1", prompt)


def test_slow_read_without_renewal_loses_its_lease(pairs, monkeypatch):
    """Control for the test above (so it can fail): the same timing with every Renew lost
    on the wire — the lease lapses, P frees, and C's confirmation gets "expired": load
    error, recomputed, nothing stale used, no leak."""
    gap, delay = 2.2, 2.5
    pair = pairs("read", timeout_s=TIMEOUT_S, lease_s=LEASE_S, policy="recompute",
                 c_extra={"backend_options": {"faults": {"delay_s": delay, "seed": 3}}})
    dropped = _drop_sends(monkeypatch, lambda m: isinstance(m, Renew))
    prompt = prompt_of(50, seed=42)
    _run_slow_read(pair, "p1", "c1", prompt, gap, watch_lease=False)
    assert "Renew" in dropped
    assert any(o.invalid_block_ids for o in pair.C.kv_outputs), "expired lease not reported as a load error"
    assert _stat(pair.P, "leases_expired") == 1
    pair.assert_recomputed("c1", prompt, pair.run_to_end_checking_kv("c1", prompt))
    pair.drain()
    assert _times_sent(pair.P, "p1") == 1
    pair.assert_no_leak()


def test_slow_handshake_keeps_its_lease(pairs, monkeypatch):
    """The first hand-shake is slow (the first Hellos are lost and retransmitted) while the
    lease would lapse: Renew is sent from the connect state, the load then succeeds."""
    pair = pairs("read", timeout_s=TIMEOUT_S, lease_s=LEASE_S)
    prompt = prompt_of(50, seed=43)
    params = pair.prefill("p1", prompt)
    expiry = _hold_started(pair, "p1")
    _idle(pair, [pair.P], 3.0)
    # Hellos are retransmitted every second: the ones at +0 s and +1 s are lost, the one at
    # +2 s gets through; the hand-shake ends ~5 s after the hold (> LEASE_S) and ~2 s after
    # the load began (< TIMEOUT_S).
    lose_until = time.monotonic() + 1.5
    dropped = _drop_sends(monkeypatch, lambda m: isinstance(m, Hello) and time.monotonic() < lose_until)
    pair.C.add("c1", prompt, 3, params)
    w = _producer_worker(pair)
    held = False

    def cond():
        nonlocal held
        if time.monotonic() > expiry:
            held |= any(h.req_id == "p1" for h in w.producer.holds.values())
        return pair.C.status("c1") not in (RequestStatus.WAITING_FOR_REMOTE_KVS, RequestStatus.WAITING, None)

    pair.run(cond, timeout=TIMEOUT_S + LEASE_S + 20)  # a hang guard, not a timing bound
    assert "Hello" in dropped
    assert held
    _assert_loaded_ok(pair, "p1", "c1", prompt)


def _occupy(engine, n: int):
    """Take ``n`` blocks from the consumer's real block pool (memory pressure from other
    requests), so a new request cannot be allocated and stays queued."""
    pool = engine.scheduler.kv_cache_manager.block_pool
    return pool.get_new_blocks(n)


@pytest.mark.parametrize("renew", [True, False], ids=["renewed", "renew-dropped"])
def test_queued_request_renews_lease(pairs, monkeypatch, renew):
    """The consumer request is queued (no free blocks) while the lease would lapse: its
    scheduler keeps renewing X until it is allocated; then the load succeeds. Control:
    with Renew lost on the wire the lease lapses and the load is refused, not stale."""
    pair = pairs("read", timeout_s=TIMEOUT_S, lease_s=LEASE_S, policy="recompute")
    if not renew:
        _drop_sends(monkeypatch, lambda m: isinstance(m, Renew))
    prompt = prompt_of(50, seed=44)
    params = pair.prefill("p1", prompt)
    expiry = _hold_started(pair, "p1")
    pool = pair.C.scheduler.kv_cache_manager.block_pool
    taken = _occupy(pair.C, pool.get_num_free_blocks() - 2)  # 50 tokens need 4 blocks
    try:
        pair.C.add("c1", prompt, 3, params)
        # Keep both engines stepping until a producer step that began after the original
        # lease expiry has run: without renewal, that step has ended the hold.
        step_started = time.monotonic()
        while step_started <= expiry:
            step_started = time.monotonic()
            pair.P.step()
            pair.C.step()
            assert pair.C.status("c1") == RequestStatus.WAITING  # queued, not loading
            time.sleep(0.005)
        held = any(h.req_id == "p1" for h in _producer_worker(pair).producer.holds.values())
    finally:
        pool.free_blocks(taken)
    pair.run(lambda: pair.C.status("c1") not in (RequestStatus.WAITING_FOR_REMOTE_KVS, RequestStatus.WAITING))
    if renew:
        assert held, "the lease of a queued request lapsed although its engine kept stepping"
        _assert_loaded_ok(pair, "p1", "c1", prompt)
    else:
        assert not held
        assert _stat(pair.P, "leases_expired") == 1
        pair.assert_recomputed("c1", prompt, pair.run_to_end_checking_kv("c1", prompt))
        pair.drain()
        pair.assert_no_leak()


# ------------------------------------------------------------------ consumer stops progressing


def test_stalled_consumer_lets_lease_lapse(pairs, monkeypatch):
    """C starts the READ, then its process stalls: no engine step, no renewal, and nothing
    its read-confirmer thread sends gets out (the two engines share this process, so the
    stall is modelled by dropping C's confirmations until it resumes). P's lease lapses on
    time, P frees (done_sending once). When C resumes, its load has also passed its own
    deadline (``lease_s >= transfer_timeout_s`` means a lease renewed at the load's start
    cannot lapse before the load's deadline; the confirm-after-lapse path is the ``renew
    dropped`` control above): load error, recompute, the bytes read are never used, no
    leak either side."""
    stalled = [False]
    dropped = _drop_sends(monkeypatch, lambda m: stalled[0] and isinstance(m, Done))
    pair = pairs("read", timeout_s=TIMEOUT_S, lease_s=LEASE_S, policy="recompute",
                 c_extra={"backend_options": {"faults": {"delay_s": 0.5, "seed": 5}}})
    prompt = prompt_of(50, seed=45)
    params = pair.prefill("p1", prompt)
    _hold_started(pair, "p1")
    pair.C.add("c1", prompt, 3, params)
    cw = pair.C.worker._worker
    stalled[0] = True  # from before the READ is posted: its end may come at once
    pair.run(lambda: any(r.state is RecvState.READ for r in cw.consumer.recv.values()))  # READ posted
    # C is stalled: only P steps, past the lease
    pw = _producer_worker(pair)
    key = params["transfer_id"]
    guard = time.monotonic() + TIMEOUT_S + LEASE_S + 20  # a hang guard, not a timing bound
    last_expiry = None
    while (h := _hold_of(pair, "p1")) is not None:
        assert time.monotonic() < guard, "lease never lapsed"
        last_expiry = h.expiry  # the lease as last renewed (C no longer renews)
        pair.P.step()
        time.sleep(0.005)
    freed_by = time.monotonic()
    # The producer freed because the lease it last granted ran out, not earlier and not
    # for another reason.
    assert pw.producer.ended.get(key) == "expired", pw.producer.ended.get(key)
    assert freed_by >= last_expiry, "producer freed before the lease ran out"
    pair.P.step()
    assert _times_sent(pair.P, "p1") == 1
    assert _stat(pair.P, "leases_expired") == 1
    assert pair.P.free_blocks() == pair.P.free0, "producer did not free on lapse"
    assert "Done" in dropped, "the READ's end was never confirmed while C was stalled"
    stalled[0] = False
    # C resumes: the READ completed long ago, but the confirmation is refused
    pair.run(lambda: pair.C.status("c1") != RequestStatus.WAITING_FOR_REMOTE_KVS)
    assert any(o.invalid_block_ids for o in pair.C.kv_outputs), "bytes accepted after the lease lapsed"
    assert _stat(pair.C, "loads_ok") == 0
    pair.assert_recomputed("c1", prompt, pair.run_to_end_checking_kv("c1", prompt))
    pair.drain()
    assert _times_sent(pair.P, "p1") == 1
    pair.assert_no_leak()
