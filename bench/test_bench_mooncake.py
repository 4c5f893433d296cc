"""kvtransport-over-mooncake against raw Mooncake, two processes and one, the same buffers.

Run: ``cd /work/main && .venv/bin/python -m pytest bench/test_bench_mooncake.py -q -s``
(``-s`` prints the table; the figures also go to ``$KVT_BENCH_MOONCAKE_OUT``, default
``/tmp/kvt_bench_mooncake.json``).

Topology ``xproc``: the initiator (this process) holds buffer A, a child process (spawned)
holds buffer B (``inproc``: the same far side in this process); each side has one kvtransport
``mooncake`` agent, P2P hand-shake over TCP on 127.0.0.1. The raw rows call Mooncake's API
on the **same engines**: the ``mooncake.engine.TransferEngine`` inside each side's agent
(buffers registered once, the same TCP connections and transport threads), so the only
difference between the rows is our layer. Until the night of 2026-12-04 each side also held a raw engine
of its own; which engine's threads the scheduler favoured then moved single cells by up to
±50 % between runs (one run: raw-async 3.7 GB/s, kvt and kvt one-off both 2.4 GB/s on the
same 256 MiB READ). Cases: 16 MiB and 256 MiB contiguous, 4096 x 16 KiB scattered (random block order
on both sides), READ and WRITE. Rounds of the two systems alternate so drift hits both.

Raw Mooncake is used the way its users call it: ``batch_transfer_sync_read/write`` (blocks,
spinning, GIL released). Its TCP transport fails what exceeds 1024 queued slices per peer,
so the scattered case is sent as 4 calls of 1024 segments (one 4096-segment call fails,
measured). ``raw-async`` is the same engine work as our backend without our layer (the
like-for-like row). kvtransport runs ``Agent.prepare`` once and ``Agent.post`` each round
(``kvt``, the row the targets apply to) or ``Agent.read/write`` each round (``kvt1``),
polled with ``Transfer.status()`` every ``POLL_S`` like raw-async; its backend feeds
Mooncake 512-segment batches, at most 1024 segments in flight.
The ratio printed is kvtransport time / raw time (median): 1.05 = our layer costs 5 %.
The first round of each system and case is checked byte for byte (64 sampled segments).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import statistics
import time

import numpy as np
import pytest

import kvtransport as kvt
from kvtransport.testing.required import skip_unless_usable

BUF = 256 << 20
BLOCK = 16 << 10
CASES = {"16MiB": (1, 16 << 20), "256MiB": (1, 256 << 20), "4096x16KiB": (4096, BLOCK)}
ROUNDS = {"16MiB": 40, "256MiB": 10, "4096x16KiB": 16}
RAW_MAX_SEGMENTS = 1024  # Mooncake TCP: MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER default
CHUNK, INFLIGHT = 512, 1024  # the backend's defaults (chunk_segments, max_inflight_segments)
POLL_S = 5e-5
OUT = os.environ.get("KVT_BENCH_MOONCAKE_OUT", "/tmp/kvt_bench_mooncake.json")


class Target:
    """Buffer B behind a kvtransport agent (the far side of every case); raw Mooncake
    reaches the same buffer through the same engine (its session id)."""

    def __init__(self) -> None:
        self.b = np.random.default_rng(1).integers(0, 256, BUF, dtype=np.uint8)
        self.agent = kvt.open("mooncake", name="bench-target", default_timeout_s=300)
        self.region = self.agent.register(self.b)

    def hello(self) -> tuple:
        return (_engine_session(self.agent), self.b.ctypes.data, self.agent.metadata(), self.region.id)

    def handle(self, cmd: str, args) -> object:
        if cmd == "bytes":
            return [bytes(self.b[o:o + n]) for o, n in args]
        if cmd == "connect":
            self.agent.connect(args)
            return True
        if cmd == "exit":
            self.agent.close()
            return True
        raise ValueError(cmd)


def _engine_session(agent: kvt.Agent) -> str:
    """The Mooncake session id (``host:rpc_port``) of the engine inside ``agent``."""
    from kvtransport.metadata import decode_metadata
    from kvtransport_mooncake.wire import decode
    md = decode_metadata(agent.metadata())
    return decode(md.agent, md.blob, "tcp").session


def _target(conn) -> None:  # pragma: no cover - child process
    t = Target()
    conn.send(t.hello())
    while True:
        cmd, args = conn.recv()
        conn.send(t.handle(cmd, args))
        if cmd == "exit":
            break


class _InProcess:
    """The same Target in this process, behind the pipe interface the child uses."""

    def __init__(self) -> None:
        self.t = Target()
        self._out = [self.t.hello()]

    def send(self, msg) -> None:
        self._out.append(self.t.handle(*msg))

    def recv(self):
        return self._out.pop(0)


class Bench:
    def __init__(self, topology: str) -> None:
        self.proc = None
        if topology == "xproc":
            ctx = mp.get_context("spawn")
            self.conn, child = ctx.Pipe()
            self.proc = ctx.Process(target=_target, args=(child,), daemon=True)
            self.proc.start()
        else:
            self.conn = _InProcess()
        self.raw_session, self.b_addr, md, self.b_region = self.conn.recv()
        self.a = np.random.default_rng(0).integers(0, 256, BUF, dtype=np.uint8)
        self.agent = kvt.open("mooncake", name="bench-initiator", default_timeout_s=300)
        self.region = self.agent.register(self.a)
        self.raw = self.agent._backend._engine  # the agent's own engine (module docstring)
        self.peer = self.agent.connect(md)
        self.conn.send(("connect", self.agent.metadata()))
        self.conn.recv()
        self.remote = self.peer.region(self.b_region)

    def far_bytes(self, pairs) -> list[bytes]:
        self.conn.send(("bytes", [(int(o), int(n)) for o, n in pairs]))
        return self.conn.recv()

    def raw_run(self, op: str, ia, tb, ln):
        call = self.raw.batch_transfer_sync_read if op == "READ" else self.raw.batch_transfer_sync_write
        cuts = list(range(0, len(ln), RAW_MAX_SEGMENTS))

        def run() -> None:  # address lists built per transfer, as a raw user must
            la = (self.a.ctypes.data + ia).tolist()
            ra = (self.b_addr + tb).tolist()
            lens = ln.tolist()
            for i in cuts:
                j = i + RAW_MAX_SEGMENTS
                rc = call(self.raw_session, la[i:j], ra[i:j], lens[i:j])
                assert rc == 0, f"raw Mooncake {op} failed (rc={rc})"

        return run

    def raw_async_run(self, op: str, ia, tb, ln):
        """The same engine work as our backend, minus our layer: 512-segment async batches,
        at most 1024 segments in flight, completion read with Mooncake's C++ batch status
        every POLL_S, batches freed."""
        from kvtransport_mooncake.abi import EngineStatus, TaskState

        status = EngineStatus(self.raw.get_engine_ptr())
        call = self.raw.batch_transfer_async_read if op == "READ" else self.raw.batch_transfer_async_write
        chunks = [(i, min(i + CHUNK, len(ln))) for i in range(0, len(ln), CHUNK)]

        def run() -> None:  # address lists built per transfer, as a raw user must
            la = (self.a.ctypes.data + ia).tolist()
            ra = (self.b_addr + tb).tolist()
            lens = ln.tolist()
            todo, flying = list(chunks), []
            while todo or flying:
                while todo and len(flying) < INFLIGHT // CHUNK:
                    i, j = todo.pop(0)
                    flying.append(call(self.raw_session, la[i:j], ra[i:j], lens[i:j]))
                time.sleep(POLL_S)
                for bid in list(flying):
                    st = status.batch(bid)
                    assert st is not TaskState.FAILED, f"raw Mooncake {op} failed"
                    if st is TaskState.COMPLETED:
                        assert status.free(bid)
                        flying.remove(bid)

        return run

    def kvt_run(self, op: str, ia, tb, ln, prepared: bool):
        """``prepared``: ``Agent.prepare`` once, ``Agent.post`` each round (validation and
        merging once, as a connector with a fixed layout does); else ``Agent.read/write``."""
        local, remote = self.region.segments(ia, ln), self.remote.segments(tb, ln)
        fn = self.agent.read if op == "READ" else self.agent.write
        prep = self.agent.prepare(kvt.Op.READ if op == "READ" else kvt.Op.WRITE, self.peer, local, remote)

        def run() -> None:
            t = self.agent.post(prep) if prepared else fn(self.peer, local, remote)
            while not (st := t.status()).done:  # same polling as raw-async
                time.sleep(POLL_S)
            assert st.ok, st.reason
            t.release()

        return run

    def close(self) -> None:
        self.agent.close()
        try:
            self.conn.send(("exit", ()))
            self.conn.recv()
        except (OSError, EOFError):
            pass
        if self.proc is not None:
            self.proc.join(30)
            if self.proc.is_alive():
                self.proc.kill()


@pytest.fixture(scope="module", params=["xproc", "inproc"])
def bench(request):
    skip_unless_usable("mooncake")
    b = Bench(request.param)
    b.topology = request.param
    yield b
    b.close()


RESULTS: dict[str, dict] = {}


def _layout(case: str):
    n, size = CASES[case]
    if n == 1:
        return np.zeros(1, np.int64), np.zeros(1, np.int64), np.full(1, size, np.int64)
    rng = np.random.default_rng(42)
    nblk = BUF // BLOCK
    return (rng.permutation(nblk)[:n].astype(np.int64) * BLOCK,
            rng.permutation(nblk)[:n].astype(np.int64) * BLOCK, np.full(n, size, np.int64))


def _verify(bench: Bench, op: str, ia, tb, ln) -> None:
    ks = np.linspace(0, len(ln) - 1, min(len(ln), 64)).astype(int)
    far = bench.far_bytes([(tb[k], ln[k]) for k in ks])
    for k, fb in zip(ks, far):
        assert bench.a[ia[k]:ia[k] + ln[k]].tobytes() == fb, f"{op}: bytes differ in segment {k}"


@pytest.mark.parametrize("op", ["READ", "WRITE"])
@pytest.mark.parametrize("case", list(CASES))
def test_kvtransport_over_mooncake_vs_raw(bench, case, op):
    ia, tb, ln = _layout(case)
    runs = {"raw-sync": bench.raw_run(op, ia, tb, ln), "raw-async": bench.raw_async_run(op, ia, tb, ln),
            "kvt": bench.kvt_run(op, ia, tb, ln, prepared=True),
            "kvt1": bench.kvt_run(op, ia, tb, ln, prepared=False)}
    times: dict[str, list[float]] = {k: [] for k in runs}
    names = list(runs)
    for r in range(ROUNDS[case] + 1):  # round 0: warm-up and byte check
        order = names[r % len(names):] + names[:r % len(names)]  # rotate, so drift hits every system alike
        for name in order:
            if r == 0 and op == "READ":
                bench.a[:] = 0
            t0 = time.perf_counter()
            runs[name]()
            dt = time.perf_counter() - t0
            if r == 0:
                _verify(bench, op, ia, tb, ln)
            else:
                times[name].append(dt)
    nbytes = int(ln.sum())
    med = {k: statistics.median(v) for k, v in times.items()}
    row = {"case": case, "op": op, "bytes": nbytes, "rounds": ROUNDS[case], "median_s": med,
           "gbps": {k: nbytes / v / 1e9 for k, v in med.items()},
           "overhead_vs_raw_async": med["kvt"] / med["raw-async"],
           "overhead_vs_raw_sync": med["kvt"] / med["raw-sync"],
           "oneoff_vs_raw_async": med["kvt1"] / med["raw-async"], "all_s": times}
    row["topology"] = bench.topology
    RESULTS[f"{bench.topology}-{case}-{op}"] = row
    g = row["gbps"]
    print(f"\nmooncake tcp {bench.topology:6s} {case:11s} {op:5s} raw-sync {g['raw-sync']:6.3f}  raw-async {g['raw-async']:6.3f}"
          f"  kvt {g['kvt']:6.3f}  kvt-one-off {g['kvt1']:6.3f} GB/s   kvt/raw-async time "
          f"{row['overhead_vs_raw_async']:.3f}  kvt/raw-sync {row['overhead_vs_raw_sync']:.3f}"
          f"  one-off/raw-async {row['oneoff_vs_raw_async']:.3f}")
    with open(OUT, "w") as f:
        json.dump(RESULTS, f, indent=1)
