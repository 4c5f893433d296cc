"""Heterogeneous tensor parallelism (issue 14, point 1; acceptance 2), READ and WRITE.

Real vLLM Schedulers, one real connector worker per TP rank, vLLM's own aggregation of
the ranks' outputs (``KVOutputAggregator``): the decode request leaves
WAITING_FOR_REMOTE_KVS only once every decode rank reported its load. Checked as a user
would: each decode rank holds, in every prompt block, exactly the head slices the prefill
ranks computed for its heads when the request is first RUNNING; it was loaded, not
prefilled locally; every block is back in both pools and no rank keeps a hold or a load.
Producer ranks nobody reads (replicated heads) are freed at once: the lease is far longer
than the test may run, and no lease lapses.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest

from harness import free_port_base, prompt_of
from tp_harness import TPEngine, run_until
from vllm.v1.request import RequestStatus

LONG_LEASE = 120.0  # longer than any test here may run: a hold freed is freed by a message


def _engines(mode: str, p: int, d: int, heads: int, *, timeout_s: float = 10.0, lease_s: float = LONG_LEASE,
             p_rank_extra=None, c_rank_extra=None, policy: str = "recompute", c_block_size: int = 16,
             mla: bool = False, sliding_window: int | None = None, p_block_size: int = 16, **model: Any):
    """A prefill engine of TP ``p`` and a decode engine of TP ``d`` serving a model of
    ``heads`` KV heads; ``model``: TPEngine's other model options, for both (e.g. a hybrid
    SSM model's ``mamba_groups``)."""
    base = free_port_base(16)
    common = {"backend": "loopback", "mode": mode, "transfer_timeout_s": timeout_s, "lease_s": lease_s,
              "side_channel_host": "127.0.0.1"}
    P = TPEngine("kv_producer", {**common, "side_channel_port": base}, tp=p, total_kv_heads=heads,
                 engine_id="P", rank_extra=p_rank_extra, mla=mla, sliding_window=sliding_window,
                 block_size=p_block_size, **model)
    try:
        C = TPEngine("kv_consumer", {**common, "side_channel_port": base + 8}, tp=d, total_kv_heads=heads,
                     engine_id="C", rank_extra=c_rank_extra, policy=policy, block_size=c_block_size, mla=mla,
                     sliding_window=sliding_window, **model)
    except BaseException:
        P.close()
        raise
    return P, C


def _prefill(P: TPEngine, rid: str, prompt: list[int]) -> dict:
    params: dict[str, dict] = {}
    P.add(rid, prompt, 1, {"do_remote_decode": True})
    run_until([P], lambda: rid in params, on_params=params.update)
    return params[rid]


def _run_load(P: TPEngine, C: TPEngine, rid: str, prompt: list[int], timeout: float = 30.0) -> Run:
    """Step both until the decode request is gone, watching it (see :class:`Run`)."""
    run = Run(P, C, rid, prompt)
    run_until([P, C], run.ended, timeout=timeout)
    return run


class Run:
    """What a user can see of one decode request across rounds of steps: the head slices
    that differed when it was first RUNNING with its prompt computed (``bad``, None if
    never seen so); the monotonic (start, end) of every round and the first round after
    which vLLM's aggregated output had reported it loaded or failed (``reported``); each
    decode rank's deadline for the load and each producer rank's WRITE deadline."""

    def __init__(self, P: TPEngine, C: TPEngine, rid: str, prompt: list[int]) -> None:

        self.P, self.C, self.rid, self.prompt = P, C, rid, prompt
        self.bad: list | None = None
        self.rounds: list[tuple[float, float]] = []
        self.reported: int | None = None
        self.deadlines: dict[int, float] = {}
        #: decode rank -> the producer ranks its load reads from (or is written by)
        self.pieces: dict[int, list[int]] = {}
        self.write_deadlines: dict[int, float] = {}
        self._t = time.monotonic()
        for rank, w in enumerate(C.workers):  # note each rank's deadline when it takes the load
            w._worker.consumer.add = self._watch_add(rank, w._worker.consumer)

    def _watch_add(self, rank: int, consumer):
        real = consumer.add

        def add(jobs, now):
            real(jobs, now)
            for job in jobs:
                if job.req_id == self.rid:
                    self.deadlines.setdefault(rank, now + consumer.ctx.cfg.transfer_timeout_s)
                    r = consumer.recv.get(job.req_id)
                    if r is not None:
                        self.pieces[rank] = [pc.piece.producer_rank for pc in r.pieces]
        return add

    def ended(self) -> bool:

        now = time.monotonic()
        self.rounds.append((self._t, now))
        self._t = now
        C, rid = self.C, self.rid
        for rank, w in enumerate(self.P.workers):
            for h in w._worker.producer.holds.values():
                if h.write is not None:
                    self.write_deadlines.setdefault(rank, h.write.deadline)
        if self.reported is None and any(rid in (o.kv_connector_output.finished_recving or ())
                                         for o in C.last_outputs):
            self.reported = len(self.rounds) - 1
        req = C.scheduler.requests.get(rid)
        if self.bad is None and req is not None and C.status(rid) == RequestStatus.RUNNING \
                and req.num_computed_tokens >= len(self.prompt):
            self.bad = C.bad_heads(rid, self.prompt)
        return req is None


