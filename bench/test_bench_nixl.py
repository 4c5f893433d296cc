"""Overhead of kvtransport's ``nixl`` backend over raw NIXL, two processes and one.

Run: ``cd /work/main && .venv/bin/python -m pytest bench/test_bench_nixl.py -q -s`` (``-s``
prints the table). Needs the ``nixl`` extra (``pip install 'kvtransport[nixl]'``).

Topologies (``$KVT_BENCH_NIXL_TOPOLOGIES``, default both): ``xproc`` — the initiator in
this process, the target in a spawned child (the real prefill/decode topology);
``inproc`` — the same target in this process. Both systems use the **same two buffers** and
the **same far NIXL agent**: the target is one kvtransport agent, and raw NIXL connects to
the NIXL agent inside it (its metadata read from the blob kvtransport exports). The
initiator holds a raw NIXL agent and a kvtransport agent on the same buffer. All use
NIXL's UCX plugin with the same (default) UCX transports; which agents run NIXL's progress
thread depends on the CPU placement below.

* raw NIXL: the fastest documented path — the transfer is prepared once per case
  (``initialize_xfer`` from ``(n, 3)`` numpy descriptor arrays) and re-posted each round
  with ``transfer()``; completion polled with ``check_xfer_state`` every ``POLL_S``;
* kvtransport, prepared (the like-for-like row, which the targets apply to): the transfer
  is prepared once per case (``Agent.prepare``: validation and merging) and posted each
  round with ``Agent.post``; the backend re-posts its finished NIXL request. Completion
  awaited with ``Transfer.wait()`` (kvtransport's documented way: it sleeps until the
  backend signals, where a ``status()`` loop every ``POLL_S`` would take CPU from the
  poster thread's copy above ``inline_post_bytes`` -- measured 0.74-0.83 of raw on the
  scattered case with such a loop, ~1.0 with the copy inline), then ``release()``;
* kvtransport, one-off: ``Agent.read``/``write`` each round (validation, merging,
  descriptor lists and ``initialize_xfer`` every time), polled the same way.

CPU placement (``$KVT_BENCH_NIXL_PLACEMENT``, default ``split``). An idle NIXL agent's
progress thread never sleeps (NIXL's Python API starts it with no delay between polls:
measured 1.0 CPU-s/s per agent here). Until the night of 2026-12-04 this bench held four agents (raw and
kvtransport on each side); left to the scheduler, the thread timed shared this machine's
two cores with four such threads, and every cell measured how often it was pre-empted (16 MiB READ ratios
0.82-0.98 across five runs; the same run swung 0.79-1.23 between cells). ``split`` runs the
two initiator agents without a progress thread (with shared memory the copy runs inside
the initiator's ``transfer()``, and each system finds completion by its own polling:
``check_xfer_state`` for raw NIXL, its documented way, ``Transfer.wait()`` for kvtransport)
and keeps the initiator's threads on CPU 0; in ``xproc`` the target process runs on CPU 1
(threads inherit the CPU set of their creator). The target agent keeps its progress
thread (a target must progress to connect: without one, connecting hung, measured). In
``inproc`` its thread is left unpinned. One far agent instead of two (the night of 2026-12-04): with a
raw and a kvtransport target agent, ``inproc`` had two idle progress threads on two cores
beside the timed thread, and its 256 MiB and scattered transfers were bimodal (IQR 20-40
ms, 16-33 ms: the copy shared its CPU with a spinning thread or did not) at 7-9 and 2 GB/s;
with one far agent they ran at 11-12 and 4 GB/s, both systems alike (measured).
``shared``: every agent with its progress thread, no pinning (the setup before 2026-12-04
evening).

Rounds run in blocks per system, the blocks interleaved (who goes first rotates), so load
from other processes on this shared machine hits all alike; the first transfer of each
block is not counted (measured: the first transfer after *another* NIXL agent was busy is
slower by up to a few ms here, whichever system it is). The ratio is of medians.
Targets (issue 15): our layer's overhead (kvtransport time / raw time - 1) <= 5 % at 16 MiB
and above, <= 10 % scattered, i.e. ``ratio`` (raw time / kvtransport time) >= 1/1.05 = 0.952
and >= 1/1.10 = 0.909. (Until the night of 2026-12-04 this bench compared the ratio with 0.95 / 0.90,
which allowed 5.3 % / 11.1 %.)
Every case's first round of each system is checked byte for byte. No timing is asserted.
"""

