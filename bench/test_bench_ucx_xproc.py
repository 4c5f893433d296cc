"""Raw throughput in the real topology: ucx vs NIXL vs loopback vs memcpy, two processes.

Run: ``python -m pytest bench/test_bench_ucx_xproc.py -q -s -p no:cacheprovider`` (``-s``
prints the tables); on a shared machine under the bench lock:
``flock /tmp/kvt-bench.lock python -m pytest ...``. ``KVT_BENCH_RUNS`` (default 5) sets how
many runs one invocation makes; raw figures go to ``KVT_BENCH_XPROC_OUT``
(``/tmp/kvt_bench_ucx_xproc.json``). This is the primary raw comparison (issue 18);
``bench/test_bench_ucx.py`` keeps the in-process figures as a secondary table.

Topology: the initiator in this process, the target in a spawned child, as prefill and
decode always are. Both processes allocate their 256 MiB buffer once; every system
registers the **same two buffers** and moves the same shapes (16 MiB, 256 MiB, 4096 x 16 KiB
scattered in random block order on both sides), READ and WRITE. Only one system's agents
exist at a time (both sides closed before the next opens: NIXL's progress thread polls when
idle). Each system runs in its best documented configuration:

* NIXL (``nixl-shm``: ``UCX_TLS=sysv,posix,cma``, ``ucx_error_handling_mode=none``;
  ``nixl-tcp``: ``UCX_TLS=tcp``): transfer prepared once per case (``initialize_xfer``),
  re-posted each round with ``transfer()``; the initiator has no progress thread and polls
  ``check_xfer_state`` in a tight loop (each call progresses its worker). The target has no
  progress thread over shm (cma needs no target work) and NIXL's progress thread over tcp
  (the target must receive the bytes).
* kvtransport (``ucx-shm``: ``tls="shm"``; ``ucx-tcp``: ``tls="tcp"``; ``loopback``): public
  API, transfer prepared once per case (``Agent.prepare``), posted each round with
  ``Agent.post``, completion by ``Transfer.wait()``. ``ucx-shm-ctypes`` is ``ucx-shm`` with
  the Python posting fallback (``post="ctypes"``), to show what the compiled path buys.
* memcpy: single-thread ``memcpy`` of the same segments between two buffers of this process
  (one C ``memcpy`` per segment, ``kvt_memcpy_segments`` from the ucx backend's compiled
  library; numpy when it was not built), the baseline of the loopback target (>= 0.8x).

Per run, each (system, case, op) is the median of ``ROUNDS`` timed transfers after one
untimed one; ratios are taken within a run (same minute, same load), then reported as the
median over the runs with their min-max and how many runs missed the target. The system
order rotates between runs. Every system's first transfer of each case is checked byte for
byte in the first run. No timing is asserted: the figures go to docs/UCX.md as measured.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import kvtransport as kvt

BUF = 256 << 20
BLOCK = 16 << 10
CASES = {"16MiB": (1, 16 << 20), "256MiB": (1, 256 << 20), "4096x16KiB": (4096, BLOCK)}
#: KVT_BENCH_CASES=16MiB,4096x16KiB (comma-separated) measures a subset of the cases.
CASES = {c: v for c, v in CASES.items() if c in (os.environ.get("KVT_BENCH_CASES") or ",".join(CASES)).split(",")}
ROUNDS = {"16MiB": 11, "256MiB": 3, "4096x16KiB": 7}
OPS = ["READ", "WRITE"]
ALL_SYSTEMS = ["memcpy", "loopback", "ucx-shm", "ucx-shm-ctypes", "nixl-shm", "ucx-tcp", "nixl-tcp"]
#: KVT_BENCH_SYSTEMS=memcpy,loopback (comma-separated) measures a subset.
SYSTEMS = [s for s in os.environ.get("KVT_BENCH_SYSTEMS", ",".join(ALL_SYSTEMS)).split(",") if s in ALL_SYSTEMS]
#: (kvtransport system, NIXL system it is compared with): same transports.
PAIRS = [("ucx-shm", "nixl-shm"), ("ucx-shm-ctypes", "nixl-shm"), ("ucx-tcp", "nixl-tcp")]
KVT_OPTS: dict[str, tuple[str, dict[str, Any]]] = {
    "loopback": ("loopback", {}),
    "ucx-shm": ("ucx", {"tls": "shm"}),
    "ucx-shm-ctypes": ("ucx", {"tls": "shm", "post": "ctypes"}),
    "ucx-tcp": ("ucx", {"tls": "tcp"}),
}
#: KVT_BENCH_UCX_TCP_OPTS='{"ucx_config": {...}, "lanes": 1}' (JSON) adds to ucx-tcp's options, to
#: measure a setting against NIXL in one run without editing this file.
KVT_OPTS["ucx-tcp"][1].update(json.loads(os.environ.get("KVT_BENCH_UCX_TCP_OPTS") or "{}"))
NIXL_TLS = {"nixl-shm": "sysv,posix,cma", "nixl-tcp": "tcp"}
RUNS = int(os.environ.get("KVT_BENCH_RUNS", "5"))
#: KVT_BENCH_PIN="0,1" pins the initiator to CPU 0 and the target to CPU 1 (every thread the
#: systems start inherits it), as two vLLM engines pinned with VLLM_CPU_OMP_THREADS_BIND run.
#: Unset (default): the scheduler places threads freely.
PIN = [int(c) for c in os.environ.get("KVT_BENCH_PIN", "").split(",") if c.strip()]
OUT = os.environ.get("KVT_BENCH_XPROC_OUT", "/tmp/kvt_bench_ucx_xproc.json")


_PATTERNS: dict[tuple[int, int], np.ndarray] = {}


def _pattern(seed: int, n: int) -> np.ndarray:
    """Reproducible random bytes (cached: generating 256 MiB takes about a second)."""
    if (seed, n) not in _PATTERNS:
        _PATTERNS[(seed, n)] = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    return _PATTERNS[(seed, n)]


def _sha(buf: np.ndarray, offs: np.ndarray, n: int) -> str:
    h = hashlib.sha256()
    for o in offs.tolist():
        h.update(buf[o:o + n].tobytes())
    return h.hexdigest()


def _nixl_module():
    try:
        from kvtransport_nixl import probe as _probe
        return _probe.nixl()
    except Exception:  # noqa: BLE001 - any failure means "NIXL not available here"
        return None


def _nixl_agent(m, name: str, system: str, progress_thread: bool):
    """A NIXL agent with the UCX transports of ``system`` (NIXL reads UCX_TLS at creation)."""
    old = os.environ.get("UCX_TLS")
    os.environ["UCX_TLS"] = NIXL_TLS[system]
    try:
        ag = m.nixl_agent(name, m.nixl_agent_config(enable_prog_thread=progress_thread, backends=[]))
        ag.create_backend("UCX", {"ucx_error_handling_mode": "none"} if system == "nixl-shm" else {})
    finally:
        if old is None:
            os.environ.pop("UCX_TLS", None)
        else:
            os.environ["UCX_TLS"] = old
    return ag


def _pin(index: int) -> None:
    """Pin this thread (and the threads it starts later) to ``PIN[index]``, if pinning is on."""
    if len(PIN) > index:
        os.sched_setaffinity(0, {PIN[index]})


def _target_main(conn) -> None:  # pragma: no cover - runs in the child
    _pin(1)
    buf = np.zeros(BUF, np.uint8)
    buf[:] = _pattern(1, BUF)  # every page touched before any system runs
    cur: Any = None
    while True:
        cmd, arg = conn.recv()
        if cmd == "open":
            system = arg
            if system in KVT_OPTS:
                backend, opts = KVT_OPTS[system]
                cur = kvt.open(backend, name=f"xb-t-{system}", **opts)
                rid = cur.register(buf).id
                conn.send((cur.metadata(), rid))
            else:
                m = _nixl_module()
                cur = _nixl_agent(m, f"xb-t-{system}-{os.getpid()}", system, progress_thread=system == "nixl-tcp")
                cur.register_memory(cur.get_reg_descs(np.array([[buf.ctypes.data, BUF, 0]], np.uint64), "DRAM"))
                conn.send((cur.get_agent_metadata(), buf.ctypes.data))
        elif cmd == "connect":
            if hasattr(cur, "connect"):
                cur.connect(arg)
            else:
                cur.add_remote_agent(arg)
            conn.send(True)
        elif cmd == "close":
            if hasattr(cur, "close"):
                cur.close()
            cur = None
            conn.send(True)
        elif cmd == "fill":
            buf[:] = _pattern(arg, BUF)
            conn.send(True)
        elif cmd == "sha":
            conn.send(_sha(buf, *arg))
        else:
            break


class _Bench:
    """The initiator side: this process's buffer, the child and the systems' runners."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_target_main, args=(child,), daemon=True)
        self.proc.start()
        _pin(0)
        self.buf = np.zeros(BUF, np.uint8)
        self.buf[:] = _pattern(2, BUF)
        self.mirror = _pattern(1, BUF).copy()  # memcpy's source: a local buffer like the target's
        rng = np.random.default_rng(0)
        nblk = BUF // BLOCK
        self.scat = (rng.permutation(nblk)[:4096].astype(np.int64) * BLOCK,
                     rng.permutation(nblk)[:4096].astype(np.int64) * BLOCK)
        self.nixl = _nixl_module()
        self.agent: Any = None
        self.extra: Any = None

    def call(self, cmd: str, arg: Any = None) -> Any:
        self.conn.send((cmd, arg))
        return self.conn.recv()

    def layout(self, case: str) -> tuple[np.ndarray, np.ndarray, int]:
        n, size = CASES[case]
        if n == 1:
            return np.zeros(1, np.int64), np.zeros(1, np.int64), size
        return self.scat[0], self.scat[1], size

    def available(self, system: str) -> str:
        """Why ``system`` cannot run here ('' if it can)."""
        if system.startswith("nixl") and self.nixl is None:
            return "NIXL not importable (install the nixl extra: pip install 'kvtransport[nixl]')"
        return ""

    # -- one system's agents -------------------------------------------------------------
    def open(self, system: str) -> None:
        if system == "memcpy":
            return
        if system in KVT_OPTS:
            backend, opts = KVT_OPTS[system]
            md, self.extra = self.call("open", system)
            self.agent = kvt.open(backend, name=f"xb-i-{system}", default_timeout_s=120, **opts)
            self.region = self.agent.register(self.buf)
            self.peer = self.agent.connect(md)
            self.call("connect", self.agent.metadata())
        else:
            md, self.extra = self.call("open", system)
            self.agent = _nixl_agent(self.nixl, f"xb-i-{system}-{os.getpid()}", system, progress_thread=False)
            self.agent.register_memory(self.agent.get_reg_descs(
                np.array([[self.buf.ctypes.data, BUF, 0]], np.uint64), "DRAM"))
            self.peer = self.agent.add_remote_agent(md)
            self.call("connect", self.agent.get_agent_metadata())

    def close(self, system: str) -> None:
        if system == "memcpy":
            return
        if system in KVT_OPTS:
            self.agent.close()
        self.agent = self.peer = None
        self.call("close")

    def runner(self, system: str, op: str, lo: np.ndarray, ro: np.ndarray, n: int
               ) -> tuple[Callable[[], None], Callable[[], None]]:
        """(one transfer to completion, clean-up after the case)."""
        if system == "memcpy":
            return self._memcpy(op, lo, ro, n), lambda: None
        if system in KVT_OPTS:
            local = self.region.segments(lo, np.full(len(lo), n))
            remote = self.peer.region(self.extra).segments(ro, np.full(len(ro), n))
            prep = self.agent.prepare(kvt.Op.READ if op == "READ" else kvt.Op.WRITE, self.peer, local, remote)
            agent = self.agent

            def run() -> None:
                t = agent.post(prep)
                st = t.wait()
                assert st.ok, st.reason
                t.release()
            return run, lambda: None

        def descs(base: int, offs: np.ndarray) -> np.ndarray:
            d = np.zeros((len(offs), 3), np.uint64)
            d[:, 0], d[:, 1] = base + offs, n
            return d
        ag = self.agent
        h = ag.initialize_xfer(op, ag.get_xfer_descs(descs(self.buf.ctypes.data, lo), "DRAM"),
                               ag.get_xfer_descs(descs(self.extra, ro), "DRAM"), self.peer)

        def run_nixl() -> None:
            st = ag.transfer(h)
            while st == "PROC":
                st = ag.check_xfer_state(h)
            assert st == "DONE", st
        return run_nixl, lambda: ag.release_xfer_handle(h)

    def _memcpy(self, op: str, lo: np.ndarray, ro: np.ndarray, n: int) -> Callable[[], None]:
        from kvtransport_ucx import native as _native
        lib, _ = _native.library()
        # READ: target (mirror) -> local; WRITE: local -> a second local buffer (the mirror).
        src, dst, so, do = (self.mirror, self.buf, ro, lo) if op == "READ" else (self.buf, self.mirror, lo, ro)
        s = (so.astype(np.uint64) + np.uint64(src.ctypes.data))
        d = (do.astype(np.uint64) + np.uint64(dst.ctypes.data))
        ln = np.full(len(lo), n, np.uint64)
        if lib is not None:
            return lambda: lib.kvt_memcpy_segments(d.ctypes.data, s.ctypes.data, ln.ctypes.data, len(ln))

        def run() -> None:  # no compiled library: numpy per segment
            for a, b in zip(so.tolist(), do.tolist()):
                np.copyto(dst[b:b + n], src[a:a + n])
        return run

    def check(self, system: str, op: str, run: Callable[[], None], lo: np.ndarray, ro: np.ndarray, n: int) -> None:
        """One transfer on fresh bytes, compared segment by segment (both sides hashed)."""
        if system == "memcpy":
            run()
            src, dst, so, do = (self.mirror, self.buf, ro, lo) if op == "READ" else (self.buf, self.mirror, lo, ro)
            assert _sha(dst, do, n) == _sha(src, so, n), f"memcpy {op} bytes differ"
            return
        if op == "READ":
            self.call("fill", 21)
            self.buf.fill(0xA5)
            run()
            assert _sha(self.buf, lo, n) == _sha(_pattern(21, BUF), ro, n), f"{system} READ bytes differ"
        else:
            self.call("fill", 22)
            self.buf[:] = _pattern(23, BUF)
            run()
            assert self.call("sha", (ro, n)) == _sha(self.buf, lo, n), f"{system} WRITE bytes differ"

    def shutdown(self) -> None:
        try:
            self.call("exit")
        except (OSError, EOFError):
            pass
        self.proc.join(10)


