"""The hand-shake's compatibility check (issue 14, points 5 and 6; acceptance 5).

Unit level: every compared field refused with both values and the fix; what is allowed
across TP sizes. Scheduler level (real Schedulers, one worker per rank): an incompatible
producer (another model, dtype, a tokens-outer KV layout across TP sizes) is refused at
the hand-shake, the request fails or is recomputed per policy long before the transfer
deadline, the refusal is logged once per peer, and the decode engine keeps serving.
"""

from __future__ import annotations

import logging
import re
import time

import pytest
import torch

from harness import free_port_base, prompt_of
from kvtransport_vllm.compat import refusal
from kvtransport_vllm.kv_layout import AMBIGUOUS, HEADS_OUTER, KV_OUTER, TOKENS_OUTER, describe_kv_caches
from kvtransport_vllm.messages import LayoutInfo
from tp_harness import TPEngine, run_until
from vllm.v1.request import RequestStatus


def _info(**kw) -> LayoutInfo:
    base = dict(block_size=16, dtype="float32", num_layers=2, block_bytes=4 * 16 * 32 * 4, parts_per_layer=1,
                tp_size=1, model="m", model_dtype="float32", total_kv_heads=4, kv_heads=4, head_size=16,
                attn_layout=HEADS_OUTER)
    base.update(kw)
    return LayoutInfo(**base)


@pytest.mark.parametrize("field, a, b, fix", [
    ("model", "llama-a", "llama-b", "--served-model-name"),
    ("model_dtype", "float32", "bfloat16", "--dtype"),
    ("dtype", "float32", "fp8_e4m3", "--kv-cache-dtype"),
    ("block_size", 16, 24, "--block-size"),
    ("num_layers", 2, 3, "same model"),
    ("head_size", 16, 32, "same model"),
    ("total_kv_heads", 4, 8, "same model"),
    ("attn_layout", HEADS_OUTER, TOKENS_OUTER, "same attention backend"),
])
def test_each_difference_is_named_with_both_values_and_the_fix(field, a, b, fix):
    why = refusal(_info(**{field: a}), _info(**{field: b}), "decode", "prefill")
    assert f"{field}: decode {a!r} vs prefill {b!r}" in why and fix in why, why
    assert refusal(_info(**{field: a}), _info(**{field: a})) == ""


def test_block_sizes_that_divide_one_another_pair_by_token_position():
    """16 and 32 tokens a block (the same bytes per token) pair; the bytes per token must
    still agree, and the tokens must lie in one range per head or per block."""
    gpu = dict(attn_backends=["FLASH_ATTN"])
    b16, b32 = _info(**gpu), _info(block_size=32, block_bytes=2 * _info().block_bytes, **gpu)
    assert refusal(b16, b32) == refusal(b32, b16) == ""
    tp2 = _info(block_size=32, tp_size=2, kv_heads=2, block_bytes=b16.block_bytes, **gpu)  # half the heads
    assert refusal(b16, tp2) == refusal(tp2, b16) == ""
    assert "8192 per 16 tokens vs prefill 8192 per 32" in refusal(b16, _info(block_size=32, **gpu), "decode", "prefill")
    for layout in (KV_OUTER, AMBIGUOUS):
        why = refusal(_info(attn_layout=layout, **gpu), _info(attn_layout=layout, block_size=32,
                                                               block_bytes=b32.block_bytes, **gpu), "decode", "prefill")
        assert "block_size: decode 16 vs prefill 32" in why and f"KV layout is {layout}" in why, why
    # vLLM's CPU backend packs keys per instruction set; an unknown backend is not guessed
    for backends, named in ((["CPU_ATTN"], "CPU_ATTN does not keep each token as a row"), ([], "not known")):
        why = refusal(b16, _info(block_size=32, block_bytes=b32.block_bytes, attn_backends=backends),
                      "decode", "prefill")
        assert "prefill's blocks cannot be paired by token position" in why and named in why, why
        assert "same --block-size" in why


def test_unknown_fields_are_not_compared():
    """A worker built without a model config (tools) says "" / 0: nothing to compare."""
    assert refusal(_info(model=""), _info(model="x")) == ""
    assert refusal(_info(total_kv_heads=0, kv_heads=0, head_size=0), _info()) == ""