from __future__ import annotations

import functools
import hashlib
import json
import multiprocessing as mp
import os
import time

import numpy as np
import pytest

import kvtransport as kvt

BUF = 256 << 20
BLOCK = 16 << 10
CASES = {"16MiB": (1, 16 << 20), "256MiB": (1, 256 << 20), "4096x16KiB": (4096, BLOCK)}
#: Counted rounds per system and case. Many for 16 MiB (~1 ms each): with 60, the median
#: of the same code's 16 MiB cells moved by +-1.5 % between runs, as much as the margin
#: the target leaves; with 600, by about +-1 % (measured 2026-12-05, see docs/NIXL.md).
ROUNDS = {"16MiB": 600, "256MiB": 36, "4096x16KiB": 72}
#: Counted rounds are run in BLOCKS blocks per system, the systems' blocks interleaved.
BLOCKS = 12
#: The issue's limits on our overhead (kvtransport time / raw time - 1), in percent.
MAX_OVERHEAD_PCT = {"16MiB": 5.0, "256MiB": 5.0, "4096x16KiB": 10.0}
POLL_S = 5e-5
#: ``xproc``: the far side in a spawned child (the real topology); ``inproc``: in this process.
TOPOLOGIES = os.environ.get("KVT_BENCH_NIXL_TOPOLOGIES", "xproc,inproc").split(",")
OUT = os.environ.get("KVT_BENCH_NIXL_OUT", "/tmp/kvt_bench_nixl.json")
#: ``split`` (initiator on CPU 0 without progress threads, target on CPU 1) or ``shared``.
PLACEMENT = os.environ.get("KVT_BENCH_NIXL_PLACEMENT", "split")
if PLACEMENT not in ("split", "shared"):
    raise ValueError(f"KVT_BENCH_NIXL_PLACEMENT must be 'split' or 'shared', got {PLACEMENT!r}")
SPLIT = PLACEMENT == "split" and len(os.sched_getaffinity(0)) >= 2
RESULTS: list[dict] = []


@functools.lru_cache(maxsize=4)
def _pattern(seed: int, n: int) -> np.ndarray:
    """Random bytes, made once per seed (``integers`` over 256 MiB took seconds per check here)."""
    p = np.frombuffer(np.random.default_rng(seed).bytes(n), np.uint8)
    p.flags.writeable = False
    return p


def _sha(buf: np.ndarray, offs: np.ndarray, n: int) -> str:
    h = hashlib.sha256()
    for o in offs.tolist():
        h.update(buf[o:o + n].tobytes())
    return h.hexdigest()


