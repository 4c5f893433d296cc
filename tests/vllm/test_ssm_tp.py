"""ssm_tp, exhaustively: for every Mamba2 split vLLM allows (heads divisible by both TP sizes,
groups 1 or a multiple of the TP size) and every pair of TP sizes up to 8, both conv state
layouts, and conv and SSM states of different element sizes, each consumer rank's state
page assembled from the producer ranks' pages by the byte ranges of :mod:`ssm_tp` is
exactly the page vLLM gives that rank: every byte covered, each from the right conv row,
channel, group, head and producer rank. Pure arithmetic: no vLLM, no transfer."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from kvtransport_vllm.ssm_tp import MAMBA2, StateGeometry, resplit_problem, state_cuts
from kvtransport_vllm.tp_mapping import consumer_pieces

HEAD_DIM, STATE, WIDTH = 3, 2, 3
CONV_ITEM, SSM_ITEM = 2, 4  # different sizes, so swapped element sizes or offsets show


class _Rank:
    """What state_cuts reads of a rank's LayoutInfo."""

    def __init__(self, tp: int, kv_heads: int, state: StateGeometry) -> None:
        self.tp_size, self.kv_heads, self.state = tp, kv_heads, state


def _groups_of(groups: int, tp: int, rank: int) -> list[int]:
    """vLLM's B/C groups of a rank: its share, or the one group on every rank."""
    return list(range(rank * groups // tp, (rank + 1) * groups // tp)) if groups % tp == 0 else [0]


def _geometry(heads: int, groups: int, tp: int, dim_first: bool) -> StateGeometry:
    g = len(_groups_of(groups, tp, 0))
    channels = heads // tp * HEAD_DIM + 2 * g * STATE
    return StateGeometry(MAMBA2, heads=heads // tp, total_heads=heads, head_dim=HEAD_DIM, groups=g, state_size=STATE,
                         conv_width=WIDTH, conv_dim_first=dim_first, conv_offset=0, conv_item=CONV_ITEM,
                         ssm_offset=channels * WIDTH * CONV_ITEM, ssm_item=SSM_ITEM, conv_dtype="a", ssm_dtype="b")


def _page(heads: int, groups: int, tp: int, rank: int, dim_first: bool) -> np.ndarray:
    """The rank's state page, each byte labelled with the global element it belongs to."""
    h_l = heads // tp
    rank_groups = _groups_of(groups, tp, rank)
    channels = ([("x", rank * h_l * HEAD_DIM + c) for c in range(h_l * HEAD_DIM)]
                + [("B", g * STATE + s) for g in rank_groups for s in range(STATE)]
                + [("C", g * STATE + s) for g in rank_groups for s in range(STATE)])
    kinds = {"x": 0, "B": 1, "C": 2}
    conv = np.array([[(1 << 40) + (k << 32) + (kinds[kind] << 24) + ch for kind, ch in channels]
                     for k in range(WIDTH)], dtype=np.int64)
    if dim_first:
        conv = conv.T
    ssm = np.arange(rank * h_l * HEAD_DIM * STATE, (rank + 1) * h_l * HEAD_DIM * STATE, dtype=np.int64) + (2 << 40)

    def as_bytes(labels: np.ndarray, item: int) -> np.ndarray:
        return (labels.reshape(-1, 1) * 8 + np.arange(item)).reshape(-1)

    return np.concatenate([as_bytes(conv, CONV_ITEM), as_bytes(ssm, SSM_ITEM)])


SPLITS = [(h, g) for h in (8, 16) for g in (1, 2, 4, 8) if g <= h]
TPS = (1, 2, 4, 8)


@pytest.mark.parametrize("dim_first", [False, True], ids=["width-channels", "channels-width"])
@pytest.mark.parametrize("heads, groups", SPLITS, ids=[f"h{h}-g{g}" for h, g in SPLITS])
def test_every_consumer_page_is_assembled_exactly(heads, groups, dim_first):
    kv_total = 8  # attention KV heads, split without replication at every TP size here
    checked = 0
    for p, d in itertools.product(TPS, TPS):
        if p == d or any(groups % t and groups != 1 for t in (p, d)):
            continue  # equal TP sizes move whole pages; vLLM refuses such a group split
        prod = [_page(heads, groups, p, q, dim_first) for q in range(p)]
        for c in range(d):
            want = _page(heads, groups, d, c, dim_first)
            got = np.full_like(want, -1)
            cons = _Rank(d, kv_total // d, _geometry(heads, groups, d, dim_first))
            for piece in consumer_pieces(kv_total, p, d, c):
                pr = _Rank(p, kv_total // p, _geometry(heads, groups, p, dim_first))
                assert resplit_problem(cons.state, pr.state, (d, p), (cons.kv_heads, pr.kv_heads)) == ""
                local, remote = state_cuts(cons, pr, piece.local_head, piece.remote_head, piece.num_heads, True)
                for (lo, n), (ro, m) in zip(local, remote):
                    assert n == m
                    got[lo:lo + n] = prod[piece.producer_rank][ro:ro + m]
                # the producer's view of the same piece (WRITE) is the mirror image
                w_local, w_remote = state_cuts(pr, cons, piece.remote_head, piece.local_head, piece.num_heads, False)
                assert (w_local, w_remote) == (remote, local)
            assert np.array_equal(got, want), f"TP {p} -> {d}, consumer rank {c}: bytes differ from vLLM's page"
            checked += 1
    assert checked > 0


def test_refusals_name_the_problem():
    g = _geometry(8, 2, 2, False)
    assert "same TP size only" in resplit_problem(StateGeometry("gdn_attn"), StateGeometry("gdn_attn"), (2, 1), (1, 2))
    assert "replicated" in resplit_problem(g, _geometry(8, 2, 1, False), (2, 1), (1, 1))
    other = StateGeometry(**{**{f: getattr(g, f) for f in g.__struct_fields__}, "ssm_dtype": "torch.float16"})
    assert "ssm_dtype" in resplit_problem(g, other, (2, 2), (1, 1))
    assert "kvtransport version" in resplit_problem(g, None, (2, 1), (1, 2))
