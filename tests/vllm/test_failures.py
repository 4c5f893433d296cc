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


class _Load:
    """What the consumer's worker did with one load: its own deadline for it, and the
    round of steps in which the load was reported ended (monotonic start and end)."""

    def __init__(self, pair, rid: str) -> None:
        self.pair, self.rid = pair, rid
        self.deadline: float | None = None
        self.reported_in: tuple[float, float] | None = None
        self._n = 0
        self._step_started = time.monotonic()

    def watch(self) -> None:
        """Call after each round of steps: note the deadline and the reporting round."""
        now = time.monotonic()
        r = self.pair.C.worker._worker.consumer.recv.get(self.rid)
        if r is not None and self.deadline is None:
            self.deadline = r.deadline
        outs = self.pair.C.kv_outputs
        if self.reported_in is None and any(self.rid in (o.finished_recving or ()) for o in outs[self._n:]):
            self.reported_in = (self._step_started, now)
        self._n = len(outs)
        self._step_started = time.monotonic()

    def run(self, cond, timeout: float = 30.0) -> None:
        self._step_started = time.monotonic()

        def watched():
            self.watch()
            return cond()

        self.pair.run(watched, timeout=timeout)


def _failed_because(caplog, rid: str) -> str:
    """The reason the worker logged for the failed load of ``rid`` (what an operator reads)."""
    msgs = [r.getMessage() for r in caplog.records if f"load of request {rid} " in r.getMessage()]
    assert len(msgs) == 1, f"expected one failure report for {rid}, got {msgs}"
    return msgs[0].split(" failed: ", 1)[1]


def _outcome(pair, rid, prompt, policy, load, caplog, because, by_deadline=None):
    """Run to the end and check the policy's outcome, why the load ended, R2 and R4.

    ``because``: a phrase (or phrases, any one) the logged failure reason must contain.
    ``by_deadline``: True when only the deadline could end the load (the steps that
    reported it ended after its deadline: it was still pending when the deadline came),
    False when something else ended it first (those steps began before its deadline),
    None when either may win."""
    kv_checks = pair.run_to_end_checking_kv(rid, prompt, on_step=load.watch)
    reason = finish_reason(pair.C, rid)
    if policy == "recompute":
        pair.assert_recomputed(rid, prompt, kv_checks)
    else:
        assert reason == "error", f"expected FINISHED_ERROR under policy=fail, got {reason}"
        assert rid not in pair.C.first_start, "a request failed under policy=fail was scheduled"
    # R2: the load ended, for the expected reason, on the right side of its deadline
    assert load.reported_in is not None, "the load was never reported ended"
    why = _failed_because(caplog, rid)
    because = (because,) if isinstance(because, str) else because
    assert any(b in why for b in because), f"load failed for {why!r}, expected one of {because!r}"
    if by_deadline is not None and load.deadline is None:
        assert not by_deadline, "ended before the worker took the load: no deadline to have passed"
    elif by_deadline:
        assert load.reported_in[1] >= load.deadline, f"load reported before its deadline ({why})"
    elif by_deadline is False:
        assert load.reported_in[0] < load.deadline, f"load reported only after its deadline ({why})"
    fails = sum(o.kv_connector_stats.data["failures"] for o in pair.C.kv_outputs if o.kv_connector_stats)
    assert fails >= 1
    pair.drain()
    pair.assert_no_leak()
    # R3: reported at most once
    assert sum(rid in (o.finished_recving or ()) for o in pair.C.kv_outputs) == 1


def _start(pair, prompt, max_tokens=3, params=None, rid="c1"):
    params = params or pair.prefill("p1", prompt)
    load = _Load(pair, rid)
    pair.C.add(rid, prompt, max_tokens, params)
    pair.C.step()
    load.watch()
    assert rid not in pair.C.scheduled_log[-1]  # R1: async load, not scheduled
    assert pair.C.status(rid) in (RequestStatus.WAITING_FOR_REMOTE_KVS, None)  # None: failed at once (policy=fail)
    return load


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("mode", ["read", "write"])
def test_transfer_failure(pairs, caplog, mode, policy):
    faults = {"backend_options": {"faults": {"fail_rate": 1.0, "seed": 1}}}
    pair = pairs(mode, policy=policy, **({"c_extra": faults} if mode == "read" else {"p_extra": faults}))
    prompt = prompt_of(50)
    load = _start(pair, prompt)
    # the injected failure ends the load, long before its deadline could
    _outcome(pair, "c1", prompt, policy, load, caplog, "injected failure", by_deadline=False)


