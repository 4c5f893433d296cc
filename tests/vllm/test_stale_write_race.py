"""The stale-write race (issue 12, point 1), made deterministic.

WRITE mode: the producer posts its write into the consumer's blocks. A backend may spend
a long time inside ``post`` (UCX drives its worker there for milliseconds). If the
producer answered a consumer's Cancel during that window with "acked", the consumer would
hand its blocks back to vLLM and the write would then land in them: another request's KV,
silently wrong output.

Here the producer's backend (through the fault wrapper's gate) blocks inside ``post``
until the test releases it; real bytes move through the real loopback backend
afterwards. While the post is blocked:

* the consumer gives up (its request is aborted): its Cancel must not be acked, and it
  must not report the blocks free;
* an authentic peer sends Cancel / Release / Aborted for the key: none is acked and the
  producer keeps its hold (its source blocks are being read by the write).

After the write ends, no byte has landed in blocks the consumer was told it could reuse:
those blocks are filled with a sentinel the moment they are handed back, and the sentinel
is checked once the producer's write has ended.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from harness import ask_producer, prompt_of
from kvtransport import Op
from kvtransport.testing.fault_controls import gate_posts
from kvtransport_vllm.messages import Aborted, Cancel, Release, Reply

SENTINEL = -7.0  # the stand-in model never writes a negative value
FAULTS = {"backend_options": {"faults": {"seed": 1}}}  # no random faults: only the gate


class _ProducerLoop:
    """Steps the producer engine on its own thread (its step blocks inside the gated post,
    as vLLM's engine loop would), until stopped."""

    def __init__(self, pair) -> None:
        self.pair = pair
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="producer-steps", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while not self.stop.is_set():
                self.pair.params.update(self.pair.P.step())
                self.stop.wait(0.002)  # pacing only: the engine loop never idles hot
        except BaseException as exc:  # reported by join()
            self.error = exc

    def join(self) -> None:
        self.stop.set()
        self.thread.join(30)
        assert not self.thread.is_alive(), "producer step thread did not stop"
        if self.error is not None:
            raise self.error


def _sent(engine, rid: str) -> bool:
    return any(rid in (o.finished_sending or ()) for o in engine.kv_outputs)


def _recvd(engine, rid: str) -> bool:
    return any(rid in (o.finished_recving or ()) for o in engine.kv_outputs)


def _step_c_until(pair, cond, timeout: float = 20.0) -> None:
    """Step the consumer (only: the producer steps on its own thread) until ``cond()``."""
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached (the test is stuck, not slow)"
        pair.C.step()
        time.sleep(0.002)


def _start_gated_write(pair, prompt):
    """Prefill on P, arm the gate, start the load on C; returns when the producer's write
    is blocked inside post (and the consumer's blocks)."""
    params = pair.prefill("p1", prompt)
    gate = gate_posts(pair.P.worker._worker.agent.faults, frozenset({Op.WRITE}))
    loop = _ProducerLoop(pair)
    pair.C.add("c1", prompt, 3, params)
    _step_c_until(pair, gate.entered.is_set)
    return params, gate, loop


def _request(pair, msg) -> Reply:
    """Send ``msg`` to the producer as an authentic peer; its reply, which must be a Reply."""
    reply = ask_producer(pair, msg)
    assert isinstance(reply, Reply), reply
    return reply


def test_consumer_cancel_while_post_blocks_is_not_acked_and_nothing_lands_in_freed_blocks(pairs):
    pair = pairs("write", policy="recompute", timeout_s=30.0, lease_s=60.0, p_extra=FAULTS)
    prompt = prompt_of(50, seed=61)
    cw = pair.C.worker._worker
    params, gate, loop = _start_gated_write(pair, prompt)
    key = params["transfer_id"]
    blocks = pair.C.block_ids("c1")
    assert blocks

    # Every answer the producer gives the consumer's Cancel for this key ("pending" or
    # "acked"; a lease renewal's "ok" is no answer to it), and whether it came while the
    # producer's post was still blocked.
    seen: list[tuple[str, bool]] = []
    real_reply = cw.consumer.on_reply

    def record(msg):
        if isinstance(msg, Reply) and msg.status.get(key) in ("pending", "acked"):
            seen.append((msg.status[key], not gate.passed.is_set()))
        return real_reply(msg)

    cw.consumer.on_reply = record
    handed_back = False
    handed_back_while_posting = False

    def hand_back_if_reported() -> bool:
        """When the consumer reports the load ended, its blocks go back to vLLM: fill them
        with the sentinel, as the next request's KV would."""
        nonlocal handed_back, handed_back_while_posting
        if not _recvd(pair.C, "c1"):
            return False
        if not handed_back:
            handed_back = True
            handed_back_while_posting = not gate.passed.is_set()
            for t in pair.C.kv_caches.values():
                t[torch.tensor(blocks)] = SENTINEL
        return True

    try:
        pair.C.abort("c1")  # the consumer gives up while the write is blocked in post
        # The consumer cancels, and keeps cancelling until acked: wait until it has heard
        # the producer answer at least twice while the post is blocked (or was told it may
        # reuse its blocks, which is the bug).
        _step_c_until(pair, lambda: hand_back_if_reported()
                      or sum(during for _, during in seen) >= 2)
        answers_while_posting = [s for s, during in seen if during]
    finally:
        gate.release()
    try:
        assert gate.passed.wait(30), "the gated post never returned"
        pw = pair.P.worker._worker
        # The write has ended (nothing pending or unquiesced at the producer's agent) and
        # the consumer has been told it may reuse its blocks.
        _step_c_until(pair, lambda: hand_back_if_reported() and pw.agent.stats()["pending"] == 0
                      and pw.agent.stats()["unquiesced"] == 0)
    finally:
        loop.join()
    assert not gate.timed_out
    intact = all(bool((t[torch.tensor(blocks)] == SENTINEL).all()) for t in pair.C.kv_caches.values())
    assert intact, (f"the producer's write landed in consumer blocks {blocks} after the consumer was told it "
                    f"could reuse them (answers to its Cancel while the post was blocked: {answers_while_posting})")
    assert not handed_back_while_posting, "consumer freed its blocks while the producer's write was being posted"
    assert answers_while_posting and "acked" not in answers_while_posting, answers_while_posting
    pair.drain()
    pair.assert_no_leak()
    assert sum("c1" in (o.finished_recving or ()) for o in pair.C.kv_outputs) == 1


@pytest.mark.parametrize("kind", [Cancel, Release, Aborted])
def test_give_up_messages_while_post_blocks_keep_the_hold(pairs, kind):
    """Cancel / Release / Aborted reaching the producer while its write is inside post: no
    ack, the hold (whose blocks the write reads) stays; once the write ends the load
    completes normally, with the producer's bytes."""
    pair = pairs("write", policy="recompute", timeout_s=30.0, lease_s=60.0, p_extra=FAULTS)
    prompt = prompt_of(50, seed=62)
    params, gate, loop = _start_gated_write(pair, prompt)
    key = params["transfer_id"]
    pw = pair.P.worker._worker
    try:
        reply = _request(pair, kind(keys=[key]))
        still_held = key in pw.producer.holds
    finally:
        gate.release()
    try:
        assert gate.passed.wait(30), "the gated post never returned"
        _step_c_until(pair, lambda: _recvd(pair.C, "c1") and _sent(pair.P, "p1"))
    finally:
        loop.join()
    assert not gate.timed_out
    assert reply.status[key] != "acked", f"{kind.__name__} acked while the write was being posted"
    assert still_held, f"{kind.__name__} ended the hold while its write was being posted"
    pair.run(lambda: pair.C.status("c1") is not None and pair.C.status("c1").name == "RUNNING")
    assert pair.C.check_kv("c1", prompt, len(prompt) - 1) == []
    assert not any(o.invalid_block_ids for o in pair.C.kv_outputs)
    pair.drain()
    pair.assert_no_leak()


def test_write_in_flight_past_lease_and_deadline_keeps_the_consumer_blocks(pairs):
    """A producer that stays reachable and answers "pending" to the consumer's cancel (its
    write is still in flight) past the consumer's deadline + lease + transfer timeout: the
    consumer keeps its blocks until the write has ended. Its "considered gone" rule counts
    from the producer's last answer; it used to count from the deadline and handed the
    blocks back to vLLM while the write could still land in them (found from a soak I5
    failure: two requests' blocks held wrong bytes)."""
    pair = pairs("write", policy="recompute", timeout_s=0.5, lease_s=1.0, p_extra=FAULTS)
    prompt = prompt_of(50, seed=62)
    params, gate, loop = _start_gated_write(pair, prompt)
    blocks = pair.C.block_ids("c1")
    freed_while_posting = False
    try:
        pair.C.abort("c1")  # the consumer gives up while the write is blocked in post
        # step the consumer to twice deadline + lease + timeout (2 s here), the post held
        end = time.monotonic() + 4.0
        while time.monotonic() < end and not freed_while_posting:
            pair.C.step()
            freed_while_posting = _recvd(pair.C, "c1") and not gate.passed.is_set()
            time.sleep(0.005)
    finally:
        gate.release()
        assert gate.passed.wait(30), "the gated post never returned"
    try:
        # the write has ended: the producer acks, the load ends and the blocks go back
        _step_c_until(pair, lambda: _recvd(pair.C, "c1"))
    finally:
        loop.join()
    assert not freed_while_posting, f"consumer freed blocks {blocks} while the producer's write was still being posted"
    assert not gate.timed_out
    pair.drain()
    pair.assert_no_leak()
