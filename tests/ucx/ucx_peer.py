"""A ucx agent in its own process, driven by JSON lines on stdin (used by the ucx tests).

Start: ``python ucx_peer.py NAME SIZE SEED [json-backend-options]``. It registers a buffer of
SIZE bytes filled from ``numpy.random.default_rng(SEED)`` and prints ``{"md": hex}``.
Commands (one JSON object per line, one JSON answer per line):

* ``{"cmd": "connect", "md": hex}`` -> ``{"ok": true}``
* ``{"cmd": "sha", "offsets": [...], "lengths": [...]}`` -> sha256 of those bytes, concatenated
* ``{"cmd": "write"|"read", "local": [[off, len], ...], "remote": [[off, len], ...],
  "notify": hex|null}`` -> the transfer is run against the connected peer's region 0 -> state
* ``{"cmd": "notifications", "wait": n}`` -> waits up to 5 s for n messages, returns them (hex)
* ``{"cmd": "quit"}``
"""

from __future__ import annotations

import hashlib
import json
import sys
import time

import numpy as np

import kvtransport as kvt


def main() -> None:
    name, size, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    options = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
    agent = kvt.open("ucx", name=name, **options)
    buf = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
    region = agent.register(buf)
    out = sys.stdout
    out.write(json.dumps({"md": agent.metadata().hex(), "region": region.id}) + "\n")
    out.flush()
    peer = None
    inbox: list[kvt.Notification] = []
    for line in sys.stdin:
        msg = json.loads(line)
        cmd = msg["cmd"]
        if cmd == "connect":
            peer = agent.connect(bytes.fromhex(msg["md"]))
            ans = {"ok": True}
        elif cmd == "sha":
            h = hashlib.sha256()
            for o, n in zip(msg["offsets"], msg["lengths"]):
                h.update(buf[o : o + n].tobytes())
            ans = {"sha": h.hexdigest()}
        elif cmd in ("write", "read"):
            assert peer is not None
            loc = np.array(msg["local"], np.int64).reshape(-1, 2)
            rem = np.array(msg["remote"], np.int64).reshape(-1, 2)
            notify = bytes.fromhex(msg["notify"]) if msg.get("notify") else None
            rr = peer.regions[0]
            fn = agent.write if cmd == "write" else agent.read
            t = fn(peer, region.segments(loc[:, 0], loc[:, 1]), rr.segments(rem[:, 0], rem[:, 1]),
                   notify=notify, timeout=30)
            st = t.wait()
            ans = {"state": st.state.value, "reason": st.reason}
        elif cmd == "notifications":
            deadline = time.monotonic() + 5
            while len(inbox) < msg.get("wait", 0) and time.monotonic() < deadline:
                inbox.extend(agent.notifications())
                time.sleep(0.005)
            inbox.extend(agent.notifications())
            ans = {"notes": [[n.peer, n.payload.hex()] for n in inbox]}
            inbox = []
        elif cmd == "quit":
            break
        else:
            ans = {"error": f"unknown command {cmd}"}
        out.write(json.dumps(ans) + "\n")
        out.flush()
    agent.close()


if __name__ == "__main__":
    main()
