"""Hybrid SSM models (Mamba2 + attention) between engines of different TP sizes.

Real vLLM Schedulers with vLLM's hybrid KV cache manager (a ``MambaSpec`` group, one state
page per request, and a full-attention group), one real connector worker per TP rank, as
in ``test_hetero_tp.py``. Each rank's Mamba state is split as vLLM splits a Mamba2 layer's
(the rank's heads, the groups of its heads, conv state ``[x | B | C]``), and every value in
it names its global channel or head (``tp_harness.mamba_state``).

What a user checks: each decode rank's state right after the prompt equals what one engine
of the decode's TP size computing the whole prompt has (a byte taken from the wrong head,
group, conv row or producer rank differs); every head slice of the attention KV equals the
prefill's; the prompt was loaded, not recomputed; nothing is left on either side. Refused
at the hand-shake, the load then recomputed: a state kind whose TP split is not known
(not Mamba2), and attention heads replicated over the ranks.
"""

from __future__ import annotations

import pytest

from harness import prompt_of
from test_hetero_tp import _assert_nothing_left, _engines, _prefill, _run_load
from tp_harness import TPEngine, doctor
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum


def _decode(P: TPEngine, C: TPEngine, prompt: list[int]) -> list | None:
    """Prefill, then decode to the end; the attention head slices that differed from the
    prefill's when the decode first ran with its prompt computed (None: never seen so)."""
    C.add("c1", prompt, 3, _prefill(P, "p1", prompt))
    return _run_load(P, C, "c1", prompt).bad


CASES = [
    # (prefill TP, decode TP, B/C groups, attention KV heads)
    (2, 1, 1, 4),  # one group, replicated on the prefill ranks: taken once
    (2, 1, 2, 4),  # a group per prefill rank
    (1, 2, 1, 4),
    (1, 2, 2, 4),
    (2, 4, 4, 4),
    (4, 2, 1, 4),
]


@pytest.mark.parametrize("mode", ["read", "write"])
@pytest.mark.parametrize("p, d, groups, heads", CASES, ids=[f"tp{p}to{d}-g{g}" for p, d, g, _ in CASES])
def test_mamba_state_is_resplit_across_tp_sizes(mode, p, d, groups, heads):
    P, C = _engines(mode, p, d, heads, mamba_groups=groups)
    try:
        prompt = prompt_of(70, seed=p * 10 + d + groups)
        assert _decode(P, C, prompt) == [], "attention head slices differ from the prefill's"
        assert C.first_start["c1"] == len(prompt) - 1, "the decode engine did not load all but the last token"
        assert C.bad_state("c1", prompt) == [], "decode ranks whose Mamba state differs from one engine's"
        assert C.counter("loads_ok") == C.tp and C.counter("failures") == 0
        _assert_nothing_left(P, C)
    finally:
        P.close()
        C.close()


@pytest.fixture
def conv_state_channels_first(monkeypatch):
    """Engines started with ``VLLM_SSM_CONV_STATE_LAYOUT=DS``, as a user sets it. vLLM reads
    the setting once per process (``get_conv_state_layout`` is memoised): forgotten before and
    after, so this test sees it as a fresh engine would and leaves no trace."""
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout

    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
    get_conv_state_layout.cache_clear()
    yield
    monkeypatch.undo()
    get_conv_state_layout.cache_clear()


@pytest.mark.parametrize("mode", ["read", "write"])
def test_mamba_conv_state_channels_first_is_resplit(mode, conv_state_channels_first):
    """vLLM's other conv state layout (``VLLM_SSM_CONV_STATE_LAYOUT=DS``: channels, then width)."""
    P, C = _engines(mode, 2, 1, 4, mamba_groups=2, conv_dim_first=True)
    try:
        prompt = prompt_of(50, seed=5)
        assert _decode(P, C, prompt) == []
        assert C.first_start["c1"] == len(prompt) - 1
        assert C.bad_state("c1", prompt) == []
        _assert_nothing_left(P, C)
    finally:
        P.close()
        C.close()


@pytest.mark.parametrize("why, heads, opts", [
    ("state of this model is moved between engines of the same TP size only", 4,
     dict(mamba_groups=2, mamba_kind=MambaAttentionBackendEnum.SHORT_CONV)),
    ("attention heads are replicated", 1, dict(mamba_groups=1)),
], ids=["other-state-kind", "replicated-attention-heads"])
def test_mamba_state_that_cannot_be_resplit_is_refused_at_the_hand_shake(why, heads, opts, caplog):
    """The load fails in its first round trip, before any byte moves, naming why; vLLM's
    load failure policy (recompute) then computes the prompt, and the state is one engine's."""
    P, C = _engines("read", 2, 1, heads, **opts)
    try:
        prompt = prompt_of(60, seed=9)
        with caplog.at_level("ERROR", logger="kvtransport_vllm"):
            _decode(P, C, prompt)
        assert any(why in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
        assert C.first_start["c1"] == 0, "the decode engine used the refused load"
        assert C.bad_state("c1", prompt) == []
        assert C.counter("bytes") == 0 and P.counter("bytes") == 0
        _assert_nothing_left(P, C)
    finally:
        P.close()
        C.close()


def test_doctor_names_a_state_that_cannot_be_resplit_before_any_request():
    """What an operator runs when deploying a pair: ``kvtransport doctor`` makes the
    hand-shake's own check on every rank before any request, and names the refusal."""
    from kvtransport_vllm.doctor import FIX_LAYOUT

    P, C = _engines("read", 2, 1, 4, mamba_groups=2, mamba_kind=MambaAttentionBackendEnum.SHORT_CONV)
    try:
        v = doctor(P, C)
        assert v.exit_code == 1
        [layout] = [f for f in v.problems if f.check == "layout"]
        assert "moved between engines of the same TP size only" in layout.message and layout.fix == FIX_LAYOUT
    finally:
        P.close()
        C.close()


def test_doctor_calls_a_mamba2_pair_of_different_tp_sizes_healthy():
    P, C = _engines("read", 2, 1, 4, mamba_groups=2)
    try:
        v = doctor(P, C)
        assert v.healthy, v.render()
        assert set(v.moved) == {"prefill rank 0", "prefill rank 1", "decode rank 0"}
    finally:
        P.close()
        C.close()
