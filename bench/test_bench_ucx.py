"""Throughput of the ucx backend against raw memcpy, the loopback backend and NIXL, both
agents in ONE process: the secondary table. The primary raw comparison runs the two agents in
two processes, the real prefill/decode topology: ``bench/test_bench_ucx_xproc.py`` (NIXL is
handicapped in one process: 4096 x 16 KiB ~1.5 GB/s here vs ~3.3 across two).

Run: ``cd /work/main && python -m pytest bench/test_bench_ucx.py -q -s`` (``-s`` shows the
summary table with GB/s and the ratios vs NIXL and memcpy). NIXL rows run when ``nixl_cu12``
(or ``nixl``) is importable — it is an optional extra, e.g.
``pip install --no-deps --target /tmp/nixl-target nixl-cu12`` then ``PYTHONPATH=/tmp/nixl-target``
— and are skipped with the reason otherwise.

Cases: 16 MiB and 256 MiB contiguous, 4096 x 16 KiB scattered (random block order on both
sides), READ and WRITE, between two agents of one process (CPU memory). Every system moves
the same bytes between the same two buffers, and each one's first round is checked byte
for byte. Both are polled the same way, every ``POLL_S`` (50 us): NIXL with ``check_xfer_state``,
kvtransport with ``Transfer.status()``. (``Transfer.wait()`` sleeps with a back-off capped at
1 ms, which costs up to ~1 ms per transfer: about -30 % at 16 MiB on this machine; a tight
spin starves the progress threads on 2 cores.) Only one system's agents exist at a time (tests run
grouped by system; the previous system is closed first), because NIXL's progress thread
polls even when idle and would otherwise slow whatever is measured after it.
"""

from __future__ import annotations

import gc
import json
import os
import time
from collections.abc import Callable

import numpy as np
import pytest

import kvtransport as kvt

BUF = 256 << 20
BLOCK = 16 << 10
CASES = {"16MiB": (1, 16 << 20), "256MiB": (1, 256 << 20), "4096x16KiB": (4096, BLOCK)}
ROUNDS = {"16MiB": 20, "256MiB": 4, "4096x16KiB": 10}
OPS = ["READ", "WRITE"]
SYSTEMS = ["memcpy", "loopback", "ucx-tcp", "ucx-shm", "ucx-cma+tcp", "nixl-default", "nixl-tcp", "nixl-shm"]
RESULTS: dict[tuple[str, str, str], float] = {}
#: Both kvtransport and NIXL are polled for completion every POLL_S seconds (a tight spin
#: starves the progress threads on a 2-core machine; Transfer.wait() backs off to 1 ms sleeps).
POLL_S = 5e-5
OUT = os.environ.get("KVT_BENCH_UCX_OUT", "/tmp/kvt_bench_ucx.json")


def _import_nixl():
    for mod in ("nixl_cu12", "nixl._api", "nixl"):
        try:
            m = __import__(mod, fromlist=["nixl_agent"])
            if hasattr(m, "nixl_agent"):
                return m
        except Exception:  # noqa: S112 - any import failure means "not available"
            continue
    return None


@pytest.fixture(scope="module")
def buffers():
    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, BUF, dtype=np.uint8)  # initiator side
    b = rng.integers(0, 256, BUF, dtype=np.uint8)  # target side
    nblk = BUF // BLOCK
    scat = (rng.permutation(nblk)[:4096].astype(np.int64) * BLOCK,
            rng.permutation(nblk)[:4096].astype(np.int64) * BLOCK)
    pristine = rng.integers(0, 256, BUF, dtype=np.uint8)
    yield a, b, scat, pristine
    _report()


