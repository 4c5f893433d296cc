"""The prefill/decode failures users report against other connectors, each recreated here.

One test per field report (docs/RELIABILITY.md has the table): the same fault at the same
moment, on real vLLM Schedulers and real connector workers (``tests/vllm/harness.py``),
with faults injected through ``kvtransport.faults`` or the wire (side-channel messages
lost). Each asserts what a user would check: the request ran on its own prompt's KV (never
another request's), blocks came back only when nothing could land in them any more, the
load ended by its deadline or earlier, and the producer's blocks were not held past their
lease.

Every test also runs a ``broken`` variant: the same scenario with the design's safeguard
switched off through a seam the connector already has (the worker's reply seam, the
consumer's step table, the producer's block pairing or cancel answer, a hold's lease, a
hand-shake's state, the wire). The test's own
check must then fail, which is asserted: the check can catch the field's failure, it does
not just pass.
"""

from __future__ import annotations

import threading
import time

import pytest

import kvtransport as kvt
import kvtransport_vllm.consumer as consumer_module
import kvtransport_vllm.side_channel as sc
from harness import Engine, Pair, ask_producer, free_port_base, prompt_of, run_until
from kvtransport import Op
from kvtransport.testing.fault_controls import gate_posts
from kvtransport_vllm.load_stats import Cause
from kvtransport_vllm.messages import Release, Reply, Written
from kvtransport_vllm.recv import RecvState

pytestmark = pytest.mark.timeout(180)

#: every engine here talks over loopback only
LOOP = {"side_channel_host": "127.0.0.1"}
#: a fault wrapper with no random fault: a test arms its gate (PostGate) when it needs one
GATED = {"backend_options": {"faults": {"seed": 1}}, **LOOP}


@pytest.fixture
def pairs():
    """``pairs(*args, **kwargs)`` -> harness.Pair; every pair is closed when the test ends."""
    made: list[Pair] = []

    def make(*args, **kwargs) -> Pair:
        p = Pair(*args, **kwargs)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


def _outputs_name(outputs, field: str, rid: str) -> bool:
    return any(rid in (getattr(o, field) or ()) for o in outputs)


def _stat(engine: Engine, key: str) -> int:
    return sum(o.kv_connector_stats.data[key] for o in engine.kv_outputs if o.kv_connector_stats)


def _drop_sends(monkeypatch, pred, limit: int | None = None) -> list:
    """The wire loses side-channel messages for which ``pred(msg)`` holds (the first
    ``limit`` of them, or all). Returns the list of messages lost."""
    real = sc.SideChannelClient.send
    lost: list = []

    def send(self, msg):
        if pred(msg) and (limit is None or len(lost) < limit):
            lost.append(msg)
            msg.cid = next(self._cids)
            return msg.cid
        return real(self, msg)

    monkeypatch.setattr(sc.SideChannelClient, "send", send)
    return lost


class _Stepper:
    """Steps one engine on its own thread, as vLLM's engine loop would, so the test can act
    while that engine's step is held inside a gated post."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=f"steps-{engine.engine_id}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while not self.stop.is_set():
                self.engine.step()
                self.stop.wait(0.002)  # pacing only
        except BaseException as exc:  # reported by join()
            self.error = exc

    def join(self) -> None:
        self.stop.set()
        self.thread.join(30)
        assert not self.thread.is_alive(), "engine step thread did not stop"
        if self.error is not None:
            raise self.error


def _hold(pair: Pair, rid: str):
    w = pair.P.worker._worker
    with w.ctx.lock:
        return next((h for h in w.producer.holds.values() if h.req_id == rid), None)


def _end_lease_now(pair: Pair, rid: str) -> None:
    """The producer's lease on ``rid`` (if still held) ends now: no renewal reached it in
    time (a renewal sent before the consumer's step blocked cannot extend it either: this
    is applied again before every producer step until the hold is gone)."""
    w = pair.P.worker._worker
    with w.ctx.lock:
        for h in w.producer.holds.values():
            if h.req_id == rid:
                h.expiry = 0.0


# ----------------------------------------------------------------------------------------
# Stale KV served as a success: aws-samples/aws-do-eks#84, vllm#52234
# ----------------------------------------------------------------------------------------

def _ignore_confirmation(pair: Pair) -> None:
    """Broken variant: the consumer takes the producer's "expired" for "ok" (a connector
    that reads and never lets the producer's answer fail the load: the field's bug)."""
    consumer = pair.C.worker._worker.consumer
    real = consumer.on_reply

    def lenient(msg):
        if isinstance(msg, Reply):
            msg.status = {k: ("ok" if v == "expired" else v) for k, v in msg.status.items()}
        return real(msg)

    consumer.on_reply = lenient


def _assert_ran_on_its_own_kv(pair: Pair, rid: str, prompt: list[int], kv_checks: list[list[int]]) -> None:
    """Never served stale: when ``rid`` first ran with its prompt computed, every prompt
    block held that prompt's KV; the stale load was reported as a load error and the
    prompt computed locally (policy recompute)."""
    assert kv_checks == [[]], f"{rid} ran on another request's KV (blocks {kv_checks} differ from its prompt's)"
    assert any(o.invalid_block_ids for o in pair.C.kv_outputs), "the stale load was not reported as a load error"
    assert pair.C.first_start.get(rid) == 0, f"{rid} was not recomputed: {pair.C.first_start.get(rid)}"


def _reused(pair: Pair, stale: dict, rid: str, seed: int) -> dict:
    """Prefill ``rid`` on the producer; its blocks must include some of ``stale``'s."""
    params = pair.prefill(rid, prompt_of(50, seed=seed))
    assert set(pair.P.block_ids(rid)) & set(stale["remote_block_ids"]), "precondition: blocks not reused"
    return params