def _median_gbps(run: Callable[[], None], rounds: int, nbytes: int) -> tuple[float, list[float]]:
    run()  # not counted: the first transfer after another system ran pays for the switch
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return nbytes / float(np.median(times)) / 1e9, times


def test_two_process_throughput() -> None:
    b = _Bench()
    results: list[dict[str, float]] = []  # per run: "system|op|case" -> GB/s
    skipped: dict[str, str] = {}
    try:
        for run_no in range(RUNS):
            order = SYSTEMS[run_no % len(SYSTEMS):] + SYSTEMS[:run_no % len(SYSTEMS)]
            res: dict[str, float] = {}
            for system in order:
                why = b.available(system)
                if why:
                    skipped[system] = why
                    continue
                b.open(system)
                try:
                    for case in CASES:
                        lo, ro, n = b.layout(case)
                        for op in OPS:
                            run, done = b.runner(system, op, lo, ro, n)
                            if run_no == 0:
                                b.check(system, op, run, lo, ro, n)
                            res[f"{system}|{op}|{case}"], _ = _median_gbps(run, ROUNDS[case], len(lo) * n)
                            done()
                finally:
                    b.close(system)
            results.append(res)
            print(f"\nrun {run_no + 1}/{RUNS}: " + " ".join(f"{k}={v:.2f}" for k, v in sorted(res.items())),
                  flush=True)
    finally:
        b.shutdown()
    _report(results, skipped)
    assert results and results[0], "no system could run"