def _assert_nothing_left(P: TPEngine, C: TPEngine) -> None:
    run_until([P, C], lambda: not P.scheduler.requests and not C.scheduler.requests
              and all(not w._worker.producer.holds for w in P.workers)
              and all(not w._worker.consumer.recv for w in C.workers), timeout=20.0)
    assert P.free_blocks() == P.free0, "producer leaked blocks"
    assert C.free_blocks() == C.free0, "consumer leaked blocks"
    # every prefill rank freed its hold on a decode rank's word, none by its lease lapsing
    assert P.counter("leases_expired") == 0


def _load_exact(P: TPEngine, C: TPEngine, prompt: list[int]) -> dict:
    """Prefill on P, decode on C; C's ranks hold exactly P's head slices, loaded (not
    recomputed) by every decode rank; nothing leaked. Returns the prefill's params."""
    params = _prefill(P, "p1", prompt)
    C.add("c1", prompt, 3, params)
    bad = _run_load(P, C, "c1", prompt).bad
    assert bad == [], f"head slices differing from the prefill's (rank, block, head): {bad}"
    assert C.finish_reason("c1") == "length"
    assert C.first_start["c1"] >= len(prompt) - 1, "prefilled locally, not loaded"
    _assert_nothing_left(P, C)
    assert C.counter("loads_ok") == C.tp and C.counter("failures") == 0  # every decode rank loaded
    return params


TOPOLOGIES = [
    # (prefill TP, decode TP, KV heads)
    (1, 2, 4),  # each decode rank reads a slice of the one prefill rank's heads
    (2, 1, 4),  # the decode rank gathers its heads from both prefill ranks
    (2, 4, 4),
    (4, 2, 4),
    (4, 1, 2),  # replicated prefill heads: ranks 1 and 3 are read by nobody, released at once
    (2, 4, 2),  # replicated decode heads: two decode ranks read each prefill rank
    (4, 2, 2),  # replicated on both sides
]


@pytest.mark.parametrize("mode", ["read", "write"])
@pytest.mark.parametrize("p, d, heads", TOPOLOGIES, ids=[f"tp{p}to{d}-h{h}" for p, d, h in TOPOLOGIES])
def test_hetero_tp_bytes_equal_per_head_slice(mode, p, d, heads):
    P, C = _engines(mode, p, d, heads)
    try:
        assert _load_exact(P, C, prompt_of(70, seed=p * 10 + d))["tp_size"] == p
    finally:
        P.close()
        C.close()


@pytest.mark.parametrize("mode", ["read", "write"])
@pytest.mark.parametrize("p, d", [(2, 1), (1, 2)], ids=["tp2to1", "tp1to2"])
@pytest.mark.parametrize("n_tokens", [20, 150])
def test_hetero_tp_sliding_window_hybrid_model(mode, p, d, n_tokens):
    """A hybrid model (sliding-window layer + full-attention layer, two KV cache groups with
    their own block ids) across TP sizes: every head slice of every full-attention block and
    of every sliding-window block inside the window equals the prefill's, loaded not
    recomputed, nothing left on either side."""
    P, C = _engines(mode, p, d, 2, sliding_window=32)
    try:
        _load_exact(P, C, prompt_of(n_tokens, seed=n_tokens + p))
    finally:
        P.close()
        C.close()


@pytest.mark.parametrize("mode", ["read", "write"])
def test_two_requests_back_to_back_reuse_the_hand_shakes(mode):
    P, C = _engines(mode, 2, 4, 4)
    try:
        for i in range(2):
            prompt = prompt_of(40 + 17 * i, seed=i)
            C.add(f"c{i}", prompt, 2, _prefill(P, f"p{i}", prompt))
            bad = _run_load(P, C, f"c{i}", prompt).bad
            assert bad == [] and C.first_start[f"c{i}"] >= len(prompt) - 1
        _assert_nothing_left(P, C)
    finally:
        P.close()
        C.close()


# ------------------------------------------------------------------------------- failures

FAIL = {"backend_options": {"faults": {"fail_rate": 1.0, "seed": 1}}}
HANG = {"backend_options": {"faults": {"hang_rate": 1.0, "seed": 1}}}