class _Target:
    """Buffer B behind one kvtransport ``nixl`` agent: the far side of every case.

    Raw NIXL connects to the NIXL agent inside that kvtransport agent (its metadata read
    from the blob kvtransport exports), so both systems target the same NIXL agent and the
    far side runs one idle progress thread, not two (see CPU placement above)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.buf = np.zeros(size, np.uint8)
        self.kv = kvt.open("nixl", name="bench-kvt-t")
        self.region = self.kv.register(self.buf)

    def hello(self) -> tuple:
        from kvtransport.metadata import decode_metadata
        from kvtransport_nixl.wire import CODEC as DEC
        md = self.kv.metadata()
        raw_md = DEC.decode(decode_metadata(md).blob).nixl_md
        return raw_md, self.buf.ctypes.data, md, self.region.id

    def handle(self, cmd: str, arg):
        if cmd == "fill":
            self.buf[:] = _pattern(arg, self.size)
            return True
        if cmd == "sha":
            offs, n = arg
            return _sha(self.buf, offs, n)
        self.kv.close()  # drops its NIXL agent: NIXL stops a progress thread only then
        return None


def _pin(cpu: int) -> None:
    """This thread (and threads it starts from now on) on ``cpu`` only."""
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[cpu]})


def _target_main(conn, size: int) -> None:  # pragma: no cover - runs in the child
    if SPLIT:
        _pin(1)
    t = _Target(size)
    conn.send(t.hello())
    while True:
        cmd, arg = conn.recv()
        out = t.handle(cmd, arg)
        if cmd == "exit":
            break
        conn.send(out)


class _InProcess:
    """The same far side in this process, behind the pipe interface of the child."""

    def __init__(self, size: int) -> None:
        # The target's progress thread is not pinned here: when the far side had two
        # agents, pinned to one CPU together, they went with ~8 ms stalls in a quarter of
        # the transfers of both systems (in one process the initiator's transfers
        # apparently wait for the target's worker).
        self.t = _Target(size)
        self._out = [self.t.hello()]

    def send(self, msg) -> None:
        self._out.append(self.t.handle(*msg))

    def recv(self):
        return self._out.pop(0)


class _Bench:
    def __init__(self, topology: str) -> None:
        from kvtransport_nixl import probe as _probe
        m = _probe.nixl()
        self.topology = topology
        self.proc = None
        self._cpus = os.sched_getaffinity(0)  # restored by close()
        if topology == "xproc":
            ctx = mp.get_context("spawn")
            self.conn, child = ctx.Pipe()
            self.proc = ctx.Process(target=_target_main, args=(child, BUF), daemon=True)
            self.proc.start()
        else:
            self.conn = _InProcess(BUF)
        raw_md, self.taddr, kv_md, self.trid = self.conn.recv()
        if SPLIT:
            _pin(0)
        self.buf = np.zeros(BUF, np.uint8)
        self.raw = m.nixl_agent(f"bench-raw-i-{os.getpid()}",
                                m.nixl_agent_config(enable_prog_thread=not SPLIT, backends=["UCX"]))
        self.raw.register_memory(self.raw.get_reg_descs(np.array([[self.buf.ctypes.data, BUF, 0]], np.uint64),
                                                        "DRAM"))
        self.raw_md = raw_md
        self.raw_peer = self.raw.add_remote_agent(raw_md)
        self.kv = kvt.open("nixl", name="bench-kvt-i", default_timeout_s=120, progress_thread=not SPLIT)
        self.region = self.kv.register(self.buf)
        self.peer = self.kv.connect(kv_md)
        rng = np.random.default_rng(0)
        nblk = BUF // BLOCK
        self.scat = (rng.permutation(nblk)[:4096].astype(np.int64) * BLOCK,
                     rng.permutation(nblk)[:4096].astype(np.int64) * BLOCK)

    def call(self, cmd: str, arg=None):
        self.conn.send((cmd, arg))
        return self.conn.recv()

    def layout(self, case: str) -> tuple[np.ndarray, np.ndarray, int]:
        n, size = CASES[case]
        if n == 1:
            return np.zeros(1, np.int64), np.zeros(1, np.int64), size
        return self.scat[0], self.scat[1], size

    def raw_runner(self, op: str, lo: np.ndarray, ro: np.ndarray, n: int):
        def descs(base: int, offs: np.ndarray) -> np.ndarray:
            d = np.zeros((len(offs), 3), np.uint64)
            d[:, 0], d[:, 1] = base + offs, n
            return d
        loc = self.raw.get_xfer_descs(descs(self.buf.ctypes.data, lo), "DRAM")
        rem = self.raw.get_xfer_descs(descs(self.taddr, ro), "DRAM")
        h = self.raw.initialize_xfer(op, loc, rem, self.raw_peer)

        def run() -> None:
            st = self.raw.transfer(h)
            while st == "PROC":
                time.sleep(POLL_S)
                st = self.raw.check_xfer_state(h)
            assert st == "DONE", st
        return run, h

    def kvt_runner(self, op: str, lo: np.ndarray, ro: np.ndarray, n: int, prepared: bool):
        local = self.region.segments(lo, np.full(len(lo), n))
        remote = self.peer.region(self.trid).segments(ro, np.full(len(ro), n))
        kop = kvt.Op.READ if op == "READ" else kvt.Op.WRITE
        prep = self.kv.prepare(kop, self.peer, local, remote)
        fn = self.kv.read if op == "READ" else self.kv.write

        def run() -> None:
            t = self.kv.post(prep) if prepared else fn(self.peer, local, remote)
            st = t.wait()
            assert st.ok, st.reason
            t.release()
        return run

    def check(self, op: str, run, lo: np.ndarray, ro: np.ndarray, n: int) -> None:
        if op == "READ":
            self.call("fill", 21)
            self.buf.fill(0xA5)
            run()
            expect = _pattern(21, BUF)
            assert _sha(self.buf, lo, n) == _sha(expect, ro, n), "READ bytes differ"
        else:
            self.call("fill", 22)
            self.buf[:] = _pattern(23, BUF)
            run()
            assert self.call("sha", (ro, n)) == _sha(self.buf, lo, n), "WRITE bytes differ"

    def close(self) -> None:
        """Stop every NIXL agent of this case now: NIXL's progress threads poll without
        pausing until their agent is destroyed, and left running they took CPU from the
        benchmarks run after this module in the same session."""
        self.kv.close()
        self.raw.remove_remote_agent(self.raw_peer)
        self.raw = None
        try:
            self.conn.send(("exit", None))
        except (OSError, EOFError):
            pass
        if self.proc is not None:
            self.proc.join(10)
        os.sched_setaffinity(0, self._cpus)


@pytest.fixture(scope="module", params=TOPOLOGIES)
def bench(request):
    from kvtransport.testing.required import skip_unless_usable
    skip_unless_usable("nixl")
    b = _Bench(request.param)
    yield b
    b.close()
    _report(request.param)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("op", ["READ", "WRITE"])
def test_kvtransport_over_nixl_vs_raw_nixl(bench, op, case):
    lo, ro, n = bench.layout(case)
    raw, handle = bench.raw_runner(op, lo, ro, n)
    systems = {"raw": raw, "kvt": bench.kvt_runner(op, lo, ro, n, prepared=True),
               "kvt1": bench.kvt_runner(op, lo, ro, n, prepared=False)}
    for fn in systems.values():
        bench.check(op, fn, lo, ro, n)
    times: dict[str, list[float]] = {name: [] for name in systems}
    order = list(systems.items())
    per_block = max(ROUNDS[case] // BLOCKS, 1)
    for blk in range(BLOCKS):
        for name, fn in order[blk % 3:] + order[:blk % 3]:  # who goes first rotates
            fn()  # not counted: the first transfer after another agent ran pays for the switch
            for _ in range(per_block):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    bench.raw.release_xfer_handle(handle)
    nbytes = len(lo) * n
    raw_s, kvt_s, one_s = (float(np.median(times[k])) for k in ("raw", "kvt", "kvt1"))
    q = {k: [round(float(x) * 1e3, 3) for x in np.percentile(times[k], [25, 75])] for k in ("raw", "kvt")}
    RESULTS.append({"topology": bench.topology, "case": case, "op": op, "raw_ms_iqr": q["raw"],
                    "kvt_ms_iqr": q["kvt"], "raw_GBps": round(nbytes / raw_s / 1e9, 3),
                    "kvt_GBps": round(nbytes / kvt_s / 1e9, 3), "ratio": round(raw_s / kvt_s, 3),
                    "overhead_pct": round(100 * (kvt_s - raw_s) / raw_s, 1),
                    "max_overhead_pct": MAX_OVERHEAD_PCT[case],
                    "met": kvt_s <= raw_s * (1 + MAX_OVERHEAD_PCT[case] / 100),
                    "oneoff_GBps": round(nbytes / one_s / 1e9, 3), "oneoff_ratio": round(raw_s / one_s, 3),
                    "rounds": ROUNDS[case]})


def _report(topology: str) -> None:
    """Print this topology's rows; write every row so far to ``OUT``."""
    if not RESULTS:
        return
    lines = [f"{'topology':<8} {'case':<11} {'op':<5} {'raw GB/s':>9} {'kvt GB/s':>9} {'kvt/raw':>8} {'overhead':>9} "
             f"{'target':<12} {'one-off GB/s':>12} {'one-off/raw':>11}"]
    for r in (r for r in RESULTS if r["topology"] == topology):
        ok = "met" if r["met"] else "MISSED"
        lines.append(f"{r['topology']:<8} {r['case']:<11} {r['op']:<5} {r['raw_GBps']:>9.2f} {r['kvt_GBps']:>9.2f} "
                     f"{r['ratio']:>8.3f} {r['overhead_pct']:>8.1f}% <={r['max_overhead_pct']:>4.0f}% {ok:<6} "
                     f"{r['oneoff_GBps']:>12.2f} {r['oneoff_ratio']:>11.3f}")
    print("\nkvtransport-over-nixl vs raw NIXL (medians)\n" + "\n".join(lines))
    try:
        with open(OUT, "w") as fh:
            json.dump({"when": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": RESULTS}, fh, indent=1)
    except OSError:
        pass
