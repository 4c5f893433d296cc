"""group_by_region_pair: every segment lands in exactly one (local, remote) group, in order."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtransport_moriio.grouping import group_by_region_pair


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(0, 1 << 40),
                          st.integers(0, 1 << 40), st.integers(1, 1 << 20)), max_size=60), st.booleans())
def test_grouping_partitions_segments_and_keeps_order(segs, presorted):
    if presorted:  # the core's usual part-major order takes the no-sort fast path
        segs = sorted(segs, key=lambda s: (s[0], s[1]))
    arr = np.array(segs, dtype=np.int64).reshape(-1, 5)
    groups = group_by_region_pair(arr[:, 0], arr[:, 1], arr[:, 2].astype(np.uint64),
                                  arr[:, 3].astype(np.uint64), arr[:, 4].astype(np.uint64))
    pairs = [(g.local_region, g.remote_region) for g in groups]
    assert len(pairs) == len(set(pairs)) == len({(a, b) for a, b, *_ in segs})
    for g in groups:
        want = [(lo, ro, n) for a, b, lo, ro, n in segs if (a, b) == (g.local_region, g.remote_region)]
        assert list(zip(g.local_offsets, g.remote_offsets, g.sizes)) == want
        assert all(type(x) is int for x in g.local_offsets + g.remote_offsets + g.sizes)
    assert sum(len(g.sizes) for g in groups) == len(segs)


def test_large_request_is_grouped_without_per_segment_python_work():
    n = 200_000
    rng = np.random.default_rng(0)
    lr, rr = rng.integers(0, 32, n), rng.integers(0, 32, n)
    off = np.arange(n, dtype=np.uint64) * 4096
    groups = group_by_region_pair(lr, rr, off, off, np.full(n, 4096, np.uint64))
    assert len(groups) == 32 * 32
    assert sum(len(g.sizes) for g in groups) == n
