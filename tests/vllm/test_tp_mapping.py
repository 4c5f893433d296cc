"""tp_mapping, exhaustively: for every head count and pair of TP sizes up to 16, each
consumer rank gets exactly its heads, each from a producer rank that holds them, at the
right offsets on both sides; every producer rank is read or released by exactly the
consumer ranks that say so; replicated heads (and MLA, one latent "head") are read once
per consumer rank and spread over the producer ranks. Pure arithmetic: no vLLM."""

from __future__ import annotations

import itertools

import pytest

from kvtransport_vllm.tp_mapping import (
    Piece,
    TPMappingError,
    check_mapping,
    consumer_pieces,
    heads_of,
    holders,
    producer_ranks_of,
    readers,
    releaser,
)

SIZES = range(1, 17)


def _valid(h: int, tp: int) -> bool:
    return h % tp == 0 or tp % h == 0


CASES = [(h, p, d) for h, p, d in itertools.product(SIZES, SIZES, SIZES) if _valid(h, p) and _valid(h, d)]


def test_vllm_head_split():
    """vLLM's split: contiguous ranges, or (replicated) head r // (tp / H)."""
    assert [list(heads_of(4, 2, r)) for r in range(2)] == [[0, 1], [2, 3]]
    assert [list(heads_of(2, 4, r)) for r in range(4)] == [[0], [0], [1], [1]]
    assert [list(heads_of(1, 3, r)) for r in range(3)] == [[0], [0], [0]]  # MLA: every rank holds the latent
    assert list(holders(2, 4, 1)) == [2, 3]


@pytest.mark.parametrize("h", SIZES)
def test_every_rank_holds_its_heads_and_every_head_is_held(h):
    for tp in SIZES:
        if not _valid(h, tp):
            continue
        held = [head for r in range(tp) for head in heads_of(h, tp, r)]
        assert sorted(set(held)) == list(range(h))
        for head in range(h):
            assert all(head in heads_of(h, tp, r) for r in holders(h, tp, head))
            assert sum(head in heads_of(h, tp, r) for r in range(tp)) == len(holders(h, tp, head))


def test_pieces_cover_exactly_the_consumer_heads_from_holding_producer_ranks():
    for h, p, d in CASES:
        for c in range(d):
            mine = list(heads_of(h, d, c))
            got = []
            for pc in consumer_pieces(h, p, d, c):
                theirs = list(heads_of(h, p, pc.producer_rank))
                for k in range(pc.num_heads):
                    head = mine[pc.local_head + k]
                    assert theirs[pc.remote_head + k] == head, (h, p, d, c, pc)
                    got.append(head)
            assert got == mine, (h, p, d, c)


def test_same_tp_is_one_whole_piece_from_the_same_rank():
    for h, t in ((h, t) for h in SIZES for t in SIZES if _valid(h, t)):
        for c in range(t):
            n = len(heads_of(h, t, c))
            assert consumer_pieces(h, t, t, c) == [Piece(c, 0, 0, n)]
            assert producer_ranks_of(h, t, t, c) == {c: 1}


def test_examples_of_the_issue():
    assert consumer_pieces(4, 1, 2, 1) == [Piece(0, 0, 2, 2)]  # d > p: one slice of one rank
    assert consumer_pieces(4, 2, 1, 0) == [Piece(0, 0, 0, 2), Piece(1, 2, 0, 2)]  # p > d: gathered
    assert consumer_pieces(4, 4, 2, 1) == [Piece(2, 0, 0, 1), Piece(3, 1, 0, 1)]
    # H=2 on TP 4 (replicated producer): decode TP 1 reads head 0 from rank 0, head 1 from rank 2
    assert consumer_pieces(2, 4, 1, 0) == [Piece(0, 0, 0, 1), Piece(2, 1, 0, 1)]
    assert producer_ranks_of(2, 4, 1, 0) == {0: 1, 2: 1, 1: 1, 3: 1}  # 1 and 3: released at once
    assert releaser(2, 4, 1, 1) == 0 and releaser(2, 4, 1, 0) is None


def test_every_producer_rank_is_read_or_released_by_exactly_the_ranks_that_say_so():
    for h, p, d in CASES:
        speaks = {q: [] for q in range(p)}  # producer rank -> [(consumer rank, readers it names)]
        for c in range(d):
            for q, n in producer_ranks_of(h, p, d, c).items():
                speaks[q].append((c, n))
        for q in range(p):
            rd = readers(h, p, d, q)
            if rd:
                assert [c for c, _ in speaks[q]] == rd and all(n == len(rd) for _, n in speaks[q]), (h, p, d, q)
                assert releaser(h, p, d, q) is None
            else:  # nobody reads q: exactly one consumer rank frees it, naming one reader
                assert speaks[q] == [(releaser(h, p, d, q), 1)], (h, p, d, q)


def test_replicated_heads_and_mla_are_read_once_per_consumer_rank_and_spread():
    for h, p, d in CASES:
        if h >= p:
            continue  # producer heads not replicated: one holder per head, nothing to spread
        for c in range(d):
            assert len({pc.producer_rank for pc in consumer_pieces(h, p, d, c)}) == len(heads_of(h, d, c))
        used = {pc.producer_rank for c in range(d) for pc in consumer_pieces(h, p, d, c)}
        # every (head, consumer rank) read goes to a distinct replica while replicas last
        per_head = {head: len(holders(h, d, head)) for head in range(h)}
        assert len(used) == sum(min(p // h, n) for n in per_head.values()), (h, p, d, used)
    # MLA (one latent head): decode TP 4 from prefill TP 2 reads ranks 0, 1, 0, 1
    assert [consumer_pieces(1, 2, 4, c)[0].producer_rank for c in range(4)] == [0, 1, 0, 1]
    assert [consumer_pieces(1, 4, 2, c)[0].producer_rank for c in range(2)] == [0, 1]
    assert releaser(1, 4, 2, 2) == 0 and releaser(1, 4, 2, 3) == 1


@pytest.mark.parametrize("h, tp", [(3, 2), (4, 3), (6, 4), (2, 3)])
def test_uneven_split_is_refused_naming_sizes_and_fix(h, tp):
    with pytest.raises(TPMappingError, match=rf"TP size {tp} does not split {h} KV heads evenly.*use a "
                                             "tensor-parallel size"):
        check_mapping(h, tp)
    with pytest.raises(TPMappingError):
        consumer_pieces(h, tp, 1 if h % 1 == 0 else h, 0)


def test_out_of_range_rank_refused():
    with pytest.raises(TPMappingError, match="rank 2 out of range for TP size 2"):
        heads_of(4, 2, 2)
    with pytest.raises(TPMappingError, match="rank 4 out of range"):
        readers(4, 4, 2, 4)
