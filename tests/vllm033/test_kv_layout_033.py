"""The KV cache layout under vLLM 0.33 (issue: GPU deployments, acceptance 2).

1. With vLLM 0.33's own resolution code and FlashAttention's supported layouts, the layout
   vLLM applies for our connector's config is the one we request: heads outside tokens
   (LBHNC) by default, cross-layer blocks (BLHNC) on request, vLLM's own default (LBNHC)
   when asked for nothing or for an MLA model.
2. Prefill/decode pairs of TP 2->1 and 1->2 move byte-exact KV (every head slice of every
   prompt block equal to what the prefill ranks computed) between per-layer tensors that
   vLLM 0.33's planner and allocator lay out for FlashAttention under that layout (CPU
   memory), with real Schedulers and our real workers (engine033.FlashEngine033).
3. With cross-layer blocks a load hands the backend at most one byte range per run of
   consecutive blocks (so at most the number of blocks), counted after the core's merging,
   i.e. what reaches the backend's post.
"""

from __future__ import annotations

import logging

import pytest
import torch
from engine033 import FlashEngine033, resolve_layout
from harness import free_port_base, prompt_of
from test_hetero_tp import _assert_nothing_left, _load_exact, _prefill, _run_load
from tp_harness import HEAD_SIZE, NUM_LAYERS, mla_model_dir, model_dir
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

from kvtransport_vllm.config import ConnectorConfigError
from kvtransport_vllm.plugin import register


@pytest.fixture(autouse=True)
def _no_layout_override(monkeypatch):
    """vLLM's operator override must not decide what these tests check (set where a test
    means it)."""
    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)


def _vllm_config(extra: dict | None, *, mla: bool = False) -> VllmConfig:
    register()
    mc = ModelConfig(model=mla_model_dir() if mla else model_dir(4), skip_tokenizer_init=True, dtype="float32",
                     seed=0, max_model_len=2048)
    ktc = KVTransferConfig(kv_connector="KVTransportConnector", kv_role="kv_consumer", engine_id="L",
                           kv_connector_extra_config=dict(extra or {}))
    sc = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=2048, is_encoder_decoder=False)
    return VllmConfig(model_config=mc, scheduler_config=sc, cache_config=CacheConfig(block_size=16),
                      kv_transfer_config=ktc, device_config=DeviceConfig("cpu"))


LAYOUT_CASES = [
    # (extra config, MLA model, layout vLLM 0.33 applies with FlashAttention)
    ({}, False, "LBHNC"),
    ({"kv_cache_layout": "heads_outer"}, False, "LBHNC"),
    ({"kv_cache_layout": "cross_layer"}, False, "BLHNC"),
    ({"kv_cache_layout": "vllm"}, False, "LBNHC"),
    ({}, True, "LBNHC"),
]


@pytest.mark.parametrize("extra, mla, want", LAYOUT_CASES,
                         ids=["default", "heads_outer", "cross_layer", "vllm", "mla"])
def test_vllm_applies_the_layout_we_request(extra, mla, want):
    cfg = _vllm_config(extra, mla=mla)
    spec = (MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=48, dtype=torch.float32) if mla
            else FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=HEAD_SIZE, dtype=torch.float32))
    assert resolve_layout(cfg, [spec]).name == want
    assert cfg.cache_config.get_resolved_kv_cache_layout().name == want  # what every worker allocates with


def test_bad_layout_setting_fails_start_up_naming_the_choices():
    with pytest.raises(ConnectorConfigError, match=r"kv_cache_layout must be one of \['cross_layer', "
                                                   r"'heads_outer', 'vllm'\], got 'HND'"):
        resolve_layout(_vllm_config({"kv_cache_layout": "HND"}), [
            FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=HEAD_SIZE, dtype=torch.float32)])


def _pair(mode: str, p: int, d: int, heads: int = 4, p_block: int = 16, d_block: int = 16):
    base = free_port_base(16)
    common = {"backend": "loopback", "mode": mode, "transfer_timeout_s": 10.0, "lease_s": 120.0,
              "side_channel_host": "127.0.0.1"}
    P = FlashEngine033("kv_producer", {**common, "side_channel_port": base}, tp=p, total_kv_heads=heads,
                       engine_id="P", block_size=p_block)
    try:
        C = FlashEngine033("kv_consumer", {**common, "side_channel_port": base + 8}, tp=d, total_kv_heads=heads,
                           engine_id="C", block_size=d_block)
    except BaseException:
        P.close()
        raise
    return P, C


@pytest.mark.parametrize("mode", ["read", "write"])
@pytest.mark.parametrize("p, d", [(2, 1), (1, 2)], ids=["tp2to1", "tp1to2"])
def test_hetero_tp_pair_on_the_flash_attention_layout_we_request(mode, p, d):
    P, C = _pair(mode, p, d)
    try:
        for e in (P, C):
            assert e.layout.name == "LBHNC"
            t = e.caches[0]["layers.0"]  # [block, head, token, K+V]: heads outside tokens
            assert t.stride(1) == t.shape[2] * t.stride(2) and t.stride(0) == t.shape[1] * t.stride(1)
        _load_exact(P, C, prompt_of(70, seed=p * 10 + d))
    finally:
        P.close()
        C.close()