@pytest.mark.parametrize("mode", ["read", "write"])
def test_timeout_transfer_never_completes(pairs, caplog, mode):
    faults = {"backend_options": {"faults": {"hang_rate": 1.0, "seed": 1}}}
    pair = pairs(mode, policy="recompute", timeout_s=1.0, lease_s=2.0,
                 **({"c_extra": faults} if mode == "read" else {"p_extra": faults}))
    prompt = prompt_of(50)
    load = _start(pair, prompt)
    # only the deadline can end a transfer that never completes
    _outcome(pair, "c1", prompt, "recompute", load, caplog, "deadline", by_deadline=True)


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
def test_dropped_notification_fails_by_deadline(pairs, monkeypatch, caplog, mode, kind):
    pair = pairs(mode, policy="recompute", timeout_s=1.0, lease_s=2.0)
    prompt = prompt_of(50)
    params = pair.prefill("p1", prompt)
    dropped = _drop(monkeypatch, kind)
    load = _start(pair, prompt, params=params)
    _outcome(pair, "c1", prompt, "recompute", load, caplog, "before the deadline", by_deadline=True)
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
def test_expired_lease_late_read_refused_not_stale(pairs, caplog, policy):
    """Stale-read hazard (vllm#21570): the producer's lease lapses, it frees the blocks and
    reuses them for another request; the consumer's late READ gets those other bytes, but
    the confirmation answers "expired", so they are reported as load errors, never used."""
    pair = pairs("read", policy=policy, timeout_s=2.0, lease_s=3.0)
    prompt = prompt_of(50, seed=21)
    params = pair.prefill("p1", prompt)
    w = pair.P.worker._worker
    pair.P.step()  # the hold reaches the producer's worker with the next step's metadata
    assert len(w.producer.holds) == 1
    with w.ctx.lock:
        for h in w.producer.holds.values():
            h.expiry = 0.0  # lease lapsed (consumer made no progress)
    pair.P.step()
    assert pair.P.free_blocks() == pair.P.free0  # freed on lapse
    other = prompt_of(50, seed=22)
    pair.prefill("p2", other)  # reuses the freed blocks: different KV now
    assert set(pair.P.block_ids("p2")) & set(params["remote_block_ids"])
    load = _start(pair, prompt, params=params)
    load.run(lambda: pair.C.status("c1") != RequestStatus.WAITING_FOR_REMOTE_KVS)
    assert any(o.invalid_block_ids for o in pair.C.kv_outputs), "stale bytes were accepted"
    # (under recompute, _outcome checks the recomputed KV is the prompt's, not p2's)
    _outcome(pair, "c1", prompt, policy, load, caplog, "lease expired", by_deadline=False)


@pytest.mark.parametrize("policy", POLICIES)
def test_producer_abort_tells_waiting_consumer(pairs, caplog, policy):
    """Router WRITE flow: the consumer waits for a push; the producer aborts the request
    during its prefill and tells the consumer, which ends it long before its deadline."""
    pair = pairs("write", policy=policy, timeout_s=30.0, lease_s=60.0)
    uuid = "abab0000000000000000000000000abc"
    rid = (f"___prefill_addr_host:127.0.0.1,handshake:{pair.p_port},notify:1"
           f"___decode_addr_host:127.0.0.1,handshake:{pair.c_port},notify:2_{uuid}")
    prompt = prompt_of(300, seed=2)
    crid = "c-" + rid
    load = _Load(pair, crid)
    pair.C.add(crid, prompt, 2, {"do_remote_prefill": True})
    pair.C.step()
    load.watch()
    assert pair.C.status(crid) == RequestStatus.WAITING_FOR_REMOTE_KVS
    pair.P.add("p-" + rid, prompt, 1, {"do_remote_decode": True})
    pair.P.step()  # chunked prefill: 256 of 300 tokens computed
    assert pair.P.status("p-" + rid) == RequestStatus.RUNNING
    pair.P.abort("p-" + rid)
    # ended by the producer's notice, long before its own (30 s) deadline
    _outcome(pair, crid, prompt, policy, load, caplog, "producer aborted", by_deadline=False)


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
        deadline = time.monotonic() + 20  # a hang guard, not a timing bound
        while len(replies) < 2 and time.monotonic() < deadline:
            replies += to_c.poll() + to_p.poll()
            time.sleep(0.01)
        statuses = sorted(r.status[params["transfer_id"]] for r in replies)
        # P: already done, and this Done names no load that confirmed it (a repeat of the
        # consumer's own confirmation would be "ok"); C: unknown, dropped
        assert statuses == ["expired", "unknown"]
    finally:
        to_c.close()
        to_p.close()
    # Both handlers have run (their replies came back). Sentinel: a second request, sent
    # after them, goes all the way through; every signal up to its report is checked.
    n_before = (len(pair.C.kv_outputs), len(pair.P.kv_outputs))
    prompt2 = prompt_of(40, seed=9)
    params2 = pair.prefill("p2", prompt2)
    pair.C.add("c2", prompt2, 2, params2)
    pair.drain()
    new_c, new_p = pair.C.kv_outputs[n_before[0]:], pair.P.kv_outputs[n_before[1]:]
    assert [rid for o in new_c for rid in (o.finished_recving or ())] == ["c2"]
    assert [rid for o in new_p for rid in (o.finished_sending or ())] == ["p2"]
    pair.assert_no_leak()