def _lease_lapses_mid_read(pair: Pair, prompt: list[int]) -> tuple[str, dict]:
    """aws-do-eks#84: the decode engine's READ is under way (held inside the backend's
    post, the decode engine's step blocked there, so it renews nothing) when the producer's
    lease ends; the producer frees the blocks and the next prefill takes them; then the
    READ moves the bytes: another request's KV."""
    params = pair.prefill("p1", prompt)
    gate = gate_posts(pair.C.worker._worker.agent.faults, frozenset({Op.READ}))
    pair.C.add("c1", prompt, 3, params)
    stepper = _Stepper(pair.C)
    try:
        end = time.monotonic() + 30  # a hang guard, not a timing bound
        while not (gate.entered.is_set() and _hold(pair, "p1") is not None):
            assert time.monotonic() < end, "the consumer's READ never reached the backend"
            pair.P.step()
            time.sleep(0.002)
        run_until([pair.P], lambda: _end_lease_now(pair, "p1")
                  or _outputs_name(pair.P.kv_outputs, "finished_sending", "p1"))
        other = _reused(pair, params, "p2", seed=22)
    finally:
        gate.release()
        stepper.join()
    assert gate.passed.is_set() and not gate.timed_out
    return "c1", other


def _consumed_params_reused(pair: Pair, prompt: list[int]) -> tuple[str, dict]:
    """vllm#52234 ("stale reference after the producer reused the blocks"): a load
    confirmed and freed the producer's blocks; a new prompt then comes with the same
    kv_transfer_params (a router retry or a hedged request) after another prefill took
    those blocks."""
    first = prompt_of(50, seed=21)
    params = pair.prefill("p1", first)
    pair.C.add("c0", first, 2, params)
    loaded = pair.run_to_end_checking_kv("c0", first)
    assert loaded == [[]] and pair.C.first_start["c0"] >= len(first) - 1, "precondition: the first load failed"
    pair.drain()
    other = _reused(pair, params, "p2", seed=22)
    pair.C.add("c1", prompt, 3, params)
    return "c1", other


STALE_TRIGGERS = {"lease_lapses_mid_read": _lease_lapses_mid_read, "consumed_params_reused": _consumed_params_reused}


@pytest.mark.parametrize("variant", ["as_built", "broken_confirmation_ignored"])
@pytest.mark.parametrize("trigger", list(STALE_TRIGGERS))
def test_stale_blocks_are_refused_and_recomputed_never_served(pairs, trigger, variant):
    pair = pairs("read", policy="recompute", timeout_s=30.0, lease_s=60.0, p_extra=LOOP, c_extra=GATED)
    if variant.startswith("broken"):
        _ignore_confirmation(pair)
    prompt = prompt_of(50, seed=23)
    rid, other = STALE_TRIGGERS[trigger](pair, prompt)
    kv_checks = pair.run_to_end_checking_kv(rid, prompt)
    if variant == "as_built":
        _assert_ran_on_its_own_kv(pair, rid, prompt, kv_checks)
    else:
        with pytest.raises(AssertionError, match="ran on another request's KV"):
            _assert_ran_on_its_own_kv(pair, rid, prompt, kv_checks)
    # nobody reads p2: hand it back as its decode engine would, then nothing may be left
    assert isinstance(ask_producer(pair, Release(keys=[other["transfer_id"]])), Reply)
    pair.drain()
    pair.assert_no_leak()


