"""Layer-wise WRITE (``layerwise_write``): each layer's completed prompt blocks leave the
producer from ``save_kv_layer`` during its prefill, when the decode's block ids are known
early (router flow), and the WRITE invariants of docs/LIFECYCLE.md section 3 hold.

Real vLLM Schedulers and connector workers (harness.py), with the producer's stand-in
forward computing layer by layer and calling vLLM's per-layer hooks after each layer, as
``maybe_transfer_kv_layer`` does around real attention. The producer runs chunked
prefill (32 tokens per step, blocks of 16), so a prompt takes several steps.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from harness import Engine, Pair, ask_producer, free_port_base, kv_pattern, prompt_of, run_until
from kvtransport import Op
from kvtransport.testing.fault_controls import gate_posts
from kvtransport_vllm.config import ConnectorConfig, ConnectorConfigError
from kvtransport_vllm.connector import KVTransportConnector
from kvtransport_vllm.messages import Cancel, Reply
from vllm.v1.request import RequestStatus

SENTINEL = -7.0  # the stand-in model never writes a negative value
CHUNK = 32  # producer tokens per step (chunked prefill)


class LayeredEngine(Engine):
    """The harness engine whose stand-in forward runs layer after layer, calling
    ``wait_for_layer_load`` / ``save_kv_layer`` around each (vLLM's order)."""

    def _compute_kv(self, so: Any) -> None:
        meta = so.kv_connector_metadata
        for li, (name, t) in enumerate(self.kv_caches.items()):
            self.worker.wait_for_layer_load(name)
            for rid, n in so.num_scheduled_tokens.items():
                req = self.scheduler.requests[rid]
                start = self._before[rid]
                pos = torch.arange(start, start + n)
                all_tokens = torch.tensor(list(req.all_token_ids) + [0] * (start + n), dtype=torch.int64)
                blk = torch.tensor(self.scheduler.kv_cache_manager.get_block_ids(rid)[0], dtype=torch.int64)
                t[blk[pos // self.block_size], :, pos % self.block_size, :] = \
                    kv_pattern(all_tokens[start:start + n], pos, li)[:, None, None]
            if meta is not None:
                self.worker.save_kv_layer(name, t, None)


class LayerwisePair(Pair):
    """A WRITE pair whose producer has layerwise_write on and computes layer by layer."""

    def __init__(self, *, p_timeout_s: float = 10.0, c_timeout_s: float = 30.0, p_extra: dict | None = None,
                 policy: str = "recompute") -> None:
        base = free_port_base(8)
        common = {"backend": "loopback", "mode": "write", "lease_s": 60.0, "load_failure_policy": policy}
        self.p_port, self.c_port = base, base + 4
        self.P = LayeredEngine("kv_producer", {**common, "side_channel_port": base, "transfer_timeout_s": p_timeout_s,
                                               "layerwise_write": True, **(p_extra or {})},
                               engine_id="P", max_num_batched_tokens=CHUNK)
        try:
            self.C = Engine("kv_consumer", {**common, "side_channel_port": base + 4, "transfer_timeout_s": c_timeout_s},
                            engine_id="C")
        except BaseException:
            self.P.close()
            raise
        self.params: dict[str, dict] = {}


@pytest.fixture
def lw_pairs():
    made: list[LayerwisePair] = []

    def make(**kw) -> LayerwisePair:
        p = LayerwisePair(**kw)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


def _router_ids(pair: Pair, uuid: str) -> tuple[str, str]:
    rid = (f"___prefill_addr_host:127.0.0.1,handshake:{pair.p_port},notify:1"
           f"___decode_addr_host:127.0.0.1,handshake:{pair.c_port},notify:2_{uuid}")
    return "p-" + rid, "c-" + rid


def _decode_first(pair: Pair, c_rid: str, key: str, prompt: list[int]) -> None:
    """Router flow: the decode request first; step it until its block ids reached the
    producer (the producer remembers the destination before its prefill starts)."""
    pw = pair.P.worker._worker
    pair.C.add(c_rid, prompt, 2, {"do_remote_prefill": True})

    def dest_known() -> bool:
        with pw.ctx.lock:
            return key in pw.producer.early_dest and bool(pw.producer.consumer_md)

    run_until([pair.C], dest_known, timeout=20)
    assert pair.C.status(c_rid) == RequestStatus.WAITING_FOR_REMOTE_KVS


def _recvd(engine: Engine, rid: str) -> bool:
    return any(rid in (o.finished_recving or ()) or rid in (o.failed_recving or ()) for o in engine.kv_outputs)


def _may_land(pair: Pair) -> bool:
    """The producer's agent has a write that may still land (pending, or failed and not
    quiesced): the transport's own word, not the connector's bookkeeping."""
    st = pair.P.worker._worker.agent.stats()
    return st["pending"] > 0 or st["unquiesced"] > 0


def _settle_posts(pair: Pair, key: str, timeout: float = 20.0) -> None:
    """Progress the producer (no step) until no layer-wise write of ``key`` is in flight."""
    pw = pair.P.worker._worker
    end = time.monotonic() + timeout
    while True:
        pw.progress()
        with pw.ctx.lock:
            if not pw.layerwise.in_flight(key):
                return
        assert time.monotonic() < end, "layer-wise writes never ended (stuck, not slow)"
        time.sleep(0.002)


def _warm_up(pair: Pair) -> None:
    """One router-flow request end to end: the producer connects to the consumer's agent on
    its first write (layer-wise posts use that connection, never a first one)."""
    p_rid, c_rid = _router_ids(pair, "0000000000000000000000000000beef")
    prompt = prompt_of(40, seed=99)
    _decode_first(pair, c_rid, "0000000000000000000000000000beef", prompt)
    pair.P.add(p_rid, prompt, 1, {"do_remote_decode": True})
    pair.run(lambda: pair.C.status(c_rid) == RequestStatus.RUNNING, timeout=30)
    pair.drain(30)


# ---------------------------------------------------------------------------- bytes
@pytest.mark.parametrize("layers_per_post", [None, 2])
def test_layerwise_write_pushes_each_chunk_during_the_prefill_and_bytes_match(lw_pairs, layers_per_post):
    """Also with ``layerwise_layers_per_post`` 2: both layers in one post, from the second
    layer's hook; every layer's bytes still arrive during the prefill."""
    pair = lw_pairs(p_extra=None if layers_per_post is None else {"layerwise_layers_per_post": layers_per_post})
    _warm_up(pair)
    uuid = "00000000000000000000000000000a01"
    p_rid, c_rid = _router_ids(pair, uuid)
    prompt = prompt_of(100, seed=11)  # 7 blocks of 16, the last one partly filled; 4 chunks of 32
    _decode_first(pair, c_rid, uuid, prompt)
    assert pair.C.check_kv(c_rid, prompt, CHUNK) != [], "the consumer's blocks hold the KV before any push"
    pair.P.add(p_rid, prompt, 1, {"do_remote_decode": True})
    pw = pair.P.worker._worker

    posted_before = pw.agent.stats()["transfers_posted"]
    pair.P.step()  # first chunk: tokens 0..31, blocks 0 and 1 complete in every layer
    _settle_posts(pair, uuid)
    assert pair.P.status(p_rid) == RequestStatus.RUNNING, "the prefill is still running"
    assert uuid not in pw.producer.holds
    assert pw.agent.stats()["transfers_posted"] - posted_before == (2 if layers_per_post is None else 1)
    # what a user checks: the decode engine already has the first chunk's KV, every layer
    assert pair.C.check_kv(c_rid, prompt, CHUNK) == [], "first chunk's blocks not pushed during the prefill"
    assert not _recvd(pair.C, c_rid), "load reported before the prefill ended"

    pair.run(lambda: pair.C.status(c_rid) == RequestStatus.RUNNING, timeout=30)
    assert pair.C.check_kv(c_rid, prompt, len(prompt)) == []
    assert not any(o.invalid_block_ids for o in pair.C.kv_outputs)
    pair.drain(30)
    pair.assert_no_leak()
    # the producer's statistics time each request's push after its prefill (warm-up and this one)
    after = [v for o in pair.P.kv_outputs if o.kv_connector_stats is not None
             for v in o.kv_connector_stats.data["write_after_prefill_s"]]
    assert len(after) == 2 and min(after) >= 0.0


def test_destination_known_mid_prefill_gets_what_was_computed_then_the_rest(lw_pairs):
    """The decode's block ids reach the producer after its first chunk: the next step pushes
    that chunk's blocks too (push what is computed), then the rest as it is computed."""
    pair = lw_pairs()
    _warm_up(pair)
    uuid = "00000000000000000000000000000a05"
    p_rid, c_rid = _router_ids(pair, uuid)
    prompt = prompt_of(100, seed=15)
    pair.P.add(p_rid, prompt, 1, {"do_remote_decode": True})
    pair.P.step()  # first chunk computed, nobody to send it to yet
    _decode_first(pair, c_rid, uuid, prompt)
    pair.P.step()  # second chunk: blocks 2-3, and 0-1 computed before the destination was known
    _settle_posts(pair, uuid)
    assert pair.P.status(p_rid) == RequestStatus.RUNNING, "the prefill is still running"
    assert pair.C.check_kv(c_rid, prompt, 2 * CHUNK) == [], "blocks computed before the destination was known not pushed"
    pair.run(lambda: pair.C.status(c_rid) == RequestStatus.RUNNING, timeout=30)
    assert pair.C.check_kv(c_rid, prompt, len(prompt)) == []
    pair.drain(30)
    pair.assert_no_leak()


# ---------------------------------------------------------------------------- invariants
def test_written_waits_for_the_last_layers_posts_and_a_failed_post_is_sent_again(lw_pairs):
    """The last chunk's layer posts fail (they hang until the producer's transfer timeout):
    "written" must not be sent while they may land, and the whole request is then sent
    again, so the decode engine gets every byte. Sent "written" right after the prefill
    (before those posts ended) or counting a failed post as covering its blocks, the
    decode engine would run on a prompt whose last blocks never arrived."""
    pair = lw_pairs(p_timeout_s=1.5, p_extra={"backend_options": {"faults": {"seed": 1}}})
    _warm_up(pair)
    uuid = "00000000000000000000000000000a02"
    p_rid, c_rid = _router_ids(pair, uuid)
    prompt = prompt_of(70, seed=12)  # 5 blocks; chunks 0-31, 32-63, 64-69
    _decode_first(pair, c_rid, uuid, prompt)
    pair.P.add(p_rid, prompt, 1, {"do_remote_decode": True})
    pw = pair.P.worker._worker
    plan = pw.agent.faults.plan
    pair.P.step()
    pair.P.step()
    plan.ops, plan.hang_rate = frozenset({Op.WRITE}), 1.0
    try:
        pair.P.step()  # last chunk: every layer's post of blocks 4 (and 4 only) hangs
    finally:
        plan.hang_rate = 0.0
    assert _may_land(pair), "the last chunk's layer posts were not made"
    reported_while_in_flight = False
    end = time.monotonic() + 30
    while not _recvd(pair.C, c_rid):
        assert time.monotonic() < end, "load never ended"
        pair.P.step()
        pair.C.step()
        if _recvd(pair.C, c_rid):  # the load just ended: could a layer post still land?
            reported_while_in_flight = _may_land(pair)
        time.sleep(0.002)
    assert not reported_while_in_flight, "load reported done while a layer post could still land"
    pair.run(lambda: pair.C.status(c_rid) == RequestStatus.RUNNING, timeout=30)
    assert pair.C.first_start.get(c_rid) == len(prompt) - 1, "the load did not succeed (recomputed instead)"
    assert pair.C.check_kv(c_rid, prompt, len(prompt)) == [], "the decode engine lacks bytes of the prompt"
    pair.drain(30)
    pair.assert_no_leak()


def test_cancel_during_prefill_is_pending_while_a_layer_post_is_inside_the_backend(lw_pairs):
    """A Cancel reaching the producer while a layer post is being handed to the backend
    (no hold exists yet: the prefill runs) is not acked. Once acked, no later layer or
    chunk lands in the consumer's blocks, which it may have reused."""
    pair = lw_pairs(p_extra={"backend_options": {"faults": {"seed": 1}}})
    _warm_up(pair)
    uuid = "00000000000000000000000000000a03"
    p_rid, c_rid = _router_ids(pair, uuid)
    prompt = prompt_of(100, seed=13)
    _decode_first(pair, c_rid, uuid, prompt)
    blocks = pair.C.block_ids(c_rid)
    pair.P.add(p_rid, prompt, 1, {"do_remote_decode": True})
    pw = pair.P.worker._worker
    gate = gate_posts(pw.agent.faults, frozenset({Op.WRITE}))
    import threading

    stepped = threading.Thread(target=pair.P.step, name="producer-step", daemon=True)
    stepped.start()  # the engine thread blocks inside the first layer's post
    try:
        assert gate.entered.wait(30), "no layer post was made"
        during = ask_producer(pair, Cancel(keys=[uuid]))
    finally:
        gate.release()
    stepped.join(30)
    assert not stepped.is_alive()
    assert isinstance(during, Reply), during
    assert during.status[uuid] != "acked", "cancel acked while a layer post was inside the backend"
    _settle_posts(pair, uuid)
    after = ask_producer(pair, Cancel(keys=[uuid]))
    assert isinstance(after, Reply) and after.status[uuid] == "acked", after
    # the consumer may reuse its blocks now: the next request's KV (the sentinel) goes there
    for t in pair.C.kv_caches.values():
        t[torch.tensor(blocks)] = SENTINEL
    run_until([pair.P], lambda: pair.P.status(p_rid) is None, timeout=30)  # the rest of the prefill
    for _ in range(5):
        pair.P.worker._worker.progress()
    assert pw.agent.stats()["pending"] == 0
    intact = all(bool((t[torch.tensor(blocks)] == SENTINEL).all()) for t in pair.C.kv_caches.values())
    assert intact, "a layer-wise write landed in the consumer's blocks after its cancel was acked"
    pair.drain(30)
    pair.assert_no_leak()


def test_aborted_prefill_never_reports_written_and_the_consumer_waits_for_its_posts(lw_pairs):
    """The prefill is aborted while its first chunk's layer posts are in flight (they hang
    until the producer's transfer timeout): the decode engine's load fails (never
    "written"), and it gives its blocks back only once those posts can no longer land."""
    pair = lw_pairs(p_timeout_s=1.5, p_extra={"backend_options": {"faults": {"seed": 1}}})
    _warm_up(pair)
    uuid = "00000000000000000000000000000a04"
    p_rid, c_rid = _router_ids(pair, uuid)
    prompt = prompt_of(100, seed=14)
    _decode_first(pair, c_rid, uuid, prompt)
    pair.P.add(p_rid, prompt, 1, {"do_remote_decode": True})
    pw = pair.P.worker._worker
    plan = pw.agent.faults.plan
    plan.ops, plan.hang_rate = frozenset({Op.WRITE}), 1.0
    try:
        pair.P.step()
    finally:
        plan.hang_rate = 0.0
    assert _may_land(pair), "the first chunk's layer posts were not made"
    pair.P.abort(p_rid)
    ended_while_in_flight = False
    end = time.monotonic() + 30
    while not _recvd(pair.C, c_rid):
        assert time.monotonic() < end, "load never ended"
        pair.P.step()
        pair.C.step()
        if _recvd(pair.C, c_rid):  # the load just ended: could a layer post still land?
            ended_while_in_flight = _may_land(pair)
        time.sleep(0.002)
    assert not ended_while_in_flight, "consumer gave its blocks back while a layer post could still land"
    assert any(c_rid in (o.failed_recving or ()) for o in pair.C.kv_outputs), \
        "the load of an aborted prefill did not fail (was it told 'written'?)"
    pair.drain(30)
    assert pair.C.first_start.get(c_rid) == 0, "not recomputed after the aborted prefill"
    pair.assert_no_leak()


# ---------------------------------------------------------------------------- settings
def test_layerwise_write_is_off_by_default_and_refused_outside_write_mode(monkeypatch):
    monkeypatch.setenv("KVTRANSPORT_SECRET", "kvtransport-test-cluster-secret")
    def cfg(extra: dict) -> ConnectorConfig:
        return ConnectorConfig.from_extra("kv_producer", "P", {"side_channel_host": "127.0.0.1", **extra})

    assert cfg({"mode": "write"}).layerwise_write is False
    with pytest.raises(ConnectorConfigError, match="layerwise_write needs mode 'write'"):
        cfg({"mode": "read", "layerwise_write": True})
    with pytest.raises(ConnectorConfigError, match="kv_buffer_device 'cpu'"):
        cfg({"mode": "write", "layerwise_write": True, "kv_buffer_device": "cpu"})
    with pytest.raises(ConnectorConfigError, match="true or false"):
        cfg({"mode": "write", "layerwise_write": "yes"})
    assert KVTransportConnector.requires_piecewise_for_cudagraph({"layerwise_write": True}) is True
    assert KVTransportConnector.requires_piecewise_for_cudagraph({"mode": "write"}) is False
