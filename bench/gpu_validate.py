#!/usr/bin/env python
"""Validate GPU-memory transfers on a CUDA host: one command, two processes, every byte checked.

    python bench/gpu_validate.py                      # ucx and nixl, CUDA device memory

The command starts a server process (GPU 1 when the host has two GPUs, else GPU 0) and
acts as the client (GPU 0). For each backend (``--backends``, default ``ucx,nixl``) both
sides open an agent, register one device buffer (``--region-mib``, default 256 MiB) and
swap metadata over a local ZeroMQ socket; the client then moves, READ and WRITE:

  * each contiguous size of ``--sizes-mib`` (default 16 and 256 MiB);
  * ``--scatter`` blocks (default 4096 x 16 KiB) at random, different slots on each side;

verifies every byte (READ on the client, WRITE on the server; for WRITE the untouched
bytes too), then times ``--iters`` more transfers and prints a GB/s table.

``--paths`` (default ``direct,staged``): *direct* registers the device buffer itself;
*staged* is the vLLM connector's host staging (``kv_buffer_device: cpu``), with its own
code (``kvtransport_vllm.staging.HostStaging``): the device buffer is a cache of
``--scatter``-sized blocks, a host mirror of it is registered, the sender copies the
moved blocks device -> host before the transfer, the receiver host -> device after it,
and the bytes are verified in device memory. Staged timings include both copies and one
control round trip to the server.

Exit status: 0 when every check passed; 1 when a transfer failed, a byte differed, or a
backend refused device memory (the reason is printed); 2 when this host cannot validate
anything (no CUDA device, no torch, or a ROCm build of torch: use bench/moriio_validate.py),
with a one-line reason. See docs/GPU.md.

``--memory cpu`` runs the same flow on CPU buffers. It tests this script (protocol,
verification, table), NOT device memory, and says so in its output.
"""

from __future__ import annotations

import argparse
import functools
import os
import socket
import subprocess
import sys
import time
from typing import Any

import msgspec
import numpy as np
import zmq

import kvtransport as kvt

SERVER_SEED, CLIENT_SEED = 11, 22
NO_VALIDATION = 2  # exit status: nothing could be validated on this host
_enc, _dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder()


def cuda_unavailable_reason() -> str | None:
    """Why CUDA device memory cannot be validated here, or None when it can."""
    try:
        import torch
    except ImportError:
        return "torch is not installed (install a CUDA build of torch)"
    if getattr(torch.version, "hip", None):
        return "this torch is a ROCm build; validate AMD GPUs with bench/moriio_validate.py"
    if not torch.cuda.is_available():
        return f"no CUDA device visible to torch {torch.__version__} (torch.cuda.is_available() is False)"
    return None


@functools.lru_cache(maxsize=4)
def pattern(seed: int, nbytes: int) -> np.ndarray:
    out = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    out.flags.writeable = False
    return out