def _report(results: list[dict[str, float]], skipped: dict[str, str]) -> None:
    def per_run(key: str) -> list[float]:
        return [r[key] for r in results if key in r]

    lines = ["", f"two processes, {len(results)} runs: GB/s median over runs (min-max)",
             f"{'case':<11} {'op':<5} " + " ".join(f"{s:>20}" for s in SYSTEMS)]
    for case in CASES:
        for op in OPS:
            cells = []
            for s in SYSTEMS:
                v = per_run(f"{s}|{op}|{case}")
                cells.append(f"{np.median(v):6.2f} ({min(v):.1f}-{max(v):.1f})" if v else "-")
            lines.append(f"{case:<11} {op:<5} " + " ".join(f"{c:>20}" for c in cells))
    ratio_rows: list[dict[str, Any]] = []
    lines += ["", "ratios within each run: median (min-max) [runs below target]"]
    pairs = [(k, nx, 1.1) for k, nx in PAIRS] + [("loopback", "memcpy", 0.8), ("ucx-shm", "memcpy", None)]
    for case in CASES:
        for op in OPS:
            for num, den, target in pairs:
                rs = [r[f"{num}|{op}|{case}"] / r[f"{den}|{op}|{case}"] for r in results
                      if f"{num}|{op}|{case}" in r and f"{den}|{op}|{case}" in r]
                if not rs:
                    continue
                below = sum(x < target for x in rs) if target else None
                ratio_rows.append({"case": case, "op": op, "ratio": f"{num}/{den}", "median": float(np.median(rs)),
                                   "min": min(rs), "max": max(rs), "target": target, "runs_below": below,
                                   "runs": len(rs)})
                tgt = f"[{below}/{len(rs)} below {target}]" if target else ""
                lines.append(f"{case:<11} {op:<5} {num + ' / ' + den:<28} {np.median(rs):5.2f} "
                             f"({min(rs):.2f}-{max(rs):.2f}) {tgt}")
    for s, why in skipped.items():
        lines.append(f"not measured: {s}: {why}")
    print("\n".join(lines))
    try:
        with open(OUT, "w") as fh:
            json.dump({"when": time.strftime("%Y-%m-%d %H:%M:%S"), "runs": results, "ratios": ratio_rows,
                       "skipped": skipped}, fh, indent=1)
    except OSError:
        pass


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-q", "-s", "-p", "no:cacheprovider"])