# ----------------------------------------------------------------------------------------
# Push mode (WRITE): vllm#48633 rows C1 and C3
# ----------------------------------------------------------------------------------------

def _front_aligned(src, dst):
    """Broken variant (vllm#48633 C3): pair the consumer's blocks with the producer's
    first blocks instead of those at the same prompt positions (a front trim)."""
    return [list(s[:len(d)]) for s, d in zip(src, dst)], [list(d) for d in dst]


def _assert_loaded_its_prompt(pair: Pair, rid: str, prompt: list[int], kv_checks) -> None:
    assert kv_checks == [[]], f"{rid} ran on KV that is not its prompt's (blocks {kv_checks} differ)"
    assert pair.C.first_start.get(rid, 0) >= len(prompt) - 1, f"{rid} was recomputed, not loaded"


@pytest.mark.parametrize("variant", ["as_built", "broken_front_aligned"])
def test_push_after_a_partial_prefix_hit_fills_only_the_uncached_tail(pairs, monkeypatch, variant):
    """vllm#48633 C3: the decode engine has the first two blocks of the prompt in its
    prefix cache, so it asks only for the rest; the producer must write its blocks at
    those same prompt positions into them (not its first blocks)."""
    import kvtransport_vllm.producer as producer_module

    pair = pairs("write", policy="recompute", timeout_s=5.0, lease_s=10.0, p_extra=LOOP, c_extra=LOOP)
    prompt = prompt_of(56, seed=9)  # blocks of 16: 3 full and a partial one
    warm = prompt[:32] + prompt_of(20, seed=10)  # shares the first two blocks only
    pair.C.add("warm", warm, 1, None)
    pair.run(lambda: pair.C.status("warm") is None)
    for blk in pair.C.scheduler.kv_cache_manager.block_pool.blocks:  # no stale copy of the tail
        if blk.block_hash is None:
            for t in pair.C.kv_caches.values():
                t[blk.block_id].zero_()
    if variant.startswith("broken"):
        monkeypatch.setattr(producer_module, "align_tails", _front_aligned)
    params = pair.prefill("p1", prompt)
    n = len(pair.C.kv_outputs)
    pair.C.add("c1", prompt, 2, params)
    kv_checks = pair.run_to_end_checking_kv("c1", prompt)
    moved = sum(o.kv_connector_stats.data["bytes"] for o in pair.P.kv_outputs if o.kv_connector_stats)
    assert moved == 2 * 2 * (2 * 16 * 128 * 4), "precondition: not a partial hit (two blocks, two layers)"
    assert not any(o.invalid_block_ids for o in pair.C.kv_outputs[n:])
    if variant == "as_built":
        _assert_loaded_its_prompt(pair, "c1", prompt, kv_checks)
    else:
        with pytest.raises(AssertionError, match="not its prompt's"):
            _assert_loaded_its_prompt(pair, "c1", prompt, kv_checks)
    pair.drain()
    pair.assert_no_leak()


def test_abort_while_the_push_is_in_flight_broken_ack_is_caught(pairs, monkeypatch):
    """vllm#48633 C1 (the decode engine aborts while the producer's write is in flight):
    recreated by ``tests/vllm/test_stale_write_race.py::test_consumer_cancel_while_post_
    blocks_is_not_acked_and_nothing_lands_in_freed_blocks``. Here its broken variant: a
    producer that acknowledges the cancel while its write is being posted. That test's own
    checks must then fail (the write lands in blocks handed back to vLLM)."""
    import kvtransport_vllm.producer as producer_module
    import test_stale_write_race as race

    real = producer_module.Producer.answer_give_up

    def acks_during_post(self, key, now, rank=-1, readers=1):
        h = self.holds.get(key)
        if h is not None and h.write_in_flight:
            return "acked"  # the field's bug: no write of ours may land... while one may
        return real(self, key, now, rank, readers)

    monkeypatch.setattr(producer_module.Producer, "answer_give_up", acks_during_post)
    with pytest.raises(AssertionError, match="landed in consumer blocks|freed its blocks|acked"):
        race.test_consumer_cancel_while_post_blocks_is_not_acked_and_nothing_lands_in_freed_blocks(pairs)


