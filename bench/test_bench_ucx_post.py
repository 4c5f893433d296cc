"""What posting costs in the ucx backend: the compiled path (``_post.c``) against the ctypes
fallback, per block (issue 18, point 2).

Run: ``python -m pytest bench/test_bench_ucx_post.py -q -s -p no:cacheprovider``.

Measured: the posting thread's own CPU time (``time.thread_time``, which other processes on
a shared machine do not disturb) inside ``Agent.post(prepared)`` — the backend's share only,
the core's validation was done once by ``Agent.prepare`` — and inside ``Agent.write`` (core
build + validate + merge + post), for 4096 scattered 16 KiB blocks and 16,384 scattered
256-byte blocks (random order on both sides, so nothing merges), two agents of this process
over ``tls="shm"``, one lane and ``inline_progress_s=0`` so that ``post`` only posts (no copy
on the caller's thread). The two paths alternate (9 pairs) and every transfer is waited for
and checked ok. Printed: medians, per block. No timing is asserted.
"""

from __future__ import annotations

import time

import numpy as np

import kvtransport as kvt

CASES = {"4096x16KiB": (4096, 16 << 10), "16384x256B": (16384, 256)}
PAIRS = 9


def _pair(post: str, nbytes: int):
    opts = dict(tls="shm", lanes=1, inline_progress_s=0.0, post=post)
    a = kvt.open("ucx", name=f"pc-a-{post}", **opts)
    b = kvt.open("ucx", name=f"pc-b-{post}", **opts)
    src = np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, np.uint8)
    ra, rb = a.register(src), b.register(dst)
    peer = a.connect(b.metadata())
    b.connect(a.metadata())
    return a, b, ra, rb, peer, src, dst


def test_post_cost_native_vs_ctypes() -> None:
    lines = ["", f"{'case':<11} {'path':<7} {'post() CPU us':>14} {'us/block':>9} {'write() CPU us':>15} "
                 f"{'us/block':>9} {'transfer GB/s':>14}"]
    for case, (n, blk) in CASES.items():
        nblk = max(4 * n, (64 << 20) // blk)
        rng = np.random.default_rng(0)
        lo = rng.permutation(nblk)[:n].astype(np.int64) * blk
        ro = rng.permutation(nblk)[:n].astype(np.int64) * blk
        ln = np.full(n, blk, np.int64)
        pairs = {p: _pair(p, nblk * blk) for p in ("native", "ctypes")}
        post_cpu: dict[str, list[float]] = {p: [] for p in pairs}
        write_cpu: dict[str, list[float]] = {p: [] for p in pairs}
        wall: dict[str, list[float]] = {p: [] for p in pairs}
        for p, (a, b, ra, rb, peer, src, dst) in pairs.items():
            assert a.describe()["post_path"] == p
        try:
            for k in range(PAIRS + 1):
                for p in (("native", "ctypes") if k % 2 else ("ctypes", "native")):
                    a, b, ra, rb, peer, src, dst = pairs[p]
                    local, remote = ra.segments(lo, ln), peer.region(rb.id).segments(ro, ln)
                    prep = a.prepare(kvt.Op.WRITE, peer, local, remote)
                    dst.fill(0)
                    w0, c0 = time.perf_counter(), time.thread_time()
                    t = a.post(prep)
                    c1 = time.thread_time()
                    st = t.wait()
                    w1 = time.perf_counter()
                    assert st.ok, st.reason
                    t.release()
                    for i in (0, n // 2, n - 1):  # every transfer moved the bytes
                        assert np.array_equal(dst[ro[i]:ro[i] + blk], src[lo[i]:lo[i] + blk]), f"{p} block {i}"
                    c2 = time.thread_time()
                    t = a.write(peer, local, remote)
                    c3 = time.thread_time()
                    assert t.wait().ok
                    t.release()
                    if k:  # the first pair warms up
                        post_cpu[p].append(c1 - c0)
                        write_cpu[p].append(c3 - c2)
                        wall[p].append(w1 - w0)
        finally:
            for a, b, *_ in pairs.values():
                a.close()
                b.close()
        for p in pairs:
            pc, wc = float(np.median(post_cpu[p])) * 1e6, float(np.median(write_cpu[p])) * 1e6
            gbps = n * blk / float(np.median(wall[p])) / 1e9
            lines.append(f"{case:<11} {p:<7} {pc:>14.0f} {pc / n:>9.3f} {wc:>15.0f} {wc / n:>9.3f} {gbps:>14.2f}")
    print("\n".join(lines))
