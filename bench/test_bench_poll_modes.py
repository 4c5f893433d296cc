"""How the caller waits for a transfer, and what it costs the transfer: two processes.

Run: ``python -m pytest bench/test_bench_poll_modes.py -q -s -p no:cacheprovider``
(``KVT_BENCH_RUNS``, default 3, runs per invocation).

The initiator (this process) posts 16 MiB WRITEs to a target in a spawned child, back to
back, and waits for each in one of three ways:

* ``wait``: ``Transfer.wait()`` (sleeps until the backend signals progress);
* ``spin-status``: ``while not t.status().done: pass``;
* ``spin-progress``: ``while t not in agent.progress(): pass``;

for loopback, ucx over shared memory and ucx over tcp. A backend moves bytes on its own
Python threads, which need the GIL between native calls; a spinning caller takes the GIL
back at once each turn, unless the core yields it (``kvtransport.transfer.yield_gil``,
docs/ARCHITECTURE.md). This bench shows whether spinning costs throughput against
``wait()``. Medians of ``ROUNDS`` transfers per run, GB/s; the order of systems and modes
rotates between runs; the first transfer of each system is checked byte for byte. Nothing
is asserted about time.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import kvtransport as kvt

SIZE = 16 << 20
ROUNDS = 25
RUNS = int(os.environ.get("KVT_BENCH_RUNS", "3"))
SYSTEMS: dict[str, tuple[str, dict[str, Any]]] = {
    "loopback": ("loopback", {}),
    "ucx-shm": ("ucx", {"tls": "shm"}),
    "ucx-tcp": ("ucx", {"tls": "tcp"}),
}
MODES = ["wait", "spin-status", "spin-progress"]


def _target(conn) -> None:  # pragma: no cover - runs in the child
    buf = np.zeros(SIZE, np.uint8)
    agent: Any = None
    while True:
        cmd, arg = conn.recv()
        if cmd == "open":
            backend, opts = SYSTEMS[arg]
            agent = kvt.open(backend, name=f"pm-t-{arg}", **opts)
            rid = agent.register(buf).id
            conn.send((agent.metadata(), rid))
        elif cmd == "connect":
            agent.connect(arg)
            conn.send(True)
        elif cmd == "sha":
            conn.send(hashlib.sha256(buf.tobytes()).hexdigest())
        elif cmd == "close":
            agent.close()
            agent = None
            conn.send(True)
        else:
            return


def _waiter(mode: str, agent: Any) -> Callable[[Any], Any]:
    if mode == "wait":
        return lambda t: t.wait()

    if mode == "spin-status":
        def spin_status(t: Any) -> Any:
            while not t.status().done:
                pass
            return t.status()
        return spin_status

    def spin_progress(t: Any) -> Any:
        while t not in agent.progress():
            pass
        return t.status()
    return spin_progress


def test_poll_modes() -> None:
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(child,), daemon=True)
    proc.start()
    src = np.random.default_rng(5).integers(0, 256, SIZE, dtype=np.uint8)
    results: list[dict[str, float]] = []
    try:
        for run in range(RUNS):
            names = list(SYSTEMS)
            names = names[run % len(names):] + names[:run % len(names)]
            res: dict[str, float] = {}
            for name in names:
                backend, opts = SYSTEMS[name]
                conn.send(("open", name))
                md, rid = conn.recv()
                agent = kvt.open(backend, name=f"pm-i-{name}", **opts)
                try:
                    region = agent.register(src)
                    peer = agent.connect(md)
                    conn.send(("connect", agent.metadata()))
                    conn.recv()
                    prep = agent.prepare(kvt.Op.WRITE, peer, region.segments(np.array([0]), np.array([SIZE])),
                                         peer.region(rid).segments(np.array([0]), np.array([SIZE])))
                    if run == 0:
                        assert agent.post(prep).wait(60).ok
                        conn.send(("sha", None))
                        assert conn.recv() == hashlib.sha256(src.tobytes()).hexdigest(), f"{name}: bytes differ"
                    modes = MODES[run % len(MODES):] + MODES[:run % len(MODES)]
                    for mode in modes:
                        wait = _waiter(mode, agent)
                        times = []
                        for i in range(ROUNDS + 1):
                            t0 = time.perf_counter()
                            t = agent.post(prep)
                            st = wait(t)
                            assert st.ok, st
                            t.release()
                            if i:  # the first one after a switch is not counted
                                times.append(time.perf_counter() - t0)
                        res[f"{name}|{mode}"] = SIZE / float(np.median(times)) / 1e9
                finally:
                    agent.close()
                    conn.send(("close", None))
                    conn.recv()
            results.append(res)
            print(f"\nrun {run + 1}/{RUNS}: " + " ".join(f"{k}={v:.2f}" for k, v in sorted(res.items())), flush=True)
    finally:
        conn.send(("exit", None))
        proc.join(10)
    lines = ["", f"16 MiB WRITE, two processes, {len(results)} runs: GB/s median over runs (min-max); "
             "spin / wait within each run",
             f"{'system':<10} " + " ".join(f"{m:>18}" for m in MODES) + "   spin-status/wait  spin-progress/wait"]
    for name in SYSTEMS:
        cells = []
        for m in MODES:
            v = [r[f"{name}|{m}"] for r in results]
            cells.append(f"{np.median(v):6.2f} ({min(v):.1f}-{max(v):.1f})")
        ratios = [float(np.median([r[f"{name}|{m}"] / r[f"{name}|wait"] for r in results]))
                  for m in ("spin-status", "spin-progress")]
        lines.append(f"{name:<10} " + " ".join(f"{c:>18}" for c in cells)
                     + f"   {ratios[0]:16.2f}  {ratios[1]:18.2f}")
    print("\n".join(lines))
