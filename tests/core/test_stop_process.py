"""``kvtransport.testing.peer.stop_process``: tests that freeze a peer (SIGSTOP) to check
deadlines rely on nothing of it running after the call returns."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time

from kvtransport.testing.peer import stop_process


def _busy_child(stamp, conn) -> None:  # pragma: no cover - runs in the child
    """A thread that keeps writing the time, as a progress thread keeps serving requests,
    while the main thread waits in a blocking call (the usual target of the signal)."""
    def spin() -> None:
        while True:
            stamp.value = time.monotonic()
    threading.Thread(target=spin, daemon=True).start()
    conn.send("ready")
    conn.recv()


def test_no_thread_of_a_stopped_process_runs_after_stop_process_returns():
    ctx = mp.get_context("spawn")
    for _ in range(5):
        stamp = ctx.Value("d", 0.0, lock=False)
        here, there = ctx.Pipe()
        proc = ctx.Process(target=_busy_child, args=(stamp, there), daemon=True)
        proc.start()
        try:
            assert here.poll(60) and here.recv() == "ready"
            while stamp.value == 0.0:  # the busy thread has started writing
                pass
            stop_process(proc.pid)
            returned = time.monotonic()
            seen = stamp.value
            assert seen <= returned, "a thread of the process ran after stop_process returned"
            time.sleep(0.02)  # a window in which a running thread would write again
            assert stamp.value == seen, "a thread of the process ran after stop_process returned"
        finally:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.join(10)
