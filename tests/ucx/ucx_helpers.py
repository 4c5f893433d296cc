"""Shared helpers of the ucx tests: a peer agent in another process (``ucx_peer.py``)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import kvtransport as kvt
from kvtransport.testing.required import skip_unless_usable

PEER_SCRIPT = Path(__file__).with_name("ucx_peer.py")

#: Backend option sets the ucx backend must pass with (tell the conformance suite the same).
TLS_OPTIONS = [{"tls": "tcp"}, {"tls": "shm"}, {"tls": "cma+tcp"}]


def skip_unless_ucx_usable() -> None:
    """Skip the calling test, with the backend's own reason, where ucx cannot run here;
    fail instead when ucx is a required backend (``KVT_REQUIRED_BACKENDS``, set by CI)."""
    skip_unless_usable("ucx")


#: Sent after the notifications a test expects: once it arrived, everything sent before it
#: (on the same lane-0 endpoint, which keeps order) has arrived too.
SENTINEL = b"sentinel: nothing more before me"


def notes_until(agent: kvt.Agent, sentinel: bytes = SENTINEL, limit_s: float = 30.0) -> list[tuple[str, bytes]]:
    """(sender, payload) of every notification ``agent`` receives until ``sentinel`` arrived.

    ``limit_s`` only bounds a broken run; the test's verdict is the list itself."""
    got: list[tuple[str, bytes]] = []
    deadline = time.monotonic() + limit_s
    while not any(p == sentinel for _, p in got) and time.monotonic() < deadline:
        got += [(n.peer, n.payload) for n in agent.notifications()]
        time.sleep(0.002)
    return got


def expected_bytes(size: int, seed: int) -> np.ndarray:
    """The buffer a peer started with ``SEED`` registered (see ``ucx_peer.py``)."""
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def sha(buf: np.ndarray, offsets, lengths) -> str:
    h = hashlib.sha256()
    for o, n in zip(offsets, lengths):
        h.update(buf[int(o) : int(o) + int(n)].tobytes())
    return h.hexdigest()


class PeerProcess:
    """A ucx agent in a child process; ``prefix`` runs it elsewhere (e.g. ``ip netns exec``)."""

    def __init__(self, name: str, size: int, seed: int, options: dict, prefix: list[str] | None = None):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PEER_SCRIPT.parent), env.get("PYTHONPATH")]))
        self.proc = subprocess.Popen(
            [*(prefix or []), sys.executable, str(PEER_SCRIPT), name, str(size), str(seed), json.dumps(options)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        )
        hello = self._read()
        self.metadata = bytes.fromhex(hello["md"])
        self.name, self.size, self.seed = name, size, seed

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            err = self.proc.stderr.read() if self.proc.poll() is not None else ""
            raise RuntimeError(f"peer process ended (rc={self.proc.poll()}): {err[-3000:]}")
        return json.loads(line)

    def call(self, **msg) -> dict:
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def notes_until(self, sentinel: bytes = SENTINEL) -> list[list[str]]:
        """[sender, payload hex] of the notifications the peer received until ``sentinel``."""
        return self.call(cmd="notifications", until=sentinel.hex())["notes"]

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(10)
            except Exception:
                self.proc.kill()
                self.proc.wait(10)
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            try:
                f.close()
            except Exception:
                pass
