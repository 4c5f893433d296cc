"""Which worker hook of a step takes the step's new work.

vLLM's model runner calls ``handle_preemptions`` with the step's metadata before it prepares
the step's inputs, and ``bind_connector_metadata`` after: the connector takes new loads at
the first, so a READ is posted before that preparation (measured at concurrency 8: its wait
to be taken fell by about 0.9 ms, docs/bench/E2E_LATENCY.md), and takes each metadata object once, so
the bind that follows neither starts a load twice nor loses one. A runner that only binds
gets the same at bind.
"""

from harness import finish_reason, prompt_of, run_until
from vllm.v1.request import RequestStatus


def _load_settles(pair, rid: str, prompt: list[int]) -> None:
    run_until([pair.P, pair.C], lambda: pair.C.status(rid) == RequestStatus.RUNNING)
    assert pair.C.check_kv(rid, prompt, len(prompt)) == [], "loaded KV differs from the producer's"
    assert pair.C.first_start.get(rid, 0) >= len(prompt) - 1, "the consumer recomputed instead of loading"


def test_a_read_is_posted_at_handle_preemptions_and_not_started_again_at_bind(pairs):
    pair = pairs("read")
    warm = prompt_of(40)  # a first load makes the hand-shake: the next READ can be posted at once
    pair.C.add("c0", warm, 2, pair.prefill("p0", warm))
    _load_settles(pair, "c0", warm)
    worker = pair.C.worker._worker
    consumer, lock = worker.consumer, worker.ctx.lock
    prompt = prompt_of(70)
    params = pair.prefill("p1", prompt)
    seen: dict[str, bool] = {}

    def between_hooks(so) -> None:
        """vLLM prepares the step's inputs here; the load must already be posted. Then wait
        for it to settle (the read confirmer thread), so the bind that follows sees the
        metadata of a load that has ended: taking it again would start a second load."""
        if all(job.req_id != "c1" for job in so.kv_connector_metadata.recv):
            return  # another step
        with lock:
            r = consumer.recv.get("c1")
            posted = "c1" in consumer.done_recving if r is None else all(pc.transfer for pc in r.pieces)
        assert posted, "the READ was not posted at handle_preemptions"
        run_until([], lambda: "c1" in consumer.done_recving, timeout=20.0)  # hang guard only
        seen["settled"] = True

    pair.C.between_hooks = between_hooks
    pair.C.add("c1", prompt, 3, params)
    run_until([pair.P, pair.C], lambda: "settled" in seen)
    pair.C.between_hooks = lambda so: None
    run_until([pair.P, pair.C], lambda: pair.C.status("c1") == RequestStatus.RUNNING)
    reports = [o for o in pair.C.kv_outputs if "c1" in (o.finished_recving or ())]
    failed = [o for o in pair.C.kv_outputs if "c1" in (o.failed_recving or ())]
    assert len(reports) == 1 and not failed, \
        f"c1 reported {len(reports)} times, {len(failed)} failed: bind started the ended load again"
    _load_settles(pair, "c1", prompt)
    pair.drain()
    assert finish_reason(pair.C, "c1") == "length"
    pair.assert_no_leak()


def test_a_runner_that_only_binds_still_gets_its_loads(pairs):
    """The fallback: a model runner without the handle_preemptions call."""
    pair = pairs("read")
    pair.C.calls_handle_preemptions = False
    prompt = prompt_of(70)
    pair.C.add("c1", prompt, 3, pair.prefill("p1", prompt))
    _load_settles(pair, "c1", prompt)
    pair.drain()
    assert finish_reason(pair.C, "c1") == "length"
    pair.assert_no_leak()