@pytest.mark.parametrize("fault", ["fail", "hang"])
@pytest.mark.parametrize("mode, p, d", [("read", 1, 2), ("read", 2, 1), ("write", 2, 1), ("write", 1, 2)])
def test_one_piece_failing_fails_the_load_by_its_deadline_nothing_leaked(caplog, fault, mode, p, d):
    """One rank's transfers fail (or never complete): READ faults the reading decode rank
    1 (1->2) or the decode rank's agent while it gathers from two prefill ranks (2->1);
    WRITE faults prefill rank 1's writes. The request is recomputed (policy), the failure
    ends the load at once (fail) or exactly at its deadline (hang), and every rank of
    both engines gives everything back."""
    faults = FAIL if fault == "fail" else HANG
    timeout_s = 10.0 if fault == "fail" else 1.5
    if mode == "read":  # the reading side: decode rank 1 (1->2) or the one decode rank (2->1)
        kw = {"c_rank_extra": {1 if d > 1 else 0: faults}}
    else:  # the writing side: prefill rank 1 (2->1) or the one prefill rank (1->2)
        kw = {"p_rank_extra": {1 if p > 1 else 0: faults}}
    P, C = _engines(mode, p, d, 4, timeout_s=timeout_s, lease_s=LONG_LEASE, **kw)
    caplog.set_level(logging.WARNING, logger="kvtransport_vllm.consumer")
    try:
        prompt = prompt_of(60, seed=3)
        C.add("c1", prompt, 2, _prefill(P, "p1", prompt))
        run = _run_load(P, C, "c1", prompt)
        assert C.finish_reason("c1") == "length" and C.first_start["c1"] == 0, "not recomputed"
        assert run.bad == [], "recomputed KV differs from the prompt's"
        assert sorted(run.deadlines) == list(range(d)), "every decode rank took the load"
        failed = [r.getMessage() for r in caplog.records if "load of request c1 " in r.getMessage()]
        assert failed, "no rank reported its load failed"
        k = run.reported
        assert k is not None, "vLLM never saw the load end"
        if fault == "fail":
            assert all("injected failure" in m for m in failed), failed
            assert run.rounds[k][0] < min(run.deadlines.values()), "the failure did not end the load at once"
        else:
            assert all("deadline" in m for m in failed), failed
            assert run.rounds[k][1] >= min(run.deadlines.values()), "a hung piece ended before any deadline"
            if mode == "read":  # ... and was reported in the first round that could see it pass
                assert run.rounds[k - 1][0] < max(run.deadlines.values()), "reported a round late"
            else:
                # WRITE: the decode rank keeps its blocks until the prefill rank's hung write
                # (posted after the load began) has ended at its own deadline and the prefill
                # rank acknowledged the cancel (LIFECYCLE.md section 3)
                assert run.write_deadlines and run.rounds[k][1] >= max(run.write_deadlines.values())
        _assert_nothing_left(P, C)
    finally:
        P.close()
        C.close()


# ------------------------------------------------------------------ one prefill rank, two readers

@pytest.mark.parametrize("mode", ["read", "write"])
def test_prefill_rank_read_by_two_decode_ranks_frees_only_after_both(mode):
    """TP 1 -> 2: the one prefill rank serves both decode ranks. READ: decode rank 1's
    read is reported 0.5 s late, so rank 0 confirms first; WRITE: the prefill rank writes
    rank 0's slice, then rank 1's. Either way it must hold the blocks until the last
    decode rank gave its word (confirmed, or was told "written" and acknowledged). Fails
    if a hold ends at its first reader's word."""
    late = {"backend_options": {"faults": {"delay_s": 0.5, "seed": 1}}}
    P, C = _engines(mode, 1, 2, 4, **({"c_rank_extra": {1: late}} if mode == "read" else {}))
    try:
        ended: list[float] = []
        real_end = P.workers[0]._worker.producer.end_hold

        def end_hold(h, why):
            done = real_end(h, why)
            if done:
                ended.append(time.monotonic())
            return done

        P.workers[0]._worker.producer.end_hold = end_hold
        last_word: dict[int, float] = {}  # decode rank -> when it first gave its word
        for rank, w in enumerate(C.workers):
            if mode == "read":
                real = w._worker.consumer.send.confirm

                def confirm(r, now, real=real, rank=rank):
                    last_word.setdefault(rank, time.monotonic())
                    real(r, now)
                w._worker.consumer.send.confirm = confirm
            else:
                real = w._worker.consumer.answer_written

                def answer_written(msg, real=real, rank=rank):
                    last_word.setdefault(rank, time.monotonic())
                    return real(msg)
                w._worker.consumer.answer_written = answer_written
        prompt = prompt_of(50, seed=8)
        C.add("c1", prompt, 2, _prefill(P, "p1", prompt))
        run = _run_load(P, C, "c1", prompt)
        assert run.bad == []
        _assert_nothing_left(P, C)
        assert sorted(last_word) == [0, 1] and len(ended) == 1
        assert ended[0] >= max(last_word.values()), "the prefill rank freed the blocks before its last reader's word"
    finally:
        P.close()
        C.close()
