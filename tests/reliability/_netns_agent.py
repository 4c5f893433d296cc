"""A ucx agent in its own process (run inside a network namespace by the link-cut test),
driven by JSON lines on stdin; unlike tests/ucx/ucx_peer.py it posts without waiting, so
the test can cut the link while a transfer is in flight.

Start: ``python _netns_agent.py NAME SIZE SEED json-options``; prints ``{"md": hex}``.
Commands -> answers (one JSON line each):
  {"cmd": "connect", "md": hex}                       -> {"ok": true}
  {"cmd": "post", "op": "read"|"write", "local": [[off, len]...], "remote": [[off, len]...],
   "timeout": s}                                       -> {"id": n, "posted_at": monotonic}
  {"cmd": "status", "id": n}                           -> {"state", "reason", "quiesced", "age"}
  {"cmd": "wait", "id": n, "limit": s}                 -> status once terminal (or after limit)
  {"cmd": "settle", "limit": s}                        -> polls progress until nothing pending or
                                                          unquiesced (or limit); -> stats
  {"cmd": "sha", "offsets": [...], "lengths": [...]}   -> {"sha": hex}
  {"cmd": "fill", "seed": n}                           -> refills the buffer from rng(seed)
  {"cmd": "quit"}
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

    def say(obj) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    say({"md": agent.metadata().hex()})
    peer = None
    xfers: dict[int, tuple[kvt.Transfer, float]] = {}

    def status(i: int) -> dict:
        t, t0 = xfers[i]
        st = t.status()
        return {"state": st.state.value, "reason": st.reason, "quiesced": st.quiesced,
                "age": time.monotonic() - t0}

    for line in sys.stdin:
        msg = json.loads(line)
        cmd = msg["cmd"]
        if cmd == "connect":
            peer = agent.connect(bytes.fromhex(msg["md"]))
            say({"ok": True})
        elif cmd == "post":
            assert peer is not None
            loc = np.array(msg["local"], np.int64).reshape(-1, 2)
            rem = np.array(msg["remote"], np.int64).reshape(-1, 2)
            fn = agent.read if msg["op"] == "read" else agent.write
            t0 = time.monotonic()
            t = fn(peer, region.segments(loc[:, 0], loc[:, 1]), peer.regions[0].segments(rem[:, 0], rem[:, 1]),
                   timeout=float(msg["timeout"]))
            xfers[t.id] = (t, t0)
            say({"id": t.id, "posted_at": t0})
        elif cmd == "status":
            say(status(msg["id"]))
        elif cmd == "wait":
            # "limit" is a hang guard. What is reported is an ordering fact: whether any
            # progress call that began after the transfer's own deadline left it unfinished
            # (the core must fail it at the first such call: T2).
            end = time.monotonic() + float(msg["limit"])
            t, _ = xfers[msg["id"]]
            open_past_deadline = False
            while not t.done and time.monotonic() < end:
                began = time.monotonic()
                agent.progress()
                if not t.done and began >= t.deadline:
                    open_past_deadline = True
                time.sleep(0.002)
            say({**status(msg["id"]), "open_past_deadline": open_past_deadline})
        elif cmd == "settle":
            end = time.monotonic() + float(msg["limit"])
            while time.monotonic() < end:
                agent.progress()
                for t, _ in xfers.values():
                    t.status()
                s = agent.stats()
                if s["pending"] == 0 and s["unquiesced"] == 0:
                    break
                time.sleep(0.01)
            say({k: v for k, v in agent.stats().items() if isinstance(v, (int, float))})
        elif cmd == "sha":
            h = hashlib.sha256()
            for o, n in zip(msg["offsets"], msg["lengths"]):
                h.update(buf[o : o + n].tobytes())
            say({"sha": h.hexdigest()})
        elif cmd == "fill":
            buf[:] = np.random.default_rng(msg["seed"]).integers(0, 256, size, dtype=np.uint8)
            say({"ok": True})
        elif cmd == "quit":
            break
        else:
            say({"error": f"unknown command {cmd}"})
    agent.close()


if __name__ == "__main__":
    main()