# ----------------------------------------------------------------------------------------
# One of several pieces fails while its siblings are in flight: vllm#56104
# ----------------------------------------------------------------------------------------

_real_read_step = consumer_module._STEPS[RecvState.READ]


def _read_step_ignoring_siblings(self, r, now, gave_up):
    """Broken variant (the field's bug): the first failed piece ends the load and hands
    its blocks back while sibling pieces are still in flight."""
    if any(pc.transfer is not None and pc.transfer.status().state is kvt.State.FAILED for pc in r.pieces):
        r.fail(Cause.TRANSPORT, "a piece failed (siblings not waited for)", first=True)
        self.send.release(r)
        self._finish(r, ok=False)
        return
    _real_read_step(self, r, now, gave_up)


def _assert_handed_back_only_when_nothing_can_land(at_report: list[tuple[int, int]]) -> None:
    assert at_report, "vLLM never saw the load end"
    pending, unquiesced = at_report[0]
    assert (pending, unquiesced) == (0, 0), (
        f"the load's blocks were handed back with {pending} transfer(s) still in flight and {unquiesced} "
        "that may still land")


@pytest.mark.parametrize("variant", ["as_built", "broken_sibling_ignored"])
def test_one_piece_failing_keeps_the_blocks_until_its_siblings_ended(monkeypatch, variant):
    """Decode TP 1 gathers its heads from prefill TP 2: two READs. The first fails at once,
    the other is still in flight (its completion comes 1.5 s later). The load may be
    reported (and its blocks reused) only once no transfer of it can land any more."""
    from test_hetero_tp import Run, _assert_nothing_left, _engines, _prefill
    from tp_harness import run_until as tp_run_until

    faults = {"backend_options": {"faults": {"fail_rate": 0.5, "delay_s": 1.5, "seed": 1}}}
    P, C = _engines("read", 2, 1, 4, timeout_s=10.0, c_rank_extra={0: faults})
    try:
        if variant.startswith("broken"):
            monkeypatch.setitem(consumer_module._STEPS, RecvState.READ, _read_step_ignoring_siblings)
        prompt = prompt_of(60, seed=3)
        C.add("c1", prompt, 2, _prefill(P, "p1", prompt))
        agent = C.workers[0]._worker.agent
        run = Run(P, C, "c1", prompt)
        at_report: list[tuple[int, int]] = []

        def ended() -> bool:
            gone = run.ended()
            if run.reported is not None and not at_report:  # right after the step that reported it
                s = agent.stats()
                at_report.append((s["pending"], s["unquiesced"]))
            return gone

        tp_run_until([P, C], ended, timeout=30.0)
        # the trigger: with seed 1 the first READ fails at its post, the second is in flight
        assert agent.faults.plan.injected == {"fail": 1, "delay": 1}, agent.faults.plan.injected
        if variant == "as_built":
            _assert_handed_back_only_when_nothing_can_land(at_report)
        else:
            with pytest.raises(AssertionError, match="still in flight"):
                _assert_handed_back_only_when_nothing_can_land(at_report)
        assert C.finish_reason("c1") == "length" and C.first_start["c1"] == 0, "not recomputed"
        assert run.bad == [], "the recomputed KV differs from the prompt's"
        _assert_nothing_left(P, C)
    finally:
        P.close()
        C.close()


# ----------------------------------------------------------------------------------------
# A failure never signalled: vllm#50754 (vllm#48633 row C2), vllm#58188
# ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", ["as_built", "broken_failure_notice_lost"])
def test_write_the_producer_cannot_post_ends_the_load_at_once(pairs, caplog, monkeypatch, variant):
    """vllm#50754: the producer cannot start the write into the decode engine's blocks. The
    decode engine must learn it (and recompute) at once, not wait out its deadline over
    half-written blocks."""
    from test_failures import _outcome, _start

    faults = {"backend_options": {"faults": {"fail_rate": 1.0, "seed": 1}}, **LOOP}
    pair = pairs("write", policy="recompute", timeout_s=2.0, lease_s=4.0, p_extra=faults, c_extra=LOOP)
    prompt = prompt_of(50)
    params = pair.prefill("p1", prompt)
    if variant.startswith("broken"):  # the producer's notice that its write failed never arrives
        _drop_sends(monkeypatch, lambda m: isinstance(m, Written) and not m.ok)
    load = _start(pair, prompt, params=params)

    def check() -> None:
        _outcome(pair, "c1", prompt, "recompute", load, caplog, "injected failure", by_deadline=False)

    if variant == "as_built":
        check()
    else:
        with pytest.raises(AssertionError, match="before the deadline|only after its deadline"):
            check()
        pair.drain()
        pair.assert_no_leak()


