"""WRITE: the consumer hears "written" when the write ends, not at the producer's next step.

A producer engine under load spends its steps in long prefill forwards; its engine thread
advances holds only between them. These tests stop stepping the producer right after it
posted a write (as if its next forward never ended) and check that the consumer's load
still completes with intact KV, or, for a failed write, is recomputed: the word comes from
the producer's notifier thread (written_notifier.py). Without that thread the consumer
never hears and the load waits for the producer's next step: both tests then fail.
"""

from kvtransport_vllm.hold import HoldState
from harness import finish_reason, prompt_of, run_until
from vllm.v1.request import RequestStatus


def _post_and_stop_the_producer(pair, prompt, rid="c1"):
    """Prefill on P, add the load on C, step C until P knows where to write, then make P's
    engine thread post the write once and never step P again. Returns P's hold."""
    params = pair.prefill("p1", prompt)
    producer = pair.P.worker._worker.producer
    run_until([pair.P], lambda: bool(producer.holds))  # the hold comes with P's next step
    pair.C.add(rid, prompt, 3, params)
    run_until([pair.C], lambda: any(h.dest is not None for h in producer.holds.values()))
    (hold,) = producer.holds.values()
    pair.P.worker._worker.progress()  # what the producer's step does before its forward
    assert hold.state is not HoldState.HELD, "the producer did not post the write"
    return hold


def test_load_completes_with_the_producer_engine_stopped_after_posting(pairs):
    """The write's completion is reported 0.5 s late (fault injection), so it is still in
    flight when the producer's engine thread returns from posting it."""
    pair = pairs("write", p_extra={"backend_options": {"faults": {"delay_s": 0.5, "seed": 1}}})
    prompt = prompt_of(70)
    _post_and_stop_the_producer(pair, prompt)
    kv = []

    def running():
        if pair.C.status("c1") == RequestStatus.RUNNING and not kv:
            kv.append(pair.C.check_kv("c1", prompt, len(prompt)))
        return bool(kv)

    run_until([pair.C], running, timeout=20.0)  # only the consumer steps
    assert kv == [[]], f"loaded KV differs from the producer's in blocks {kv}"
    assert pair.C.first_start.get("c1", 0) >= len(prompt) - 1, "the consumer recomputed instead of loading"
    pair.drain()
    assert finish_reason(pair.C, "c1") == "length"
    pair.assert_no_leak()


def test_failed_write_is_told_with_the_producer_engine_stopped(pairs):
    """A write that never completes (fault injection), failed at its 1 s deadline after the
    producer's engine thread returned from posting it, is told "written, failed" the same
    way: the consumer recomputes, nothing leaks."""
    pair = pairs("write", timeout_s=1.0, p_extra={"backend_options": {"faults": {"hang_rate": 1.0, "seed": 1}}})
    prompt = prompt_of(70)
    _post_and_stop_the_producer(pair, prompt)
    run_until([pair.C], lambda: pair.C.first_start.get("c1") is not None, timeout=20.0)  # only the consumer
    seen = pair.run_to_end_checking_kv("c1", prompt)
    pair.assert_recomputed("c1", prompt, seen)
    pair.drain()
    pair.assert_no_leak()
