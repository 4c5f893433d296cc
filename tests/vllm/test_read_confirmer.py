"""READ: the load is confirmed with the producer when the read ends, not at the decode's next step.

A decode engine under load spends its steps in long forwards; its engine thread advances
loads only between them. This test stops stepping the consumer right after it posted its
READ (as if its next forward never ended) and checks that the load settles meanwhile (read,
confirmed by the producer under its lease, handed to ``done_recving``), and that the next
step then reports it with the producer's KV: the work of the consumer's read-confirmer
thread (read_confirmer.py). Without that thread nothing happens until the consumer steps
again and the test fails. A confirmation the producer refuses is handed to the engine
thread (test_lease_renewal.py: the renew-dropped control and the stalled consumer).
"""

import time

from kvtransport_vllm.load_stats import Cause
from kvtransport_vllm.recv import RecvState
from harness import finish_reason, prompt_of, run_until
from vllm.v1.request import RequestStatus


def test_read_settles_with_the_consumer_engine_stopped_after_posting(pairs):
    """The read's completion is reported 0.5 s late (fault injection), so it is still in
    flight when the consumer's engine thread returns from posting it."""
    pair = pairs("read", c_extra={"backend_options": {"faults": {"delay_s": 0.5, "seed": 2}}})
    prompt = prompt_of(70)
    params = pair.prefill("p1", prompt)
    pair.C.add("c1", prompt, 3, params)
    consumer = pair.C.worker._worker.consumer
    lock = pair.C.worker._worker.ctx.lock

    def reading() -> bool:
        with lock:
            return any(r.state is RecvState.READ for r in consumer.recv.values())

    run_until([pair.P, pair.C], reading)  # the READ is posted; neither engine steps from here
    guard = time.monotonic() + 20.0  # a hang guard, not a timing bound
    while True:  # waiting on the confirmer thread, the only one moving now
        with lock:
            settled = "c1" in consumer.done_recving
            outcome = consumer.reporting["c1"].cause if settled else None
        if settled:
            break
        assert time.monotonic() < guard, "the load did not settle while the consumer engine was stopped"
        time.sleep(0.005)
    assert outcome is Cause.OK, f"the load settled as {outcome}"
    run_until([pair.C], lambda: pair.C.status("c1") == RequestStatus.RUNNING)
    assert pair.C.check_kv("c1", prompt, len(prompt)) == [], "loaded KV differs from the producer's"
    assert pair.C.first_start.get("c1", 0) >= len(prompt) - 1, "the consumer recomputed instead of loading"
    pair.drain()
    assert finish_reason(pair.C, "c1") == "length"
    pair.assert_no_leak()


def test_reads_are_confirmed_by_the_engine_thread_once_the_confirmer_is_gone(pairs):
    """While the confirmer runs, the engine thread leaves a read's end to it; with the thread
    gone (stopped here as an error would stop it) the engine thread confirms the reads itself
    at its steps, so no load is stranded: the load still settles with the producer's KV."""
    pair = pairs("read")
    pair.C.worker._worker._confirmer.close()
    prompt = prompt_of(70)
    params = pair.prefill("p1", prompt)
    pair.C.add("c1", prompt, 3, params)
    run_until([pair.P, pair.C], lambda: pair.C.status("c1") == RequestStatus.RUNNING)
    assert pair.C.check_kv("c1", prompt, len(prompt)) == [], "loaded KV differs from the producer's"
    assert pair.C.first_start.get("c1", 0) >= len(prompt) - 1, "the consumer recomputed instead of loading"
    pair.drain()
    assert finish_reason(pair.C, "c1") == "length"
    pair.assert_no_leak()