def _assert_loaded_and_freed_by_the_protocol(pair: Pair, rid: str, prompt: list[int], kv_checks) -> None:
    assert kv_checks == [[]] and pair.C.first_start.get(rid, 0) >= len(prompt) - 1, (
        f"{rid} was not loaded (first scheduled from token {pair.C.first_start.get(rid)})")
    assert _outputs_name(pair.P.kv_outputs, "finished_sending", "p1"), "the producer still holds the blocks"
    assert _stat(pair.P, "leases_expired") == 0, "the producer's blocks came back only when its lease lapsed"


@pytest.mark.parametrize("variant", ["as_built", "broken_completion_never_resent"])
def test_lost_completion_of_a_push_is_resent_and_the_source_blocks_freed(pairs, monkeypatch, variant):
    """vllm#58188: a successful WRITE's completion is lost on its way. The decode engine
    must still load the KV, and the producer free its source blocks by the protocol, not
    when its lease (60 s here) lapses."""
    pair = pairs("write", policy="recompute", timeout_s=2.0, lease_s=60.0, p_extra=LOOP, c_extra=LOOP)
    prompt = prompt_of(50, seed=5)
    params = pair.prefill("p1", prompt)
    lost = _drop_sends(monkeypatch, lambda m: isinstance(m, Written) and m.ok,
                       limit=1 if variant == "as_built" else None)
    pair.C.add("c1", prompt, 3, params)
    kv_checks = pair.run_to_end_checking_kv("c1", prompt)
    assert lost, "precondition: no completion was lost"
    if variant == "as_built":
        _assert_loaded_and_freed_by_the_protocol(pair, "c1", prompt, kv_checks)
    else:
        with pytest.raises(AssertionError, match="was not loaded"):
            _assert_loaded_and_freed_by_the_protocol(pair, "c1", prompt, kv_checks)
    pair.drain()
    pair.assert_no_leak()


# ----------------------------------------------------------------------------------------
# Prefill blocks stranded: vllm#41269, ai-dynamo/dynamo#4773
# ----------------------------------------------------------------------------------------

class _LeaseWatch:
    """Steps the producer (and ``also``) and records, per round of steps, its monotonic
    (start, end), the latest (finite) lease expiry of ``rid``'s hold while held, and the
    round in which the producer reported ``rid`` freed. ``expiry``: the hold's expiry as
    first seen, when the test changes it before watching."""

    def __init__(self, pair: Pair, rid: str, also: list[Engine] | None = None,
                 expiry: float | None = None) -> None:
        self.pair, self.rid, self.also = pair, rid, also or []
        self.rounds: list[tuple[float, float]] = []
        self.expiry = expiry
        self.freed_in: int | None = None

    def run(self) -> None:
        """Until the hold is freed and every request of ``also`` ended, or until a whole
        lease has passed after the hold's expiry (a loop bound, not a check)."""
        lease = self.pair.P.worker._worker.cfg.lease_s
        while True:
            h = _hold(self.pair, self.rid)
            if h is not None and h.expiry != float("inf"):
                self.expiry = h.expiry
            others_done = all(not e.scheduler.requests for e in self.also)
            past = self.expiry is not None and bool(self.rounds) and self.rounds[-1][0] > self.expiry + lease
            if others_done and (self.freed_in is not None or past):
                return
            assert not (past and self.rounds[-1][0] > self.expiry + lease + 60.0), "hang guard"
            n = len(self.pair.P.kv_outputs)
            t0 = time.monotonic()
            self.pair.params.update(self.pair.P.step())
            for e in self.also:
                e.step()
            self.rounds.append((t0, time.monotonic()))
            if self.freed_in is None and _outputs_name(self.pair.P.kv_outputs[n:], "finished_sending", self.rid):
                self.freed_in = len(self.rounds) - 1
            time.sleep(0.005)

    def assert_freed_by_its_lease(self) -> None:
        """Not stranded beyond the lease: freed in the first round of steps that began
        after the hold's lease ended (or the next one, whose report it is), never before."""
        assert self.expiry is not None, "the producer never held the blocks"
        assert self.freed_in is not None, f"{self.rid}'s blocks still held a whole lease after their lease ended"
        assert self.rounds[self.freed_in][1] >= self.expiry, "freed before the lease ended"
        # no round began after the lease ended: it was freed in the round during which it ended
        first_after = next((i for i, (start, _) in enumerate(self.rounds) if start >= self.expiry),
                           len(self.rounds))
        assert self.freed_in <= first_after + 1, (
            f"freed {self.freed_in - first_after} rounds of steps after the first one past its lease")