@pytest.mark.parametrize("mode", ["read", "write"])
@pytest.mark.parametrize("p, d, p_block, d_block", [(1, 1, 16, 32), (2, 1, 32, 16), (1, 2, 16, 64)],
                         ids=["bs16to32", "tp2to1-bs32to16", "tp1to2-bs16to64"])
def test_different_block_sizes_on_the_flash_attention_layout(mode, p, d, p_block, d_block):
    """Engines of different block sizes, on the layout vLLM 0.33 resolves for FlashAttention
    (a backend that keeps tokens as rows): every token lands in its block and slot."""
    P, C = _pair(mode, p, d, p_block=p_block, d_block=d_block)
    try:
        assert P.layout.name == C.layout.name == "LBHNC"
        _load_exact(P, C, prompt_of(150, seed=p_block + d_block))
    finally:
        P.close()
        C.close()


@pytest.mark.parametrize("mode", ["read", "write"])
def test_cross_layer_pair_moves_exact_kv_one_range_per_block_at_most(monkeypatch, mode):
    """Equal TP, both engines on vLLM's cross-layer layout (forced here with vLLM's own
    VLLM_KV_CACHE_LAYOUT, as an operator may; kv_cache_layout: cross_layer requests it):
    bytes exact, and the READ (decode) or WRITE (prefill) hands the backend at most one
    byte range per block."""
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "BLHNC")
    P, C = _pair(mode, 1, 1)
    try:
        assert P.layout.name == C.layout.name == "BLHNC"
        _load_exact(P, C, prompt_of(150, seed=3))
        st = (C if mode == "read" else P).workers[0]._worker.agent.stats()
        blocks = st["segments_posted"] // NUM_LAYERS  # the caller's ranges: one per block and layer
        assert blocks >= 9  # 149 prompt tokens loaded in blocks of 16
        assert st["segments_merged"] <= blocks, st  # what reached the backend's post
    finally:
        P.close()
        C.close()


@pytest.mark.parametrize("p, d", [(2, 1), (1, 2)], ids=["tp2to1", "tp1to2"])
def test_cross_layer_blocks_hetero_tp_exact(monkeypatch, p, d):
    """Different TP sizes on the cross-layer layout: each layer's heads are still outside
    its tokens, so a head slice is one range per block and layer; bytes exact."""
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "BLHNC")
    P, C = _pair("read", p, d)
    try:
        assert P.layout.name == C.layout.name == "BLHNC"
        _load_exact(P, C, prompt_of(70, seed=p * 10 + d + 1))
    finally:
        P.close()
        C.close()


def test_tokens_outside_heads_refuses_different_tp_sizes_naming_the_fix(monkeypatch, caplog):
    """vLLM's FlashAttention default (LBNHC, what an engine gets without our request, here
    forced with VLLM_KV_CACHE_LAYOUT): a 2->1 pair is refused at the hand-shake, the
    message naming the layout to use; the request is recomputed, nothing leaked."""
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "LBNHC")
    caplog.set_level(logging.WARNING, logger="kvtransport_vllm")
    P, C = _pair("read", 2, 1)
    try:
        assert P.layout.name == C.layout.name == "LBNHC"
        prompt = prompt_of(40, seed=5)
        params = _prefill(P, "p1", prompt)
        C.add("c1", prompt, 3, params)
        _run_load(P, C, "c1", prompt)
        assert C.counter("loads_ok") == 0
        assert "LBHNC" in caplog.text and "tokens-outer" in caplog.text
        _assert_nothing_left(P, C)
    finally:
        P.close()
        C.close()



def test_cross_layer_peer_and_per_layer_peer_refused_naming_the_setting(monkeypatch, caplog):
    """A prefill on cross-layer blocks and a decode on per-layer heads-outer blocks hold the
    same bytes in another order: refused at the hand-shake, naming kv_cache_layout; the
    request is recomputed, nothing leaked."""
    caplog.set_level(logging.WARNING, logger="kvtransport_vllm")
    base = free_port_base(16)
    common = {"backend": "loopback", "mode": "read", "transfer_timeout_s": 10.0, "lease_s": 120.0,
              "side_channel_host": "127.0.0.1"}
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "BLHNC")
    P = FlashEngine033("kv_producer", {**common, "side_channel_port": base}, tp=1, total_kv_heads=4, engine_id="P")
    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT")
    try:
        C = FlashEngine033("kv_consumer", {**common, "side_channel_port": base + 8}, tp=1, total_kv_heads=4,
                           engine_id="C")
    except BaseException:
        P.close()
        raise
    try:
        assert (P.layout.name, C.layout.name) == ("BLHNC", "LBHNC")
        prompt = prompt_of(40, seed=6)
        C.add("c1", prompt, 3, _prefill(P, "p1", prompt))
        _run_load(P, C, "c1", prompt)
        assert C.counter("loads_ok") == 0 and C.first_start["c1"] == 0  # recomputed
        assert "cross-layer layout" in caplog.text and "kv_cache_layout" in caplog.text
        _assert_nothing_left(P, C)
    finally:
        P.close()
        C.close()
