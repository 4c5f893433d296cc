"""What limits cross-process cross-memory-attach copies of scattered blocks (issue 18, point 3).

Run: ``flock /tmp/kvt-bench.lock python bench/loopback_cma_probe.py`` (not a pytest file: it
prints a table and asserts only that the bytes arrived). A child process holds a 256 MiB buffer;
this process reads 4096 x 16 KiB blocks (random order on both sides) from it with
``process_vm_readv`` (``kvtransport_loopback.cma.copy_segments``) in several ways, beside a
single-thread C ``memcpy`` of the same layout between two buffers of this process:

* ``cma tT bB``: T threads, each taking its share of the blocks in calls of B iovecs
  (the loopback backend: 2 threads, 1024 = IOV_MAX);
* ``fresh dst``: as ``cma t2 b1024`` but into a newly mapped, never touched buffer every round
  (first-touch page faults on the destination).

Rounds: median of 9 after one untimed, three passes (the VM is shared: compare within a pass).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time

import numpy as np

from kvtransport_loopback import cma
from kvtransport_ucx import native as _native

BUF = 256 << 20
BLK = 16 << 10
N = 4096


def _child(conn) -> None:  # pragma: no cover - runs in the child
    b = np.random.default_rng(1).integers(0, 256, BUF, dtype=np.uint8)
    conn.send((os.getpid(), b.ctypes.data))
    conn.recv()


def main() -> None:
    ctx = mp.get_context("spawn")
    pc, cc = ctx.Pipe()
    p = ctx.Process(target=_child, args=(cc,))
    p.start()
    pid, raddr = pc.recv()
    a = np.ones(BUF, np.uint8)
    rng = np.random.default_rng(0)
    lo = rng.permutation(BUF // BLK)[:N].astype(np.uint64) * BLK
    ro = rng.permutation(BUF // BLK)[:N].astype(np.uint64) * BLK
    ln = np.full(N, BLK, np.uint64)
    ra = ro + np.uint64(raddr)
    src = np.random.default_rng(1).integers(0, 256, BUF, dtype=np.uint8)  # same bytes as the child's
    lib, why = _native.library()
    assert lib is not None, why

    def memcpy() -> None:
        la = lo + np.uint64(a.ctypes.data)
        sa = ro + np.uint64(src.ctypes.data)
        lib.kvt_memcpy_segments(la.ctypes.data, sa.ctypes.data, ln.ctypes.data, N)

    def cma_read(dst: np.ndarray, threads: int, batch: int) -> None:
        la = lo + np.uint64(dst.ctypes.data)

        def work(ix: np.ndarray) -> None:
            for s in range(0, len(ix), batch):
                j = ix[s:s + batch]
                cma.copy_segments("read", pid, la[j], ra[j], ln[j])
        parts = np.array_split(np.arange(N), threads)
        if threads == 1:
            work(parts[0])
            return
        ts = [threading.Thread(target=work, args=(ix,)) for ix in parts]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    def fresh() -> None:
        cma_read(np.empty(BUF, np.uint8), 2, 1024)  # new mapping: every page faults on first write

    def gbps(fn, reps: int = 9) -> float:
        fn()
        xs = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            xs.append(time.perf_counter() - t0)
        return N * BLK / float(np.median(xs)) / 1e9

    variants = {"memcpy": memcpy}
    for th in (1, 2, 4):
        for b in (64, 1024):
            variants[f"cma t{th} b{b}"] = (lambda th=th, b=b: cma_read(a, th, b))
    variants["fresh dst t2 b1024"] = fresh
    for k in range(3):
        res = {name: gbps(fn) for name, fn in variants.items()}
        m = res["memcpy"]
        print(f"pass {k + 1}: " + "  ".join(f"{n}={v:.2f} ({v / m:.2f}x)" for n, v in res.items()), flush=True)
    cma_read(a, 2, 1024)
    for i in (0, N // 2, N - 1):
        assert np.array_equal(a[int(lo[i]):int(lo[i]) + BLK], src[int(ro[i]):int(ro[i]) + BLK])
    pc.send(1)
    p.join()


if __name__ == "__main__":
    main()
