"""The other side of a conformance test: an agent in this process or in a child process.

Both kinds expose the same small interface, so every conformance test runs unchanged
in-process and across two processes. The child is started with ``spawn`` (no state
inherited from the test process) and driven over a pipe.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from typing import Any

import numpy as np

import kvtransport as kvt

__all__ = ["pattern", "stop_process", "PeerSide", "InProcessPeer", "ChildProcessPeer"]


def pattern(seed: int, size: int) -> np.ndarray:
    """Deterministic pseudo-random bytes: both sides can recompute what should arrive."""
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def _thread_states(pid: int) -> list[str]:
    """The state letter of every thread of ``pid`` (``/proc/PID/task/*/stat``)."""
    states = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        except FileNotFoundError:  # the thread ended meanwhile
            continue
    return states


def stop_process(pid: int, timeout_s: float = 10.0) -> None:
    """SIGSTOP ``pid`` and return only once every one of its threads is stopped.

    ``kill`` returns as soon as the signal is queued: the thread that takes a SIGSTOP stops
    the others only when it next runs, and until then they go on (measured on a 2-core VM: a
    child's busy thread kept running after ``kill`` returned in 8-18 of 20 tries, for up to
    8 ms). A test that posts to a "stopped" peer right after ``kill`` can have its request
    served by the peer's progress thread, and a READ it expects to hang completes.

    Raises ``TimeoutError`` if some thread is not stopped after ``timeout_s``."""
    os.kill(pid, signal.SIGSTOP)
    limit = time.monotonic() + timeout_s
    while True:
        states = _thread_states(pid)
        if all(st in "Tt" for st in states):
            return
        if time.monotonic() > limit:
            raise TimeoutError(f"process {pid} not stopped {timeout_s}s after SIGSTOP: thread states {states}")
        time.sleep(0.001)  # polling the threads' state, not waiting for a guess


class _Serving:
    """An agent with one registered buffer; what both peer kinds wrap."""

    def __init__(self, backend: str, options: dict[str, Any], name: str, size: int, seed: int):
        self.agent = kvt.open(backend, name=name, **options)
        self.buf = pattern(seed, size)
        self.region = self.agent.register(self.buf)
        self.peer: kvt.Peer | None = None

    def handle(self, cmd: str, args: tuple) -> Any:
        if cmd == "metadata":
            return self.agent.metadata()
        if cmd == "connect":
            self.peer = self.agent.connect(args[0])
            return self.peer.name
        if cmd == "bytes":
            off, ln = args
            return bytes(self.buf[off:off + ln])
        if cmd == "fill":
            self.buf[:] = pattern(args[0], self.buf.size)
            return True
        if cmd == "notifications":
            expect, timeout = args
            got: list[tuple[str, bytes]] = []
            limit = time.monotonic() + timeout
            while True:
                got += [(n.peer, n.payload) for n in self.agent.notifications()]
                if len(got) >= expect or time.monotonic() >= limit:
                    return got
                time.sleep(0.002)
        if cmd == "write_to_peer":  # the peer initiates: our buffer -> theirs
            loff, roff, ln, notify = args
            assert self.peer is not None
            t = self.agent.write(self.peer, self.region.segments([loff], [ln]),
                                 self.peer.regions[0].segments([roff], [ln]), notify=notify)
            return t.wait().state.value
        if cmd == "close":
            self.agent.close()
            return True
        raise ValueError(f"unknown peer command {cmd!r}")


class PeerSide:
    """Interface of the far side used by the conformance tests."""

    name: str
    region_id: int
    size: int

    def call(self, cmd: str, *args: Any) -> Any:
        raise NotImplementedError

    def metadata(self) -> bytes:
        return self.call("metadata")

    def connect(self, md: bytes) -> str:
        return self.call("connect", md)

    def bytes(self, off: int = 0, ln: int | None = None) -> bytes:
        return self.call("bytes", off, self.size if ln is None else ln)

    def fill(self, seed: int) -> None:
        self.call("fill", seed)

    def notifications(self, expect: int, timeout: float = 5.0) -> list[tuple[str, bytes]]:
        return self.call("notifications", expect, timeout)

    def close(self) -> None:
        raise NotImplementedError


class InProcessPeer(PeerSide):
    def __init__(self, backend: str, options: dict[str, Any], name: str, size: int, seed: int):
        self._s = _Serving(backend, options, name, size, seed)
        self.name, self.size, self.region_id = name, size, self._s.region.id

    def call(self, cmd: str, *args: Any) -> Any:
        return self._s.handle(cmd, args)

    def close(self) -> None:
        if not self._s.agent.closed:
            self._s.agent.close()


def _child_main(conn, backend, options, name, size, seed) -> None:  # pragma: no cover - child
    try:
        s = _Serving(backend, options, name, size, seed)
    except BaseException as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", s.region.id))
    while True:
        try:
            cmd, args = conn.recv()
        except EOFError:
            break
        if cmd == "exit":
            break
        try:
            conn.send(("ok", s.handle(cmd, args)))
        except BaseException as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
    s.agent.close()


class ChildProcessPeer(PeerSide):
    """A peer agent in a spawned child process."""

    def __init__(self, backend: str, options: dict[str, Any], name: str, size: int, seed: int,
                 start_timeout: float = 60.0):
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_child_main, args=(child, backend, options, name, size, seed),
                                daemon=True)
        self.proc.start()
        child.close()
        if not self._conn.poll(start_timeout):
            self.kill()
            raise RuntimeError(f"peer process for backend {backend!r} did not start in {start_timeout}s")
        status, value = self._conn.recv()
        if status != "ready":
            self.proc.join(5)
            raise RuntimeError(f"peer process failed to open backend {backend!r}: {value}")
        self.name, self.size, self.region_id = name, size, value

    @property
    def pid(self) -> int:
        return self.proc.pid

    def call(self, cmd: str, *args: Any, timeout: float = 60.0) -> Any:
        self._conn.send((cmd, args))
        if not self._conn.poll(timeout):
            raise TimeoutError(f"peer process did not answer {cmd!r} in {timeout}s")
        status, value = self._conn.recv()
        if status != "ok":
            raise RuntimeError(f"peer command {cmd!r} failed: {value}")
        return value

    def kill(self) -> None:
        """SIGKILL: the peer dies with no chance to clean up, as in a crash."""
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self._conn.send(("exit", ()))
                self.proc.join(10)
            except (BrokenPipeError, OSError):
                pass
        self.kill()