def test_layout_mismatch_is_a_clear_error_and_recomputes(pairs, caplog):
    pair = pairs("read", c_block_size=24, timeout_s=2.0, lease_s=3.0)  # 16 and 24: neither divides the other
    prompt = prompt_of(64)
    params = pair.prefill("p1", prompt)
    load = _Load(pair, "c1")
    pair.C.add("c1", prompt, 2, params)
    _outcome(pair, "c1", prompt, "recompute", load, caplog, "mismatch")
    assert any("block_size" in r.getMessage() and "mismatch" in r.getMessage() for r in caplog.records)


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


def test_stale_write_hazard_consumer_keeps_blocks_until_producer_acks_cancel(pairs, caplog):
    """WRITE, lifecycle 3.3: the consumer gives up (deadline) while the producer's write
    is still in flight; it must keep its blocks aside until the producer acknowledges
    the cancel (no write can land any more), only then report the load error."""
    # the producer's write completes 5 s late; its own deadline (8 s) is longer than the
    # consumer's (1.5 s), so the consumer gives up first (seconds apart: a loaded host's
    # stalls cannot reorder them)
    faults = {"backend_options": {"faults": {"delay_s": 5.0, "seed": 1}}, "transfer_timeout_s": 8.0}
    pair = pairs("write", policy="recompute", timeout_s=1.5, lease_s=8.0, p_extra=faults)
    prompt = prompt_of(50)
    params = pair.prefill("p1", prompt)
    load = _start(pair, prompt, params=params)
    w = pair.P.worker._worker
    recv = pair.C.worker._worker.consumer.recv["c1"]
    load.run(lambda: any(h.state is HoldState.POSTED for h in w.producer.holds.values()))
    load.run(lambda: recv.state is RecvState.CANCEL)  # the consumer gave up at its deadline
    assert pair.C.status("c1") == RequestStatus.WAITING_FOR_REMOTE_KVS  # blocks kept aside
    assert any(h.state is HoldState.POSTED for h in w.producer.holds.values())  # write still in flight
    load.run(lambda: pair.C.status("c1") != RequestStatus.WAITING_FOR_REMOTE_KVS)
    assert not w.producer.holds  # producer's write ended before the consumer let go
    _outcome(pair, "c1", prompt, "recompute", load, caplog, "before the deadline", by_deadline=True)


def test_producer_abort_before_consumer_asks(pairs, caplog):
    """Router WRITE flow, other order: the producer aborts before the consumer's request
    even arrives; the consumer's "write into" is answered "aborted" and it ends early."""
    pair = pairs("write", policy="recompute", timeout_s=30.0, lease_s=60.0)
    uuid = "cdcd0000000000000000000000000abc"
    rid = (f"___prefill_addr_host:127.0.0.1,handshake:{pair.p_port},notify:1"
           f"___decode_addr_host:127.0.0.1,handshake:{pair.c_port},notify:2_{uuid}")
    prompt = prompt_of(300, seed=3)
    pair.P.add("p-" + rid, prompt, 1, {"do_remote_decode": True})
    pair.P.step()
    pair.P.abort("p-" + rid)
    pair.P.step()  # the abort notice goes out
    load = _Load(pair, "c-" + rid)
    pair.C.add("c-" + rid, prompt, 2, {"do_remote_prefill": True})
    _outcome(pair, "c-" + rid, prompt, "recompute", load, caplog,
             # the same cause whichever reaches the consumer first: the producer's abort
             # notice, or the answer "aborted" to its write request
             "producer aborted", by_deadline=False)