def _no_lease(pair: Pair, rid: str) -> float:
    """Broken variant: the producer's hold has no lease of its own (only a long abort
    timeout elsewhere would free it: the field's 480 s). Returns the lease's end it had."""
    w = pair.P.worker._worker
    with w.ctx.lock:
        h = next(h for h in w.producer.holds.values() if h.req_id == rid)
        was, h.expiry = h.expiry, float("inf")
    return was


@pytest.mark.parametrize("variant", ["as_built", "broken_no_lease"])
def test_prefill_blocks_nobody_asks_for_are_freed_by_the_lease(pairs, variant):
    """vllm#41269: the decode engine rejects the request before admitting it (bad request,
    render error): no decode worker ever hears of it, so nothing tells the producer. Its
    blocks come back when its lease ends (1.5 s here), not after a long abort timeout."""
    pair = pairs("read", policy="recompute", timeout_s=1.5, lease_s=1.5, p_extra=LOOP, c_extra=LOOP)
    pair.prefill("p1", prompt_of(50, seed=4))
    run_until([pair.P], lambda: _hold(pair, "p1") is not None)
    expiry = _no_lease(pair, "p1") if variant.startswith("broken") else None
    watch = _LeaseWatch(pair, "p1", expiry=expiry)
    watch.run()
    if variant == "as_built":
        watch.assert_freed_by_its_lease()
        assert _stat(pair.P, "leases_expired") == 1
        pair.assert_no_leak()
    else:
        with pytest.raises(AssertionError, match="still held a whole lease"):
            watch.assert_freed_by_its_lease()


LOCALHOST_CASES = [("nothing", "as_built"), ("the_decode_engine", "as_built"), ("the_decode_engine", "broken_no_lease")]


@pytest.mark.parametrize("answers, variant", LOCALHOST_CASES)
def test_producer_advertising_localhost_to_another_namespace(pairs, caplog, answers, variant):
    """ai-dynamo/dynamo#4773: the prefill engine advertises localhost; the decode engine
    lives in another network namespace (pod), where that address is its own loopback.
    Two loopback addresses stand for the two namespaces: the producer listens on
    127.0.0.2 only, and its kv_transfer_params name 127.0.0.1, where in the decode
    engine's world either nothing listens or the decode engine itself does (same port).
    The decode engine must end the load (at its deadline, or at once when the hand-shake
    reaches itself: its agent refuses to connect to itself), read nothing and recompute,
    and the producer must free its blocks by its lease."""
    port = free_port_base(4)
    p_extra = {"side_channel_host": "127.0.0.2", "side_channel_port": port}
    c_extra = {"side_channel_host": "127.0.0.1"}
    if answers == "the_decode_engine":
        c_extra["side_channel_port"] = port
    pair = pairs("read", policy="recompute", timeout_s=1.5, lease_s=1.5, p_extra=p_extra, c_extra=c_extra)
    prompt = prompt_of(50, seed=6)
    params = pair.prefill("p1", prompt)
    assert params["remote_host"] == "127.0.0.2"
    advertised = dict(params, remote_host="127.0.0.1")  # what a localhost-advertising engine sends
    run_until([pair.P], lambda: _hold(pair, "p1") is not None)
    expiry = _no_lease(pair, "p1") if variant.startswith("broken") else None
    pair.C.add("c1", prompt, 2, advertised)
    watch = _LeaseWatch(pair, "p1", also=[pair.C], expiry=expiry)
    watch.run()
    # the decode side: recomputed, its load ended for the reason a user would want named
    assert pair.C.first_start.get("c1") == 0 and any(o.invalid_block_ids for o in pair.C.kv_outputs)
    why = [r.getMessage() for r in caplog.records if "load of request c1 " in r.getMessage()]
    # nothing there: no answer, the deadline ends it; itself there: its own agent refuses
    # to connect to itself at the hand-shake, before any byte moves
    expected = "before connecting" if answers == "nothing" else "cannot connect to itself"
    assert len(why) == 1 and expected in why[0], why
    if variant == "as_built":
        watch.assert_freed_by_its_lease()
        pair.drain()
        pair.assert_no_leak()
    else:
        with pytest.raises(AssertionError, match="still held a whole lease"):
            watch.assert_freed_by_its_lease()


