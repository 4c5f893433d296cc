#!/usr/bin/env python
"""Prove the moriio backend on AMD hardware: a conformance subset plus a throughput table.

Run the server on one node and the client on another (RDMA), or both on one node with
GPU memory on two GPUs (XGMI). The two sides swap kvtransport metadata over a small ZeroMQ
REQ/REP channel (``--host``/``--port`` = the server's address), then the client runs:

  1. READ  of scattered blocks, byte-exact against the server's known pattern;
  2. WRITE of scattered blocks, verified byte-exact by the server (untouched blocks too);
  3. notification: a WRITE's notification reaches the server exactly once, after the data;
  4. throughput: READ and WRITE of many blocks per transfer, for several block sizes;
  5. deadline: the server drops its agent; a READ from it must end FAILED within its deadline.

Exit status 0 only if every check passed. Exact commands: docs/MORIIO.md.

``--fake-mori`` runs both roles in one process on the FAKE mori.io from tests/moriio; it
tests this script, not the hardware, and says so in its output.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import zmq

import kvtransport as kvt

SERVER_SEED, CLIENT_SEED = 11, 22
_enc, _dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder()


# --------------------------------------------------------------------------- memory
def pattern(seed: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


class Buffer:
    """A registered buffer in CPU or GPU memory, filled and read back through numpy."""

    def __init__(self, agent: kvt.Agent, nbytes: int, memory: str, gpu: int):
        self.nbytes, self.memory = nbytes, memory
        if memory == "gpu":
            import torch

            self.dev = torch.device(f"cuda:{gpu}")
            self.t = torch.zeros(nbytes, dtype=torch.uint8, device=self.dev)
            self.region = agent.register(self.t)
        else:
            self.a = np.zeros(nbytes, np.uint8)
            self.region = agent.register(self.a)

    def fill(self, seed: int) -> None:
        data = pattern(seed, self.nbytes)
        if self.memory == "gpu":
            import torch

            self.t.copy_(torch.from_numpy(data).to(self.dev))
            torch.cuda.synchronize(self.dev)
        else:
            self.a[:] = data

    def host(self) -> np.ndarray:
        if self.memory == "gpu":
            import torch

            torch.cuda.synchronize(self.dev)
            return self.t.cpu().numpy()
        return self.a


def _agent_options(args) -> dict[str, Any]:
    opts: dict[str, Any] = {"transport": args.transport}
    if args.local_host:
        opts["host"] = args.local_host
    for k in ("qp_per_transfer", "post_batch_size", "num_worker_threads"):
        v = getattr(args, k)
        if v is not None:
            opts[k] = v
    if args.chunking:
        opts["enable_transfer_chunking"] = True
    return opts


# --------------------------------------------------------------------------- server
def serve(args, ready: threading.Event | None = None) -> int:
    agent = kvt.open("moriio", name="validate-server", **_agent_options(args))
    buf = Buffer(agent, args.region_mb << 20, args.memory, args.gpu)
    buf.fill(SERVER_SEED)
    sock = zmq.Context.instance().socket(zmq.REP)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(f"tcp://{args.bind or args.host}:{args.port}")
    print(f"[server] moriio agent up: {json.dumps(agent.describe(), default=str)}", flush=True)
    print(f"[server] waiting for the client on tcp://{args.bind or args.host}:{args.port}", flush=True)
    if ready is not None:
        ready.set()
    notes: list[tuple[str, bytes]] = []
    alive = True
    while True:
        if alive:
            agent.progress()
            notes += [(n.peer, n.payload) for n in agent.notifications()]
        if not sock.poll(5):
            continue
        msg = _dec.decode(sock.recv())
        cmd = msg["cmd"]
        reply: dict[str, Any] = {"ok": True}
        if cmd == "hello":
            agent.connect(msg["metadata"])
            reply.update(metadata=agent.metadata(), region_id=buf.region.id, nbytes=buf.nbytes)
        elif cmd == "reset":
            buf.fill(SERVER_SEED)
            notes.clear()
        elif cmd == "verify_write":
            bb = msg["block_bytes"]
            src, dst = np.asarray(msg["src"]), np.asarray(msg["dst"])
            got = buf.host()[: (buf.nbytes // bb) * bb].reshape(-1, bb)
            expect = pattern(SERVER_SEED, buf.nbytes)[: got.size].reshape(-1, bb).copy()
            expect[dst] = pattern(CLIENT_SEED, msg["client_nbytes"])[: msg["client_blocks"] * bb].reshape(-1, bb)[src]
            bad = np.flatnonzero((got != expect).any(axis=1))
            reply.update(ok=bad.size == 0, bad_blocks=bad[:20].tolist(), n_bad=int(bad.size))
        elif cmd == "notes":
            deadline = time.monotonic() + msg.get("wait_s", 0)
            while alive and len(notes) < msg.get("min", 0) and time.monotonic() < deadline:
                notes += [(n.peer, n.payload) for n in agent.notifications()]
                time.sleep(0.001)
            reply.update(notes=[[p, m] for p, m in notes])
            notes.clear()
        elif cmd == "drop":
            agent.close()
            alive = False
        elif cmd == "bye":
            sock.send(_enc.encode(reply))
            break
        else:
            reply = {"ok": False, "error": f"unknown command {cmd!r}"}
        sock.send(_enc.encode(reply))
    if alive:
        agent.close()
    sock.close()
    return 0


# --------------------------------------------------------------------------- client
class Client:
    def __init__(self, args):
        self.args = args
        self.agent = kvt.open("moriio", name="validate-client", default_timeout_s=args.timeout,
                              **_agent_options(args))
        self.buf = Buffer(self.agent, args.region_mb << 20, args.memory, args.gpu)
        self.sock = zmq.Context.instance().socket(zmq.REQ)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, int(args.connect_timeout * 1000))
        self.sock.connect(f"tcp://{args.host}:{args.port}")
        r = self.call("hello", metadata=self.agent.metadata())
        self.peer = self.agent.connect(r["metadata"])
        self.remote = self.peer.region(r["region_id"])
        self.remote_nbytes = r["nbytes"]
        self.results: list[tuple[str, bool, str]] = []
        self.table: list[dict[str, Any]] = []

    def call(self, cmd: str, **kw) -> dict[str, Any]:
        self.sock.send(_enc.encode({"cmd": cmd, **kw}))
        try:
            return _dec.decode(self.sock.recv())
        except zmq.Again:
            raise SystemExit(f"no answer from the server at {self.args.host}:{self.args.port} "
                             f"within {self.args.connect_timeout}s (is --role server running there?)")

    def layouts(self, bb: int):
        n = min(self.buf.nbytes, self.remote_nbytes) // bb
        return (kvt.BlockLayout([(self.buf.region, 0)], bb, n), kvt.BlockLayout([(self.remote, 0)], bb, n), n)

    def check(self, name: str, ok: bool, detail: str = "") -> None:
        self.results.append((name, bool(ok), detail))
        print(f"[client] {'PASS' if ok else 'FAIL'}  {name}  {detail}", flush=True)

    # 1 ---------------------------------------------------------------------
    def check_read(self, bb: int = 16384) -> None:
        self.call("reset")
        self.buf.fill(CLIENT_SEED)
        ll, rl, n = self.layouts(bb)
        rng = np.random.default_rng(1)
        k = min(n, 512)
        src, dst = rng.permutation(n)[:k], rng.permutation(n)[:k]
        st = self.agent.read(self.peer, ll.segments(dst), rl.segments(src)).wait()
        if not st.ok:
            return self.check("READ scattered blocks byte-exact", False, st.reason)
        got = self.buf.host()[: n * bb].reshape(n, bb)
        expect = pattern(CLIENT_SEED, self.buf.nbytes)[: n * bb].reshape(n, bb).copy()
        expect[dst] = pattern(SERVER_SEED, self.remote_nbytes)[: n * bb].reshape(n, bb)[src]
        bad = int((got != expect).any(axis=1).sum())
        self.check("READ scattered blocks byte-exact", bad == 0, f"{k} blocks of {bb} B, {bad} wrong")

    # 2 + 3 -----------------------------------------------------------------
    def check_write_and_notify(self, bb: int = 16384) -> None:
        self.call("reset")
        self.buf.fill(CLIENT_SEED)
        ll, rl, n = self.layouts(bb)
        rng = np.random.default_rng(2)
        k = min(n, 512)
        src, dst = rng.permutation(n)[:k], rng.permutation(n)[:k]
        payload = b"validate: write done"
        st = self.agent.write(self.peer, ll.segments(src), rl.segments(dst), notify=payload).wait()
        if not st.ok:
            self.check("WRITE scattered blocks byte-exact", False, st.reason)
            return self.check("notification once, after the data", False, "write failed")
        notes = self.call("notes", min=1, wait_s=10.0)["notes"]
        v = self.call("verify_write", block_bytes=bb, src=src.tolist(), dst=dst.tolist(),
                      client_nbytes=self.buf.nbytes, client_blocks=n)
        self.check("WRITE scattered blocks byte-exact", v["ok"], f"{k} blocks of {bb} B, {v['n_bad']} wrong")
        more = self.call("notes", min=0, wait_s=0.5)["notes"]
        ok = [list(x) for x in notes] == [["validate-client", payload]] and not more
        self.check("notification once, after the data", ok, f"received {len(notes) + len(more)}")

    # 4 ---------------------------------------------------------------------
    def throughput(self) -> None:
        for bb in self.args.block_bytes:
            ll, rl, n = self.layouts(bb)
            ids = np.arange(n)
            for op in ("READ", "WRITE"):
                fn = self.agent.read if op == "READ" else self.agent.write
                lat = []
                for _ in range(self.args.warmup + self.args.iters):
                    t0 = time.perf_counter()
                    st = fn(self.peer, ll.segments(ids), rl.segments(ids[::-1].copy())).wait()
                    lat.append(time.perf_counter() - t0)
                    if not st.ok:
                        self.check(f"throughput {op} {bb} B", False, st.reason)
                        break
                else:
                    timed = np.array(lat[self.args.warmup:])
                    nbytes = n * bb
                    self.table.append({"op": op, "block_bytes": bb, "blocks": n, "MiB": nbytes / 2**20,
                                       "GB/s_median": nbytes / np.median(timed) / 1e9,
                                       "GB/s_best": nbytes / timed.min() / 1e9,
                                       "ms_median": float(np.median(timed) * 1e3)})

    # 5 ---------------------------------------------------------------------
    def check_deadline(self) -> None:
        self.call("drop")
        ll, rl, n = self.layouts(4096)
        timeout = 3.0
        t0 = time.monotonic()
        st = self.agent.read(self.peer, ll.segments([0, 1]), rl.segments([0, 1]), timeout=timeout).wait()
        took = time.monotonic() - t0
        ok = st.state is kvt.State.FAILED and took <= timeout + 2.0
        self.check("read from a dropped peer ends FAILED by its deadline", ok,
                   f"{st.state.value} after {took:.2f}s: {st.reason[:120]}")

    def close(self) -> None:
        self.call("bye")
        self.sock.close()
        self.agent.close()


def print_table(rows: list[dict[str, Any]], fake: bool) -> None:
    title = "moriio throughput" + ("  (FAKE mori.io: memmove, not hardware)" if fake else "")
    print(f"\n{title}")
    hdr = f"{'op':<6}{'block':>10}{'blocks':>8}{'MiB':>9}{'GB/s med':>11}{'GB/s best':>11}{'ms med':>9}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['op']:<6}{r['block_bytes']:>10}{r['blocks']:>8}{r['MiB']:>9.1f}"
              f"{r['GB/s_median']:>11.2f}{r['GB/s_best']:>11.2f}{r['ms_median']:>9.2f}")


def run_client(args) -> int:
    c = Client(args)
    print(f"[client] moriio agent up: {json.dumps(c.agent.describe(), default=str)}", flush=True)
    c.check_read()
    c.check_write_and_notify()
    c.throughput()
    c.check_deadline()
    c.close()
    print_table(c.table, args.fake_mori)
    failed = [r for r in c.results if not r[1]]
    print(f"\n{len(c.results) - len(failed)} passed, {len(failed)} failed")
    if args.json:
        Path(args.json).write_text(json.dumps({"checks": c.results, "throughput": c.table,
                                               "fake_mori": args.fake_mori}, indent=2))
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--role", choices=["server", "client"], required=False)
    p.add_argument("--host", default="127.0.0.1", help="the server's address (metadata exchange)")
    p.add_argument("--port", type=int, default=5599, help="the server's metadata-exchange port")
    p.add_argument("--bind", default=None, help="server: address to bind the exchange socket (default --host)")
    p.add_argument("--local-host", default=None,
                   help="this node's address for mori's engine and notifications (default: hostname's IP)")
    p.add_argument("--transport", choices=["rdma", "xgmi"], default="rdma")
    p.add_argument("--memory", choices=["cpu", "gpu"], default="cpu")
    p.add_argument("--gpu", type=int, default=0, help="GPU index with --memory gpu")
    p.add_argument("--region-mb", type=int, default=256, help="registered buffer size per side (MiB)")
    p.add_argument("--block-bytes", type=lambda s: [int(x) for x in s.split(",")],
                   default=[4096, 16384, 65536, 262144, 1048576])
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--timeout", type=float, default=60.0, help="per-transfer deadline (s)")
    p.add_argument("--connect-timeout", type=float, default=120.0)
    p.add_argument("--qp-per-transfer", dest="qp_per_transfer", type=int, default=None)
    p.add_argument("--post-batch-size", dest="post_batch_size", type=int, default=None)
    p.add_argument("--num-worker-threads", dest="num_worker_threads", type=int, default=None)
    p.add_argument("--chunking", action="store_true", help="enable mori's transfer chunking")
    p.add_argument("--json", default=None, help="also write results to this JSON file")
    p.add_argument("--fake-mori", action="store_true",
                   help="run both roles in this process on the FAKE mori.io (tests the script only)")
    args = p.parse_args(argv)

    if args.fake_mori:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from kvtransport_moriio.backend import using_mori_module
        from tests.moriio.fake_mori_io import make_fake_mori_io

        print("*** FAKE mori.io: this run tests the script, it validates NO hardware ***", flush=True)
        args.local_host = args.local_host or "127.0.0.1"
        with using_mori_module(make_fake_mori_io()):
            ready = threading.Event()
            server = threading.Thread(target=serve, args=(args, ready), daemon=True)
            server.start()
            if not ready.wait(30):
                raise SystemExit("fake server did not start")
            rc = run_client(args)
            server.join(10)
            return rc
    if args.role is None:
        p.error("--role server or --role client is required (or --fake-mori)")
    return serve(args) if args.role == "server" else run_client(args)


if __name__ == "__main__":
    sys.exit(main())
