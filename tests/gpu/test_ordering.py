"""Issue 16 point 3: a hold or WRITE starts only after the device stream finished the KV.

The worker's ordering point is :meth:`KVDevice.before_send`, called in ``on_metadata``
before any new hold exists (so before a WRITE of its blocks can be posted or a Done for it
be answered). For a GPU cache it synchronizes the device's current stream, the one
vLLM's forward enqueued the KV writes on. No GPU here: the stream is a RECORDING stand-in
(injected through ``DirectDeviceKV(stream_of=...)``) that snapshots the producer's state
at each ``synchronize()``; the holds and writes are real (real vLLM Schedulers, loopback).
"""
from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("torch")
from kvtransport_vllm.staging import DirectDeviceKV, HostKV  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "vllm"))
os.environ.setdefault("KVTRANSPORT_SECRET", "kvtransport-test-cluster-secret")


class RecordingStream:
    """Stand-in for torch.cuda.current_stream(device): records each synchronize() with the
    producer's holds and posted writes at that moment."""

    def __init__(self, events: list, producer) -> None:
        self.events, self.producer = events, producer

    def synchronize(self) -> None:
        self.events.append(("sync", set(self.producer.holds), None))


@pytest.fixture
def pair_factory():
    from harness import Pair

    made = []

    def make(*a, **kw):
        made.append(Pair(*a, **kw))
        return made[-1]

    yield make
    for p in made:
        p.close()


def _instrument(pair):
    """Give the producer a 'device' cache with a recording stream; record every WRITE."""
    w = pair.P.worker._worker
    assert isinstance(w.kv_device, HostKV)  # CPU engine: no synchronisation at all
    events: list = []
    streams: list = []

    def stream_of(device):
        streams.append(device)
        return RecordingStream(events, w.producer)

    w.kv_device = DirectDeviceKV("cuda:0", stream_of=stream_of)
    agent = w.ctx.agent
    real_write = agent.write

    def write(peer, local, remote, **kw):
        events.append(("write", set(w.producer.holds), None))
        return real_write(peer, local, remote, **kw)

    agent.write = write
    return events, streams


@pytest.mark.parametrize("mode", ["read", "write"])
def test_holds_and_writes_start_after_the_device_stream_is_synchronized(pair_factory, mode):
    from harness import finish_reason, prompt_of

    pair = pair_factory(mode)
    events, streams = _instrument(pair)
    for i, n in enumerate((70, 40)):
        prompt = prompt_of(n, seed=11 + i)
        params = pair.prefill(f"p{i}", prompt)
        key = params.get("transfer_id")
        pair.C.add(f"c{i}", prompt, 2, params)
        seen = pair.run_to_end_checking_kv(f"c{i}", prompt)
        assert seen == [[]] and finish_reason(pair.C, f"c{i}") == "length"
        # the hold for this key appeared only after a synchronize that saw it absent
        syncs = [j for j, (what, holds, _) in enumerate(events) if what == "sync" and key not in holds]
        held = [j for j, (_, holds, _) in enumerate(events) if key in holds]
        assert syncs, f"no stream synchronize before the hold {key} started: {events}"
        if mode == "write":
            writes = [j for j, (what, holds, _) in enumerate(events) if what == "write" and key in holds]
            assert writes and min(syncs) < writes[0], events
        if held:
            assert min(syncs) < held[0], events
    assert streams and all(d == "cuda:0" for d in streams)
    pair.drain()
    pair.assert_no_leak()
    # one synchronize per step that brought holds, never on steps without any
    assert sum(1 for e in events if e[0] == "sync") == 2


def test_direct_device_synchronizes_only_when_there_is_something_to_send():
    calls = []

    class S:
        def synchronize(self):
            calls.append(1)

    d = DirectDeviceKV("cuda:1", stream_of=lambda dev: S())
    d.before_send([])
    d.after_receive([1, 2])  # transport completion already means the device holds the bytes
    assert calls == []
    d.before_send([4])
    assert calls == [1]
