"""Segments, BlockLayout and merge_pairs: the vectorised descriptor build and the merge
the core applies before every post."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvtransport as kvt
from kvtransport.errors import InvalidSegmentsError
from kvtransport.segments import merge_pairs


def _region(rid: int, length: int) -> SimpleNamespace:
    """BlockLayout needs only ``.id`` and ``.length`` of a region."""
    return SimpleNamespace(id=rid, length=length)


# -- Segments ---------------------------------------------------------------------------

def test_segments_broadcast_scalar_region_and_length():
    s = kvt.Segments(3, [0, 10, 20], 5)
    assert s.region.tolist() == [3, 3, 3] and s.length.tolist() == [5, 5, 5]
    assert s.offset.dtype == np.uint64 and s.region.dtype == np.int64
    assert len(s) == 3 and s.nbytes == 15


def test_segments_are_immutable():
    s = kvt.Segments([1, 1], [0, 8], [8, 8])
    for arr in (s.region, s.offset, s.length):
        with pytest.raises(ValueError):
            arr[0] = 99
    assert s.offset.tolist() == [0, 8]


@pytest.mark.parametrize("region, offset, length, what", [
    (1, [-1], [8], "negative"),
    (1, [0], [-8], "negative"),
    ([-1], [0], [8], "negative"),
    (1, [0.5], [8], "integers"),
    (1, [0], [8.0], "integers"),
    (1, [[0, 1]], [8], "one-dimensional"),
    (1, ["0"], [8], "integers"),
    (1, [True], [8], "integers"),
    ([1, 2], [0, 8, 16], [8], "same number"),
    (1, [0, 8], [8, 8, 8], "same number"),
])
def test_segments_reject_bad_arrays(region, offset, length, what):
    with pytest.raises(InvalidSegmentsError, match=what):
        kvt.Segments(region, offset, length)


def test_segments_concat_keeps_order():
    a = kvt.Segments(1, [0, 4], 4)
    b = kvt.Segments(2, [100], 7)
    c = kvt.Segments.concat([a, b])
    assert c.region.tolist() == [1, 1, 2] and c.offset.tolist() == [0, 4, 100]
    assert c.length.tolist() == [4, 4, 7]
    assert len(kvt.Segments.concat([])) == 0


# -- BlockLayout ------------------------------------------------------------------------

def test_block_layout_16384_blocks_offsets_exact():
    """Vectorised build of 16,384 blocks in two parts: every offset equals the formula
    computed independently in plain Python."""
    nblocks, block, stride = 16_384, 48, 64
    half = nblocks * stride
    r = _region(7, 2 * half)
    layout = kvt.BlockLayout([(r, 0), (r, half)], block, nblocks, block_stride=stride)
    ids = np.random.default_rng(1).permutation(nblocks)
    segs = layout.segments(ids)
    assert len(segs) == 2 * nblocks
    expect = [base + int(b) * stride for base in (0, half) for b in ids.tolist()]
    assert segs.offset.tolist() == expect
    assert (segs.region == 7).all() and (segs.length == block).all()
    assert segs.nbytes == 2 * nblocks * block


def test_block_layout_k_and_v_halves_are_two_parts_part_major():
    block, nblocks = 32, 10
    kv = _region(1, 2 * block * nblocks)
    layout = kvt.BlockLayout([(kv, 0), (kv, block * nblocks)], block, nblocks)
    segs = layout.segments(np.array([3, 1]))
    assert segs.offset.tolist() == [3 * block, 1 * block, block * nblocks + 3 * block, block * nblocks + block]
    # Two layers in two regions: region ids follow the parts.
    k, v = _region(1, block * nblocks), _region(2, block * nblocks)
    segs = kvt.BlockLayout([(k, 0), (v, 0)], block, nblocks).segments([4])
    assert segs.region.tolist() == [1, 2] and segs.offset.tolist() == [4 * block, 4 * block]


def test_block_layout_k_v_halves_move_exactly_over_loopback():
    """The two-part layout drives a real transfer: both halves of the chosen blocks,
    and nothing else, arrive."""
    block, nblocks = 256, 32
    src = np.random.default_rng(2).integers(0, 256, 2 * block * nblocks, dtype=np.uint8)
    dst = np.zeros_like(src)
    with kvt.open("loopback", name="kv-src") as a, kvt.open("loopback", name="kv-dst") as b:
        ra, rb = a.register(src), b.register(dst)
        peer = b.connect(a.metadata())
        rem = peer.region(ra.id)
        local = kvt.BlockLayout([(rb, 0), (rb, block * nblocks)], block, nblocks)
        remote = kvt.BlockLayout([(rem, 0), (rem, block * nblocks)], block, nblocks)
        ids = np.array([5, 0, 31, 6])
        assert b.read(peer, local.segments(ids), remote.segments(ids)).wait(10).ok
    s = src.reshape(2, nblocks, block)
    d = dst.reshape(2, nblocks, block)
    assert np.array_equal(d[:, ids], s[:, ids])
    others = np.setdiff1d(np.arange(nblocks), ids)
    assert not d[:, others].any()


@pytest.mark.parametrize("ids, what", [
    ([10], r"\[0, 10\)"),
    ([0, 9, 11], r"\[0, 10\)"),
    ([-1], r"\[0, 10\)"),
    (np.array([2**63], dtype=np.uint64), r"\[0, 10\)"),
    ([1.0], "integers"),
    (["1"], "integers"),
    ([True], "integers"),
])
def test_block_layout_rejects_bad_block_ids(ids, what):
    layout = kvt.BlockLayout([(_region(1, 640), 0)], 64, 10)
    with pytest.raises(InvalidSegmentsError, match=what):
        layout.segments(ids)


def test_block_layout_empty_ids_gives_empty_segments():
    layout = kvt.BlockLayout([(_region(1, 640), 0)], 64, 10)
    assert len(layout.segments(np.array([], dtype=np.int64))) == 0


@pytest.mark.parametrize("kwargs, what", [
    (dict(block_bytes=64, num_blocks=11), "has only 640"),           # spans past the region
    (dict(block_bytes=64, num_blocks=10, block_stride=32), "overlap"),
    (dict(block_bytes=0, num_blocks=10), "positive"),
    (dict(block_bytes=64, num_blocks=0), "positive"),
])
def test_block_layout_rejects_impossible_geometry(kwargs, what):
    with pytest.raises(InvalidSegmentsError, match=what):
        kvt.BlockLayout([(_region(1, 640), 0)], **kwargs)


def test_block_layout_rejects_negative_base_and_no_parts():
    with pytest.raises(InvalidSegmentsError):
        kvt.BlockLayout([(_region(1, 640), -64)], 64, 5)
    with pytest.raises(InvalidSegmentsError, match="at least one"):
        kvt.BlockLayout([], 64, 5)


# -- merge_pairs ------------------------------------------------------------------------

def _merge(l_off, r_off, lens, l_reg=1, r_reg=2):
    return merge_pairs(kvt.Segments(l_reg, l_off, lens), kvt.Segments(r_reg, r_off, lens))


def test_merge_contiguous_on_both_sides():
    lr, lo, rr, ro, ln = _merge([0, 10, 20], [100, 110, 120], [10, 10, 10])
    assert lo.tolist() == [0] and ro.tolist() == [100] and ln.tolist() == [30]
    assert lr.tolist() == [1] and rr.tolist() == [2]


def test_merge_contiguous_on_one_side_only_does_not_merge():
    _, lo, _, ro, ln = _merge([0, 10, 20], [100, 200, 300], [10, 10, 10])
    assert lo.tolist() == [0, 10, 20] and ro.tolist() == [100, 200, 300] and ln.tolist() == [10] * 3
    _, lo, _, ro, ln = _merge([0, 50, 90], [100, 110, 120], [10, 10, 10])
    assert len(ln) == 3


def test_merge_needs_same_region_on_both_sides():
    local = kvt.Segments([1, 3], [0, 10], [10, 10])  # offsets contiguous, regions differ
    remote = kvt.Segments([2, 2], [0, 10], [10, 10])
    assert merge_pairs(local, remote)[4].tolist() == [10, 10]


def test_merge_preserves_order_and_total():
    # Two runs in reverse order: each merges internally; the runs are not reordered.
    _, lo, _, ro, ln = _merge([40, 50, 0, 10], [0, 10, 40, 50], [10, 10, 10, 10])
    assert lo.tolist() == [40, 0] and ro.tolist() == [0, 40] and ln.tolist() == [20, 20]
    # Descending blocks never merge and keep their order.
    _, lo, _, _, ln = _merge([20, 10, 0], [20, 10, 0], [10, 10, 10])
    assert lo.tolist() == [20, 10, 0] and int(ln.sum()) == 30


def test_merge_single_and_empty():
    for n in (0, 1):
        out = _merge(list(range(0, 10 * n, 10)), list(range(0, 10 * n, 10)), [10] * n)
        assert len(out[4]) == n


def _byte_map(lr, lo, rr, ro, ln) -> np.ndarray:
    """Every byte moved, in order, as rows (local region, local byte, remote region, remote byte)."""
    ln = np.asarray(ln, dtype=np.int64)
    idx = np.repeat(np.arange(ln.size), ln)
    within = np.arange(int(ln.sum())) - np.repeat(np.cumsum(ln) - ln, ln)
    return np.stack([np.asarray(lr, np.int64)[idx], np.asarray(lo, np.int64)[idx] + within,
                     np.asarray(rr, np.int64)[idx], np.asarray(ro, np.int64)[idx] + within], axis=1)


@st.composite
def _segment_pairs(draw):
    """Segments built like KV blocks: runs of consecutive blocks (which may merge) and
    random jumps, random regions, so both merging and non-merging neighbours occur."""
    n = draw(st.integers(1, 60))
    block = draw(st.sampled_from([1, 3, 8]))
    lens = draw(st.lists(st.sampled_from([block, 2 * block]), min_size=n, max_size=n))
    steps = st.one_of(st.just(0), st.integers(-5, 40))  # 0: contiguous with the previous segment
    l_steps = draw(st.lists(steps, min_size=n, max_size=n))
    r_steps = draw(st.lists(steps, min_size=n, max_size=n))
    l_reg = draw(st.lists(st.sampled_from([1, 1, 1, 2]), min_size=n, max_size=n))
    r_reg = draw(st.lists(st.sampled_from([5, 5, 5, 6]), min_size=n, max_size=n))

    def offsets(steps):
        out, pos = [], 1000
        for ln, step in zip(lens, steps):
            pos = max(0, pos + step * block)
            out.append(pos)
            pos += ln
        return out

    return (kvt.Segments(l_reg, offsets(l_steps), lens), kvt.Segments(r_reg, offsets(r_steps), lens))


@settings(max_examples=300, deadline=None)
@given(_segment_pairs())
def test_merge_property_same_byte_mapping(pair):
    """Merged segments move exactly the same bytes, to the same places, in the same
    order as the unmerged ones; and no two neighbours left could have been merged."""
    local, remote = pair
    lr, lo, rr, ro, ln = merge_pairs(local, remote)
    assert int(ln.sum()) == local.nbytes
    assert len(ln) <= len(local) and (ln > 0).all()
    before = _byte_map(local.region, local.offset, remote.region, remote.offset, local.length)
    after = _byte_map(lr, lo, rr, ro, ln)
    assert np.array_equal(before, after)
    if len(ln) > 1:  # maximal: no two neighbours remain contiguous on both sides
        mergeable = ((lr[1:] == lr[:-1]) & (rr[1:] == rr[:-1])
                     & (lo[1:] == lo[:-1] + ln[:-1]) & (ro[1:] == ro[:-1] + ln[:-1]))
        assert not mergeable.any()