class Buffer:
    """One registered buffer, in device memory (a torch CUDA tensor) or, for the script's
    self-test, CPU memory. Filled and read back through host copies only: the transports
    move device bytes, numpy sees copies. Staged (``block_bytes`` > 0): the buffer is a
    cache of blocks and the transport moves its host mirror (connector host staging)."""

    def __init__(self, agent: kvt.Agent, nbytes: int, memory: str, gpu: int, block_bytes: int = 0):
        self.nbytes, self.memory, self.block_bytes = nbytes, memory, block_bytes
        self.staging: Any = None
        if block_bytes:
            import torch
            from kvtransport_vllm.kv_layout import describe_kv_caches
            from kvtransport_vllm.staging import HostStaging

            self.dev = torch.device(f"cuda:{gpu}" if memory == "cuda" else "cpu")
            self.t = torch.zeros(nbytes, dtype=torch.uint8, device=self.dev)
            nblocks = nbytes // block_bytes
            cache = self.t.view(nblocks, block_bytes)
            self.staging = HostStaging(describe_kv_caches({"buffer": cache}, nblocks))
            self.region = agent.register(self.staging.host[0].view(-1))  # the mirror: CPU memory
        elif memory == "cuda":
            import torch

            self.dev = torch.device(f"cuda:{gpu}")
            self.t = torch.zeros(nbytes, dtype=torch.uint8, device=self.dev)
            self.region = agent.register(self.t)  # kind "cuda", device gpu: from the tensor
        else:
            self.a = np.zeros(nbytes, np.uint8)
            self.region = agent.register(self.a)

    def fill(self, seed: int) -> None:
        data = pattern(seed, self.nbytes)
        if self.staging is not None:
            self.staging.host[0].zero_()  # a missing staging copy cannot pass on stale bytes
        if self.memory == "cuda" or self.staging is not None:
            import torch

            self.t.copy_(torch.from_numpy(data.copy()).to(self.dev))
            if self.memory == "cuda":
                torch.cuda.synchronize(self.dev)  # the pattern is on the device before any transfer
        else:
            self.a[:] = data

    def host(self) -> np.ndarray:
        if self.memory == "cuda":
            import torch

            torch.cuda.synchronize(self.dev)
            return self.t.cpu().numpy()
        if self.staging is not None:
            return self.t.numpy()
        return self.a

    def block_ids(self, offsets: list[int], lengths: list[int]) -> list[int]:
        """The staging blocks covering these (block-aligned) byte ranges."""
        bb = self.block_bytes
        return [b for o, n in zip(offsets, lengths) for b in range(o // bb, (o + n) // bb)]


# --------------------------------------------------------------------------- server
def serve(args: argparse.Namespace) -> int:
    sock = zmq.Context.instance().socket(zmq.REP)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(f"tcp://127.0.0.1:{args.port}")
    agent: kvt.Agent | None = None
    buf: Buffer | None = None
    # Closed agents and their buffers stay referenced until the process ends: freeing a
    # buffer a transport library may still touch from its own threads after close would
    # turn a clean run into a crash.
    keep: list[Any] = []
    while True:
        msg = _dec.decode(sock.recv())
        cmd, reply = msg["cmd"], {"ok": True}
        try:
            if cmd == "open":
                agent = kvt.open(msg["backend"], name=f"gpu-validate-server-{msg['backend']}")
                buf = Buffer(agent, args.region_mib << 20, args.memory, args.gpu, msg.get("block_bytes", 0))
                agent.connect(msg["metadata"])
                reply.update(metadata=agent.metadata(), region_id=buf.region.id)
            elif cmd == "reset":
                buf.fill(SERVER_SEED)
            elif cmd == "stage_out":  # staged READ: our blocks device -> host mirror first
                buf.staging.before_send(buf.block_ids(msg["off"], msg["len"]))
            elif cmd == "stage_in":  # staged WRITE: written blocks host mirror -> device
                buf.staging.after_receive(buf.block_ids(msg["off"], msg["len"]))
            elif cmd == "verify_write":
                # expected: our pattern, with the client's bytes at the written ranges
                expect = pattern(SERVER_SEED, buf.nbytes).copy()
                client = pattern(CLIENT_SEED, msg["client_nbytes"])
                for src, dst, ln in zip(msg["src"], msg["dst"], msg["len"]):
                    expect[dst:dst + ln] = client[src:src + ln]
                bad = np.flatnonzero(buf.host() != expect)
                reply.update(ok=bad.size == 0, n_bad=int(bad.size), first_bad=bad[:5].tolist())
            elif cmd == "close":
                agent.close()
                keep.append((agent, buf))
                agent = buf = None
            elif cmd == "bye":
                sock.send(_enc.encode(reply))
                break
            else:
                reply = {"ok": False, "error": f"unknown command {cmd!r}"}
        except Exception as exc:  # reported to the client, which prints it and fails the check
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            if cmd == "open" and agent is not None:
                agent.close()
                keep.append((agent, buf))
                agent = buf = None
        sock.send(_enc.encode(reply))
    sock.setsockopt(zmq.LINGER, 5000)  # deliver the reply to "bye" before this process exits:
    sock.close()
    zmq.Context.instance().term()  # term() is what waits for the linger (os._exit would not)
    return 0


# --------------------------------------------------------------------------- client
class _Failed:
    """A staged step that failed before or after the transfer, shaped like its status."""

    def __init__(self, reason: str) -> None:
        self.ok, self.reason = False, reason


class Client:
    def __init__(self, args: argparse.Namespace, port: int, server: subprocess.Popen):
        self.args, self.server = args, server
        self.keep: list[Any] = []  # closed agents and buffers, see serve()
        self.sock = zmq.Context.instance().socket(zmq.REQ)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.results: list[tuple[str, bool, str]] = []
        self.table: list[dict[str, Any]] = []

    def call(self, cmd: str, **kw: Any) -> dict[str, Any]:
        self.sock.send(_enc.encode({"cmd": cmd, **kw}))
        deadline = time.monotonic() + self.args.timeout
        while not self.sock.poll(200):
            if self.server.poll() is not None:
                raise SystemExit(f"gpu_validate: the server process died (exit status {self.server.returncode}) "
                                 f"before answering {cmd!r}")
            if time.monotonic() > deadline:
                raise SystemExit(f"gpu_validate: the server process did not answer {cmd!r} within {self.args.timeout}s")
        return _dec.decode(self.sock.recv())

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.results.append((name, bool(ok), detail))
        print(f"{'PASS' if ok else 'FAIL'}  {name}  {detail}", flush=True)
        return ok

    def cases(self, nbytes: int) -> list[tuple[str, np.ndarray, np.ndarray, np.ndarray]]:
        """(name, local offsets, remote offsets, lengths) of every case."""
        out = []
        for mib in self.args.sizes_mib:
            size = mib << 20
            if size > nbytes:
                raise SystemExit(f"gpu_validate: --sizes-mib {mib} exceeds --region-mib {self.args.region_mib}")
            z = np.zeros(1, np.uint64)
            out.append((f"{mib} MiB contiguous", z, z, np.array([size], np.uint64)))
        n, bb = self.args.scatter
        slots = nbytes // bb
        if n > slots:
            raise SystemExit(f"gpu_validate: --scatter {n}x{bb} does not fit in --region-mib {self.args.region_mib}")
        rng = np.random.default_rng(7)
        loc = rng.permutation(slots)[:n].astype(np.uint64) * bb
        rem = rng.permutation(slots)[:n].astype(np.uint64) * bb
        out.append((f"{n} x {bb // 1024} KiB scattered", loc, rem, np.full(n, bb, np.uint64)))
        return out

    def run_backend(self, backend: str, staged: bool = False) -> None:
        a = self.args
        nbytes = a.region_mib << 20
        bb = a.scatter[1] if staged else 0
        label = f"{backend}+staged" if staged else backend
        what = f"{a.memory} memory" + (" (staged through a host mirror)" if staged else "")
        try:
            agent = kvt.open(backend, name=f"gpu-validate-client-{label}", default_timeout_s=a.timeout)
            buf = Buffer(agent, nbytes, a.memory, 0, bb)
        except Exception as exc:
            self.check(f"{label}: register {what}", False, f"{type(exc).__name__}: {exc}")
            return
        try:
            r = self.call("open", backend=backend, metadata=agent.metadata(), block_bytes=bb)
            if not self.check(f"{label}: server registers {what}", r["ok"], r.get("error", "")):
                return
            peer = agent.connect(r["metadata"])
            remote = peer.region(r["region_id"])
            for name, loc, rem, ln in self.cases(nbytes):
                if staged and (ln % bb).any():
                    raise SystemExit(f"gpu_validate: staged cases need sizes that are multiples of {bb} bytes")
                for op in ("READ", "WRITE"):
                    self.one_case(label, op, name, agent, peer, buf, remote, loc, rem, ln)
        finally:
            self.call("close")
            agent.close()
            self.keep.append((agent, buf))

    def one_case(self, backend: str, op: str, name: str, agent: kvt.Agent, peer: Any, buf: Buffer,
                 remote: Any, loc: np.ndarray, rem: np.ndarray, ln: np.ndarray) -> None:
        self.call("reset")
        buf.fill(CLIENT_SEED)
        move = agent.read if op == "READ" else agent.write
        local_segs, remote_segs = buf.region.segments(loc, ln), remote.segments(rem, ln)

        def fn(peer: Any, local_segs: Any, remote_segs: Any) -> Any:
            if buf.staging is None:
                return move(peer, local_segs, remote_segs).wait()
            return self.staged(op, buf, move, peer, local_segs, remote_segs, loc, rem, ln)

        st = fn(peer, local_segs, remote_segs)
        label = f"{backend}: {op} {name} byte-exact"
        if not st.ok:
            self.check(label, False, st.reason)
            return
        if op == "READ":
            expect = pattern(CLIENT_SEED, buf.nbytes).copy()
            server = pattern(SERVER_SEED, buf.nbytes)
            for lo, ro, n in zip(loc.tolist(), rem.tolist(), ln.tolist()):
                expect[lo:lo + n] = server[ro:ro + n]
            bad = int(np.count_nonzero(buf.host() != expect))
        else:
            v = self.call("verify_write", src=loc.tolist(), dst=rem.tolist(), len=ln.tolist(),
                          client_nbytes=buf.nbytes)
            bad = v["n_bad"]
        if not self.check(label, bad == 0, f"{int(ln.sum())} bytes moved, {bad} wrong in the whole buffer"):
            return
        lat = []
        for _ in range(self.args.iters):
            t0 = time.perf_counter()
            st = fn(peer, local_segs, remote_segs)
            lat.append(time.perf_counter() - t0)
            if not st.ok:
                self.check(f"{backend}: {op} {name} timed runs", False, st.reason)
                return
        if lat:
            med = float(np.median(lat))
            self.table.append({"backend": backend, "op": op, "case": name, "MiB": float(ln.sum()) / 2**20,
                               "GB/s": float(ln.sum()) / med / 1e9, "ms": med * 1e3})

    def staged(self, op: str, buf: Buffer, move: Any, peer: Any, local_segs: Any, remote_segs: Any,
                loc: np.ndarray, rem: np.ndarray, ln: np.ndarray) -> Any:
        """One staged transfer (its status), as the connector does it: the sender's blocks
        device -> host before the transfer, the receiver's host -> device after it."""
        off_l, off_r, lens = loc.tolist(), rem.tolist(), ln.tolist()
        if op == "READ":
            r = self.call("stage_out", off=off_r, len=lens)
            if not r["ok"]:
                return _Failed(f"server staging copy failed: {r.get('error')}")
            st = move(peer, local_segs, remote_segs).wait()
            if st.ok:
                buf.staging.after_receive(buf.block_ids(off_l, lens))
            return st
        buf.staging.before_send(buf.block_ids(off_l, lens))
        st = move(peer, local_segs, remote_segs).wait()
        if st.ok:
            r = self.call("stage_in", off=off_r, len=lens)
            if not r["ok"]:
                return _Failed(f"server staging copy failed: {r.get('error')}")
        return st


def print_table(rows: list[dict[str, Any]], memory: str) -> None:
    note = "" if memory == "cuda" else "  (CPU memory: script self-test, NOT device memory)"
    print(f"\nthroughput, median of the timed runs{note}")
    hdr = f"{'backend':<16}{'op':<7}{'case':<26}{'MiB':>8}{'GB/s':>9}{'ms':>9}"
    print(hdr + "\n" + "-" * len(hdr))
    for r in rows:
        print(f"{r['backend']:<16}{r['op']:<7}{r['case']:<26}{r['MiB']:>8.1f}{r['GB/s']:>9.2f}{r['ms']:>9.2f}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args: argparse.Namespace) -> int:
    server_gpu = 0
    if args.memory == "cuda":
        import torch

        server_gpu = 1 if torch.cuda.device_count() > 1 else 0
        print(f"client on cuda:0, server on cuda:{server_gpu} ({torch.cuda.get_device_name(0)})", flush=True)
    else:
        print("*** --memory cpu: tests this script only; it validates NO device memory ***", flush=True)
    port = _free_port()
    cmd = [sys.executable, __file__, "--role", "server", "--port", str(port), "--gpu", str(server_gpu),
           "--memory", args.memory, "--region-mib", str(args.region_mib)]
    server = subprocess.Popen(cmd)
    client = Client(args, port, server)
    try:
        for backend in args.backends:
            if "direct" in args.paths:
                client.run_backend(backend)
            if "staged" in args.paths:
                client.run_backend(backend, staged=True)
        client.call("bye")
    finally:
        client.sock.close()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    print_table(client.table, args.memory)
    failed = [r for r in client.results if not r[1]]
    print(f"\n{len(client.results) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed or not client.results else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", type=lambda s: s.split(","), default=["ucx", "nixl"])
    p.add_argument("--sizes-mib", type=lambda s: [int(x) for x in s.split(",")], default=[16, 256])
    p.add_argument("--scatter", type=lambda s: tuple(int(x) for x in s.lower().split("x")), default=(4096, 16384),
                   help="COUNTxBYTES scattered blocks (default 4096x16384)")
    p.add_argument("--paths", type=lambda s: s.split(","), default=["direct", "staged"],
                   help="direct (register device memory), staged (host staging as the connector's "
                        "kv_buffer_device: cpu), or both (default)")
    p.add_argument("--region-mib", type=int, default=256, help="registered buffer per side (MiB)")
    p.add_argument("--iters", type=int, default=5, help="timed transfers per case after the verified one")
    p.add_argument("--timeout", type=float, default=120.0, help="per-transfer and per-reply deadline (s)")
    p.add_argument("--memory", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: self-test of this script on CPU buffers (validates no device memory)")
    p.add_argument("--role", choices=["server"], help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--gpu", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.role == "server":
        return serve(args)
    if args.memory == "cuda":
        reason = cuda_unavailable_reason()
        if reason is not None:
            print(f"gpu_validate: cannot validate CUDA device memory on this host: {reason}", file=sys.stderr)
            return NO_VALIDATION
    return run(args)


if __name__ == "__main__":
    try:
        rc = main()
    except SystemExit as exc:  # argparse errors (2) and the client's fatal errors (1)
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
        rc = exc.code if isinstance(exc.code, int) else 1
    sys.stdout.flush()
    sys.stderr.flush()
    # os._exit, not sys.exit: a process that opened a nixl agent crashes (SIGSEGV) in the
    # interpreter's exit-time teardown of the NIXL library, which would replace this
    # script's verdict with 139. Everything is closed and flushed by now.
    os._exit(rc)
