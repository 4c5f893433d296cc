"""A ucx agent in its own process, driven by JSON lines on stdin (used by the ucx tests).

Start: ``python ucx_peer.py NAME SIZE SEED [json-backend-options]``. It registers a buffer of
SIZE bytes filled from ``numpy.random.default_rng(SEED)`` and prints ``{"md": hex}``.
Commands (one JSON object per line, one JSON answer per line):

* ``{"cmd": "connect", "md": hex}`` -> ``{"ok": true}``
* ``{"cmd": "sha", "offsets": [...], "lengths": [...]}`` -> sha256 of those bytes, concatenated
* ``{"cmd": "write"|"read", "local": [[off, len], ...], "remote": [[off, len], ...],
  "notify": hex|null}`` -> the transfer is run against the connected peer's region 0 -> state
* ``{"cmd": "notifications", "until": hex}`` -> waits (up to 30 s) until a notification with
  that payload arrived, returns every one received so far, in order (hex). Callers send that
  payload as a sentinel *after* what they expect, so anything extra (a duplicate, a stray
  message) sent before the sentinel shows up in the answer: no sleep decides "nothing more".
* ``{"cmd": "notify", "payload": hex}`` -> a standalone notification to the connected peer
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
            until = bytes.fromhex(msg["until"])
            deadline = time.monotonic() + 30  # a bound, not a timing check: the caller compares lists
            while not any(n.payload == until for n in inbox) and time.monotonic() < deadline:
                inbox.extend(agent.notifications())
                time.sleep(0.005)
            ans = {"notes": [[n.peer, n.payload.hex()] for n in inbox]}
            inbox = []
        elif cmd == "notify":
            assert peer is not None
            agent.send_notification(peer, bytes.fromhex(msg["payload"]))
            ans = {"ok": True}
        elif cmd == "quit":
            break
        else:
            ans = {"error": f"unknown command {cmd}"}
        out.write(json.dumps(ans) + "\n")
        out.flush()
    agent.close()


if __name__ == "__main__":
    main()