def test_tp_sizes_may_differ_when_heads_map_and_slices_are_byte_ranges():
    tp1 = _info()
    tp2 = _info(tp_size=2, kv_heads=2, block_bytes=tp1.block_bytes // 2)
    tp4 = _info(tp_size=4, kv_heads=1, block_bytes=tp1.block_bytes // 4)
    assert refusal(tp1, tp2) == refusal(tp2, tp4) == refusal(tp4, tp1) == ""
    # replicated: 2 heads on TP 4 (one head per rank) against TP 1
    h2 = _info(total_kv_heads=2, kv_heads=2, block_bytes=tp1.block_bytes // 2)
    h2tp4 = _info(total_kv_heads=2, tp_size=4, kv_heads=1, block_bytes=tp1.block_bytes // 4)
    assert refusal(h2, h2tp4) == ""


def test_tp_difference_refused_for_a_tokens_outer_layout_that_must_be_sliced():
    """FlashAttention's layout keeps all heads inside each token: the side with more heads
    per rank cannot hand out (or take in) a head range as one byte range per block."""
    flash1 = _info(attn_layout=TOKENS_OUTER, parts_per_layer=2)
    flash2 = _info(attn_layout=TOKENS_OUTER, parts_per_layer=2, tp_size=2, kv_heads=2,
                   block_bytes=flash1.block_bytes // 2)
    why = refusal(flash2, flash1, "decode", "prefill")
    assert "tp_size: decode 2 vs prefill 1" in why and "the prefill's KV layout is tokens-outer" in why, why
    assert "equal TP sizes" in why
    assert refusal(flash1, _info(attn_layout=TOKENS_OUTER, parts_per_layer=2)) == ""  # same TP still works
    amb = refusal(_info(attn_layout=AMBIGUOUS, tp_size=2, kv_heads=2, block_bytes=flash1.block_bytes // 2),
                  _info(attn_layout=AMBIGUOUS, kv_heads=4), "decode", "prefill")
    assert "prefill's KV layout is ambiguous" in amb


def test_tp_difference_refused_when_heads_do_not_split_or_are_unknown():
    six = _info(total_kv_heads=6, kv_heads=6)
    why = refusal(six, _info(total_kv_heads=6, kv_heads=1, tp_size=4), "decode", "prefill")
    assert "prefill TP size 4 does not split 6 KV heads evenly" in why, why
    why = refusal(_info(total_kv_heads=0, kv_heads=0), _info(tp_size=2, kv_heads=2), "decode", "prefill")
    assert "tp_size: decode 1 vs prefill 2" in why and "did not say its KV head count" in why


def test_attn_layout_from_tensor_shapes():
    """CPU backend [blocks, heads, block_size, 2*head_size]: heads outside tokens;
    FlashAttention [2, blocks, block_size, heads, head_size]: tokens outside heads."""
    cpu = {"l0": torch.zeros(8, 4, 16, 32)}
    flash = {"l0": torch.zeros(2, 8, 16, 4, 16)}
    assert describe_kv_caches(cpu, 8, kv_heads=4, block_size=16)[0].attn_layout == HEADS_OUTER
    assert describe_kv_caches(flash, 8, kv_heads=4, block_size=16)[0].attn_layout == TOKENS_OUTER
    assert describe_kv_caches({"l0": torch.zeros(8, 16, 16, 32)}, 8, 16, 16)[0].attn_layout == AMBIGUOUS
    assert describe_kv_caches(flash, 8)[0].attn_layout == ""  # heads not given
    # FlashInfer HND by stride: [blocks, 2, heads, block_size, head_size]
    assert describe_kv_caches({"l0": torch.zeros(8, 2, 4, 16, 16)}, 8, 4, 16)[0].attn_layout == KV_OUTER
    assert describe_kv_caches({"l0": torch.zeros(8, 2, 2, 16, 16)}, 8, 2, 16)[0].attn_layout == AMBIGUOUS


# ---------------------------------------------------------------------- Scheduler level

def _pair(mode: str, p: int, d: int, *, c_model: str | None = None, c_dtype: str | None = None,
          policy: str = "fail"):
    base = free_port_base(16)
    common = {"backend": "loopback", "mode": mode, "transfer_timeout_s": 30.0, "lease_s": 60.0,
              "side_channel_host": "127.0.0.1"}
    P = TPEngine("kv_producer", {**common, "side_channel_port": base}, tp=p, total_kv_heads=4, engine_id="P")
    try:
        C = TPEngine("kv_consumer", {**common, "side_channel_port": base + 8}, tp=d, total_kv_heads=4,
                     engine_id="C", policy=policy, served_model_name=c_model, dtype=c_dtype)
    except BaseException:
        P.close()
        raise
    return P, C


@pytest.mark.parametrize("what", ["model", "dtype"])
@pytest.mark.parametrize("mode", ["read", "write"])
def test_incompatible_peer_refused_fast_logged_once_engine_keeps_serving(caplog, mode, what):
    caplog.set_level(logging.DEBUG, logger="kvtransport_vllm.producer_peers")
    kw = {"c_model": "another-model"} if what == "model" else {"c_dtype": "bfloat16"}
    P, C = _pair(mode, 2, 1, **kw)
    try:
        for i in range(2):
            prompt = prompt_of(48, seed=40 + i)
            params: dict = {}
            P.add(f"p{i}", prompt, 1, {"do_remote_decode": True})
            run_until([P], lambda: f"p{i}" in params, on_params=params.update)
            deadlines: list[float] = []
            real_add = C.workers[0]._worker.consumer.add

            def add(jobs, now, real=real_add):
                real(jobs, now)
                deadlines.extend(now + C.workers[0]._worker.cfg.transfer_timeout_s for _ in jobs)

            C.workers[0]._worker.consumer.add = add
            C.add(f"c{i}", prompt, 2, params[f"p{i}"])
            run_until([P, C], lambda: f"c{i}" not in C.scheduler.requests)
            assert C.finish_reason(f"c{i}") == "error"  # policy fail, no byte moved
            assert deadlines and time.monotonic() < deadlines[0], "refusal waited for the transfer deadline"
        errors = [r.getMessage() for r in caplog.records
                  if r.name == "kvtransport_vllm.producer_peers" and r.levelno == logging.ERROR]
        assert len(errors) == 2, errors  # once per producer rank (peer), not once per request
        # named by whichever side refused first (both check): both values, either order
        a, b = ("model", "'another-model'") if what == "model" else ("model_dtype", "'bfloat16'")
        want = re.compile(rf"{a}: (decode {b} vs prefill '[^']+'|prefill '[^']+' vs decode {b})")
        assert all(want.search(m) for m in errors), errors
        # the decode engine keeps serving: a local request runs to the end
        C.add("local", prompt_of(20, seed=9), 3, None)
        run_until([P, C], lambda: "local" not in C.scheduler.requests)
        assert C.finish_reason("local") == "length"
        run_until([P, C], lambda: not P.scheduler.requests and all(not w._worker.producer.holds for w in P.workers))
        assert P.free_blocks() == P.free0 and C.free_blocks() == C.free0
        assert C.counter("bytes") == P.counter("bytes") == C.counter("transfers") == 0, "bytes moved"
    finally:
        P.close()
        C.close()


def test_decode_status_while_refused_is_never_running_before_failure():
    """R1 holds through a refusal: the request never runs on KV that did not arrive."""
    P, C = _pair("read", 1, 2, c_model="x", policy="recompute")
    try:
        prompt = prompt_of(40, seed=5)
        params: dict = {}
        P.add("p", prompt, 1, {"do_remote_decode": True})
        run_until([P], lambda: "p" in params, on_params=params.update)
        C.add("c", prompt, 2, params["p"])
        statuses = []
        run_until([P, C], lambda: statuses.append(C.status("c")) or "c" not in C.scheduler.requests)
        first_run = statuses.index(RequestStatus.RUNNING)
        assert RequestStatus.WAITING_FOR_REMOTE_KVS in statuses[:first_run]
        assert C.first_start["c"] == 0  # recomputed from token 0
    finally:
        P.close()
        C.close()


def test_router_dropping_tp_size_is_refused_naming_the_key(caplog):
    """Without ``tp_size`` the decode engine assumes its own TP size; a prefill engine of
    another size is refused at the hand-shake (no byte moves), naming the key to forward."""
    caplog.set_level(logging.WARNING, logger="kvtransport_vllm.consumer")
    P, C = _pair("read", 2, 1, policy="recompute")
    try:
        prompt = prompt_of(48, seed=6)
        params: dict = {}
        P.add("p", prompt, 1, {"do_remote_decode": True})
        run_until([P], lambda: "p" in params, on_params=params.update)
        dropped = {k: v for k, v in params["p"].items() if k != "tp_size"}
        C.add("c", prompt, 2, dropped)
        run_until([P, C], lambda: "c" not in C.scheduler.requests)
        assert C.finish_reason("c") == "length" and C.first_start["c"] == 0  # recomputed
        why = [r.getMessage() for r in caplog.records if "load of request c " in r.getMessage()]
        assert len(why) == 1 and "has tp_size 2 but kv_transfer_params said nothing" in why[0], why
        assert "forward the producer's tp_size" in why[0]
        assert C.counter("bytes") == 0
        # both prefill ranks freed the prompt's blocks at once (the lease is far longer)
        run_until([P, C], lambda: not P.scheduler.requests)
        assert P.free_blocks() == P.free0 and C.free_blocks() == C.free0
    finally:
        P.close()
        C.close()
