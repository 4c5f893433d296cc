"""Split a merged PostRequest into one offset list per (local region, remote region) pair.

mori addresses memory as *descriptor + offset*: one session joins one local ``MemoryDesc``
to one remote ``MemoryDesc``, and its ``batch_read``/``batch_write`` take three parallel
lists (local offsets, remote offsets, sizes) inside that pair. The core hands us a single
flat, already-merged batch that may span several regions (e.g. one region per KV layer),
so we sort the segments by region pair once and slice, all in numpy: no Python loop per
segment, one loop iteration per region pair (typically a handful).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["PairGroup", "group_by_region_pair"]


@dataclass(frozen=True)
class PairGroup:
    """Segments of one request that go between one local and one remote region."""

    local_region: int
    remote_region: int
    local_offsets: list[int]
    remote_offsets: list[int]
    sizes: list[int]

    @property
    def nbytes(self) -> int:
        return sum(self.sizes)


def group_by_region_pair(
    local_region: np.ndarray,
    remote_region: np.ndarray,
    local_offset: np.ndarray,
    remote_offset: np.ndarray,
    length: np.ndarray,
) -> list[PairGroup]:
    """Group segments by (local_region, remote_region), keeping their order inside a group.

    Order inside a group is preserved (stable sort) so the lists mori receives follow the
    caller's order, which keeps contiguous runs adjacent for mori's own merging.
    Offsets are handed over as Python ints (``tolist`` is one C-level conversion) because
    mori's pybind11 ``std::vector<size_t>`` conversion expects ints.
    """
    n = int(length.shape[0])
    if n == 0:
        return []
    lr = np.asarray(local_region, dtype=np.int64)
    rr = np.asarray(remote_region, dtype=np.int64)
    # The core emits layouts part-major, so requests usually arrive already ordered by
    # region pair: then no sort is needed (a cheap vectorised check).
    ordered = bool(np.all((lr[1:] > lr[:-1]) | ((lr[1:] == lr[:-1]) & (rr[1:] >= rr[:-1]))))
    if ordered:
        lr_s, rr_s = lr, rr
        lo, ro, ln = local_offset, remote_offset, length
    else:
        # lexsort: last key is primary. Stable, so segment order survives within a pair.
        order = np.lexsort((rr, lr))
        lr_s, rr_s = lr[order], rr[order]
        lo, ro, ln = local_offset[order], remote_offset[order], length[order]
    change = np.flatnonzero((lr_s[1:] != lr_s[:-1]) | (rr_s[1:] != rr_s[:-1])) + 1
    starts = np.concatenate(([0], change))
    ends = np.concatenate((change, [n]))
    # int64 converts to Python ints twice as fast as uint64; offsets and sizes are < 2**63.
    lo = np.asarray(lo).astype(np.int64, copy=False)
    ro = np.asarray(ro).astype(np.int64, copy=False)
    ln = np.asarray(ln).astype(np.int64, copy=False)
    groups: list[PairGroup] = []
    for s, e in zip(starts.tolist(), ends.tolist()):
        groups.append(
            PairGroup(
                local_region=int(lr_s[s]),
                remote_region=int(rr_s[s]),
                local_offsets=lo[s:e].tolist(),
                remote_offsets=ro[s:e].tolist(),
                sizes=ln[s:e].tolist(),
            )
        )
    return groups