# ----------------------------------------------------------------------------------------
# No self-healing after a disconnect or a failed hand-shake:
# ai-dynamo/nixl#1983, vllm#41863, vllm#33745
# ----------------------------------------------------------------------------------------

def _step_consumer_until(pair: Pair, cond, timeout: float = 30.0) -> None:
    """Step the consumer only (the producer is down); any exception a step raises fails
    the test (vllm#41863: a failed hand-shake crashed the decode workers)."""
    run_until([pair.C], cond, timeout)


def _remember_failure_forever(pair: Pair) -> None:
    """Broken variant (nixl#1983): the failed peer stays failed; no later load hand-shakes
    again with it, though it is reachable."""
    for p in pair.C.worker._worker.consumer.peers.values():
        p.state, p.error, p.failed_at = "failed", "peer disconnected (remembered)", float("inf")


def _assert_next_request_loads(pair: Pair, rid: str, prompt: list[int], n_before: int, kv_checks) -> None:
    assert kv_checks == [[]] and pair.C.first_start.get(rid, 0) >= len(prompt) - 1, (
        f"{rid} did not load its KV from the producer after the failed hand-shake "
        f"(first scheduled from token {pair.C.first_start.get(rid)})")
    assert not any(o.invalid_block_ids for o in pair.C.kv_outputs[n_before:]), f"{rid}: load error"


@pytest.mark.parametrize("variant", ["as_built", "broken_failed_peer_remembered"])
def test_after_a_failed_hand_shake_the_next_request_loads_again(pairs, caplog, variant):
    """The prefill engine goes down after its prefill, before the decode engine hand-shakes
    with it (vllm#41863: the decode workers crashed on that failed hand-shake; vllm#33745:
    the failure ignored kv_load_failure_policy). The request is recomputed per policy and
    the decode engine keeps serving. Once a producer answers at that address again, the
    next request loads its KV from it with no restart of the decode engine (nixl#1983: the
    peer stayed deregistered, every later transfer to it failed)."""
    pair = pairs("read", policy="recompute", timeout_s=1.5, lease_s=1.5, p_extra=LOOP, c_extra=LOOP)
    prompt = prompt_of(50, seed=7)
    params = pair.prefill("p1", prompt)
    extra = dict(pair.P.vllm_config.kv_transfer_config.kv_connector_extra_config)
    pair.P.close()  # down: its side channel and memory are gone
    pair.C.add("c1", prompt, 2, params)
    _step_consumer_until(pair, lambda: pair.C.status("c1") is None)
    assert pair.C.first_start.get("c1") == 0, "the request was not recomputed after the failed hand-shake"
    assert any("load of request c1 " in r.getMessage() for r in caplog.records), "the failure was not reported"
    if variant.startswith("broken"):
        _remember_failure_forever(pair)
    pair.P = Engine("kv_producer", extra, engine_id="P")  # back at the same address
    pair.params.clear()
    prompt2 = prompt_of(60, seed=8)
    params2 = pair.prefill("p2", prompt2)
    n_before = len(pair.C.kv_outputs)
    pair.C.add("c2", prompt2, 2, params2)
    kv_checks = pair.run_to_end_checking_kv("c2", prompt2)
    if variant == "as_built":
        _assert_next_request_loads(pair, "c2", prompt2, n_before, kv_checks)
    else:
        with pytest.raises(AssertionError, match="did not load its KV"):
            _assert_next_request_loads(pair, "c2", prompt2, n_before, kv_checks)
    pair.drain()
    pair.assert_no_leak()