def _layout(case: str, scat) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(initiator offsets, target offsets, lengths) of a case."""
    n, size = CASES[case]
    if n == 1:
        return np.zeros(1, np.int64), np.zeros(1, np.int64), np.full(1, size, np.int64)
    return scat[0], scat[1], np.full(n, size, np.int64)


def _check(op: str, a: np.ndarray, b: np.ndarray, ia, tb, ln) -> None:
    src, dst, so, do = (b, a, tb, ia) if op == "READ" else (a, b, ia, tb)
    for k in np.linspace(0, len(ln) - 1, min(len(ln), 64)).astype(int):
        s, d, n = int(so[k]), int(do[k]), int(ln[k])
        assert np.array_equal(dst[d : d + n], src[s : s + n]), f"bytes differ in segment {k}"


# -- systems: each returns a callable running one transfer to completion ---------------------
def _memcpy(a, b, op, ia, tb, ln) -> Callable[[], None]:
    src, dst, so, do = (b, a, tb, ia) if op == "READ" else (a, b, ia, tb)
    if len(ln) == 1:
        n = int(ln[0])
        return lambda: np.copyto(dst[:n], src[:n])
    sblk, dblk = src.reshape(-1, BLOCK), dst.reshape(-1, BLOCK)
    si, di = so // BLOCK, do // BLOCK

    def run() -> None:  # vectorised gather/scatter: the best numpy can do for blocks
        dblk[di] = sblk[si]

    return run


_MEMCPY = object()


class _KvtPair:
    def __init__(self, backend: str, a, b, **opts):
        self.i = kvt.open(backend, name=f"bench-i-{backend}", default_timeout_s=120, **opts)
        self.t = kvt.open(backend, name=f"bench-t-{backend}", default_timeout_s=120, **opts)
        self.ri, self.rt = self.i.register(a), self.t.register(b)
        self.peer = self.i.connect(self.t.metadata())
        self.t.connect(self.i.metadata())

    def runner(self, op, ia, tb, ln) -> Callable[[], None]:
        local, remote = self.ri.segments(ia, ln), self.peer.region(self.rt.id).segments(tb, ln)
        fn = self.i.read if op == "READ" else self.i.write

        def run() -> None:
            t = fn(self.peer, local, remote)
            while not (st := t.status()).done:  # same polling loop as NIXL's below
                time.sleep(POLL_S)
            assert st.ok, st.reason
            t.release()

        return run

    def close(self) -> None:
        self.i.close()
        self.t.close()


class _NixlPair:
    def __init__(self, m, a, b, variant: str):
        env = {"nixl-default": None, "nixl-tcp": "tcp", "nixl-shm": "sysv,posix,cma"}[variant]
        old = os.environ.get("UCX_TLS")
        if env:
            os.environ["UCX_TLS"] = env  # NIXL has no per-agent transport option: env at creation
        try:
            cfg = m.nixl_agent_config(backends=[])
            self.A = m.nixl_agent(f"nixl-i-{variant}", cfg)
            self.B = m.nixl_agent(f"nixl-t-{variant}", cfg)
            params = {"ucx_error_handling_mode": "none"} if variant == "nixl-shm" else {}
            for ag in (self.A, self.B):
                ag.create_backend("UCX", params)
        finally:
            if env:
                if old is None:
                    os.environ.pop("UCX_TLS", None)
                else:
                    os.environ["UCX_TLS"] = old
        self.a, self.b = a, b
        self.ra = self.A.register_memory(self.A.get_reg_descs([(a.ctypes.data, a.nbytes, 0, "")], "DRAM"))
        self.rb = self.B.register_memory(self.B.get_reg_descs([(b.ctypes.data, b.nbytes, 0, "")], "DRAM"))
        self.remote = self.A.add_remote_agent(self.B.get_agent_metadata())
        self.B.add_remote_agent(self.A.get_agent_metadata())

    def runner(self, op, ia, tb, ln) -> Callable[[], None]:
        def descs(base: int, offs: np.ndarray) -> np.ndarray:
            d = np.zeros((len(offs), 3), np.int64)
            d[:, 0], d[:, 1] = base + offs, ln
            return d

        loc = self.A.get_xfer_descs(descs(self.a.ctypes.data, ia), "DRAM")
        rem = self.A.get_xfer_descs(descs(self.b.ctypes.data, tb), "DRAM")

        def run() -> None:
            h = self.A.initialize_xfer(op, loc, rem, self.remote)
            st = self.A.transfer(h)
            while st == "PROC":
                time.sleep(POLL_S)
                st = self.A.check_xfer_state(h)
            self.A.release_xfer_handle(h)
            assert st == "DONE", st

        return run

    def close(self) -> None:
        # NIXL's progress thread polls even when idle (~1 core per agent pair measured here):
        # destroy the agents so they do not slow the systems measured after them.
        try:
            self.A.deregister_memory(self.ra)
            self.B.deregister_memory(self.rb)
        except Exception:
            pass
        self.A = self.B = self.ra = self.rb = None
        gc.collect()


@pytest.fixture(scope="module")
def systems(buffers):
    a, b, _, _ = buffers
    made: dict[str, object] = {}
    yield made, a, b
    for s in made.values():
        if hasattr(s, "close"):
            s.close()


def _get_system(name: str, systems):
    made, a, b = systems
    if name in made:
        if isinstance(made[name], str):
            pytest.skip(made[name])
        return made[name]
    for other, obj in list(made.items()):  # one system alive at a time: no CPU stolen by idle ones
        if hasattr(obj, "close"):
            obj.close()
            made[other] = f"{other} already measured and closed"
    try:
        if name == "memcpy":
            made[name] = _MEMCPY
        elif name == "loopback":
            made[name] = _KvtPair("loopback", a, b)
        elif name.startswith("ucx-"):
            made[name] = _KvtPair("ucx", a, b, tls=name.split("-", 1)[1])
        else:
            m = _import_nixl()
            if m is None:
                made[name] = "NIXL not importable (install the optional extra nixl-cu12 to compare)"
                pytest.skip(made[name])
            made[name] = _NixlPair(m, a, b, name)
    except pytest.skip.Exception:
        raise
    except Exception as exc:
        made[name] = f"{name} unavailable: {type(exc).__name__}: {exc}"
        pytest.skip(made[name])
    return made[name]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("system", SYSTEMS)
def test_throughput(benchmark, buffers, systems, system, op, case):
    a, b, scat, pristine = buffers
    sysobj = _get_system(system, systems)
    ia, tb, ln = _layout(case, scat)
    run = _memcpy(a, b, op, ia, tb, ln) if sysobj is _MEMCPY else sysobj.runner(op, ia, tb, ln)
    # correctness first: fresh random source, scribbled destination, move once, compare
    src, dst = (b, a) if op == "READ" else (a, b)
    np.copyto(src, pristine)
    dst.fill(0xA5)
    run()
    _check(op, a, b, ia, tb, ln)
    benchmark.pedantic(run, rounds=ROUNDS[case], iterations=1, warmup_rounds=1)
    nbytes = int(ln.sum())
    gbps = nbytes / benchmark.stats.stats.median / 1e9
    benchmark.extra_info["GB/s"] = round(gbps, 3)
    RESULTS[(system, op, case)] = gbps


#: The NIXL configuration each ucx configuration is compared with (same transports, same
#: error handling): tcp <-> tcp; shm (no peer error handling) <-> shm with
#: ucx_error_handling_mode=none; cma+tcp (peer error handling, cma data) <-> NIXL's default.
SAME_NIXL = {"ucx-tcp": "nixl-tcp", "ucx-shm": "nixl-shm", "ucx-cma+tcp": "nixl-default"}


def _report() -> None:
    if not RESULTS:
        return
    rows = []
    for case in CASES:
        for op in OPS:
            best = max((RESULTS.get((s, op, case), 0.0) for s in SYSTEMS if s.startswith("nixl")), default=0.0)
            mem = RESULTS.get(("memcpy", op, case), 0.0)
            for s in SYSTEMS:
                g = RESULTS.get((s, op, case))
                if g is None:
                    continue
                same = RESULTS.get((SAME_NIXL.get(s, ""), op, case))
                rows.append({"case": case, "op": op, "system": s, "GB/s": round(g, 3),
                             "vs_same_nixl": round(g / same, 2) if same else None,
                             "vs_best_nixl": round(g / best, 2) if best else None,
                             "vs_memcpy": round(g / mem, 3) if mem else None})

    def f(v) -> str:
        return "-" if v is None else str(v)

    lines = [f"{'case':<11} {'op':<5} {'system':<13} {'GB/s':>7} {'/same-nixl':>10} {'/best-nixl':>10} {'/memcpy':>8}"]
    for r in rows:
        lines.append(f"{r['case']:<11} {r['op']:<5} {r['system']:<13} {r['GB/s']:>7.2f} "
                     f"{f(r['vs_same_nixl']):>10} {f(r['vs_best_nixl']):>10} {f(r['vs_memcpy']):>8}")
    print("\n" + "\n".join(lines))
    try:
        with open(OUT, "w") as fh:
            json.dump({"when": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": rows}, fh, indent=1)
    except OSError:
        pass
