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

Beside each row the table shows **raw NIXL**: the same case moved by NIXL's own Python
API with nothing of kvtransport in between (``--raw-nixl``, default on). Each side
registers *the same buffer* (the device buffer, also for staged rows; DRAM with
``--memory cpu``) with a plain ``nixl_agent`` (UCX plugin, progress thread); per case the
client prepares both descriptor lists once (``prep_xfer_dlist``), makes the request once
(``make_prepped_xfer``), re-posts it with ``transfer`` and polls ``check_xfer_state``.
Its first transfer is byte-checked exactly like ours (a mismatch is a FAIL line and exit
status 1), then its timed transfers alternate with ours. ``ours/raw`` is the ratio of
the GB/s. Where NIXL is not installed or cannot register the memory, the column reads
``n/a`` and a line under the table says why; that alone does not fail the run.

``--paths`` (default ``direct,staged``): *direct* registers the device buffer itself;
*staged* is the vLLM connector's host staging (``kv_buffer_device: cpu``), with its own
code (``kvtransport_vllm.staging.HostStaging``): the device buffer is a cache of
``--scatter``-sized blocks, a host mirror of it is registered, the sender copies the
moved blocks device -> host before the transfer, the receiver host -> device after it,
and the bytes are verified in device memory. Staged timings include both copies and one
control round trip to the server.

Exit status: 0 when every check passed; 1 when a transfer failed, a byte differed (ours
or raw NIXL's), or a backend refused device memory (the reason is printed); 2 when this
host cannot validate anything (no CUDA device, no torch, or a ROCm build of torch: use
bench/moriio_validate.py), with a one-line reason. See docs/GPU.md.

``--memory cpu`` runs the same flow on CPU buffers. It tests this script (protocol,
verification, table, the raw-NIXL column on DRAM), NOT device memory, and says so in its
output.
"""

from __future__ import annotations

import argparse
import functools
import itertools
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

    def nixl_memory(self) -> tuple[int, int, str, int]:
        """(address, length, NIXL memory kind, device) of the buffer the bytes are checked in:
        the device buffer (also when staged: raw NIXL moves it directly) or the CPU array."""
        if self.memory == "cuda":
            return self.t.data_ptr(), self.nbytes, "VRAM", self.t.device.index or 0
        if self.staging is not None:
            return self.t.data_ptr(), self.nbytes, "DRAM", 0
        return self.a.ctypes.data, self.nbytes, "DRAM", 0


# --------------------------------------------------------------------------- raw NIXL
class AnchorUnavailable(Exception):
    """Raw NIXL cannot run here; the message says why (shown under the table)."""


POLL_S = 5e-5  # raw NIXL completion polling interval, as in bench/test_bench_nixl.py
_SEQ = itertools.count()  # unique raw NIXL agent names within a process


def raw_nixl_module() -> Any:
    """NIXL's Python API module, found the way the nixl backend finds it (which also keeps
    NIXL's UCX from loading RDMA modules on a host without an RDMA device)."""
    try:
        from kvtransport_nixl import _probe
    except ImportError as exc:
        raise AnchorUnavailable(f"the kvtransport_nixl package is not importable ({exc})") from None
    mod, why = _probe.load_nixl()
    if mod is None:
        raise AnchorUnavailable(f"NIXL's Python API is not installed ({_probe.INSTALL_HINT}): {why}")
    return mod


class RawNixl:
    """The anchor: NIXL's own Python API moving the same buffer as ours, with nothing of
    kvtransport in between, so each row can be read against what NIXL itself reaches on
    this host and memory kind. One agent per side and run (UCX plugin, progress thread:
    NIXL's defaults), the buffer registered whole. Per case the client prepares both
    descriptor lists once, makes the request once and re-posts it each round -- the
    prepared path vLLM's NixlConnector uses, NIXL's fastest."""

    def __init__(self, name: str, mem: tuple[int, int, str, int]) -> None:
        m = raw_nixl_module()
        self.addr, self.nbytes, self.kind, self.dev = mem
        try:
            self.agent = m.nixl_agent(name, m.nixl_agent_config(backends=["UCX"]))
        except Exception as exc:
            raise AnchorUnavailable(f"NIXL could not start an agent: {type(exc).__name__}: {exc}") from None
        if "UCX" not in self.agent.backends:
            raise AnchorUnavailable(f"NIXL's UCX plugin did not load (plugins found: "
                                    f"{list(self.agent.get_plugin_list())}; NIXL_PLUGIN_DIR="
                                    f"{os.environ.get('NIXL_PLUGIN_DIR', 'unset')})")
        try:
            self.agent.register_memory(np.array([[self.addr, self.nbytes, self.dev]], np.uint64), self.kind)
        except Exception as exc:
            raise AnchorUnavailable(f"NIXL refused to register {self.kind} memory (device {self.dev}): "
                                    f"{type(exc).__name__}: {exc}") from None
        self.peer, self.remote = "", (0, "DRAM", 0)

    def export(self) -> dict[str, Any]:
        """What the initiator needs: NIXL's metadata (the target needs none of the initiator's)."""
        return {"md": self.agent.get_agent_metadata(), "addr": self.addr, "kind": self.kind, "dev": self.dev}

    def connect(self, info: dict[str, Any]) -> None:
        try:
            peer = self.agent.add_remote_agent(info["md"])
        except Exception as exc:
            raise AnchorUnavailable(f"NIXL refused the server's metadata: {type(exc).__name__}: {exc}") from None
        self.peer = peer.decode() if isinstance(peer, bytes) else str(peer)
        self.remote = (int(info["addr"]), str(info["kind"]), int(info["dev"]))

    def prepare(self, op: str, loc: np.ndarray, rem: np.ndarray, ln: np.ndarray) -> tuple[Any, Any, Any]:
        """(request, local list, remote list) for ``op`` over these ranges, ready to post."""
        raddr, rkind, rdev = self.remote

        def descs(base: int, offs: np.ndarray, dev: int) -> np.ndarray:
            d = np.empty((len(offs), 3), np.uint64)
            d[:, 0], d[:, 1], d[:, 2] = np.uint64(base) + offs, ln, dev
            return d

        lh = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", descs(self.addr, loc, self.dev), self.kind)
        rh = self.agent.prep_xfer_dlist(self.peer, descs(raddr, rem, rdev), rkind)
        idx = np.arange(len(ln), dtype=np.int32)
        return self.agent.make_prepped_xfer(op, lh, idx, rh, idx), lh, rh

    def run(self, prepared: tuple[Any, Any, Any], timeout: float) -> str:
        """Post the prepared request and poll it to the end: "" when DONE, else why not."""
        handle = prepared[0]
        try:
            st = self.agent.transfer(handle)
            deadline = time.monotonic() + timeout
            while st == "PROC":
                if time.monotonic() > deadline:
                    return f"raw NIXL transfer not done after {timeout}s"
                time.sleep(POLL_S)
                st = self.agent.check_xfer_state(handle)
        except Exception as exc:
            return f"raw NIXL: {type(exc).__name__}: {exc}"
        return "" if st == "DONE" else f"raw NIXL reported the transfer {st}"

    def release(self, prepared: tuple[Any, Any, Any]) -> None:
        handle, lh, rh = prepared
        self.agent.release_xfer_handle(handle)
        self.agent.release_dlist_handle(lh)
        self.agent.release_dlist_handle(rh)


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
                if msg.get("raw"):  # the raw-NIXL anchor registers the same buffer
                    try:
                        raw = RawNixl(f"gpu-validate-raw-server-{os.getpid()}-{next(_SEQ)}", buf.nixl_memory())
                        keep.append(raw)
                        reply["raw"] = raw.export()
                    except AnchorUnavailable as exc:
                        reply["raw_error"] = f"server: {exc}"
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
        self.anchor_results: list[tuple[str, bool, str]] = []  # raw NIXL's checks, tallied apart
        self.anchor_notes: list[str] = []  # why raw NIXL was not measured, per run
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

    def check(self, name: str, ok: bool, detail: str = "", anchor: bool = False) -> bool:
        (self.anchor_results if anchor else self.results).append((name, bool(ok), detail))
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
            r = self.call("open", backend=backend, metadata=agent.metadata(), block_bytes=bb, raw=a.raw_nixl == "on")
            if not self.check(f"{label}: server registers {what}", r["ok"], r.get("error", "")):
                return
            peer = agent.connect(r["metadata"])
            remote = peer.region(r["region_id"])
            raw = self.open_anchor(label, buf, r) if a.raw_nixl == "on" else None
            for name, loc, rem, ln in self.cases(nbytes):
                if staged and (ln % bb).any():
                    raise SystemExit(f"gpu_validate: staged cases need sizes that are multiples of {bb} bytes")
                for op in ("READ", "WRITE"):
                    self.one_case(label, op, name, agent, peer, buf, remote, loc, rem, ln, raw)
        finally:
            self.call("close")
            agent.close()
            self.keep.append((agent, buf))

    def open_anchor(self, label: str, buf: Buffer, reply: dict[str, Any]) -> RawNixl | None:
        """This run's raw-NIXL anchor on the client's buffer, connected to the server's; None
        (and the reason noted for the table) when NIXL cannot run it here."""
        try:
            if "raw" not in reply:
                raise AnchorUnavailable(reply.get("raw_error", "server: no raw NIXL agent"))
            raw = RawNixl(f"gpu-validate-raw-client-{os.getpid()}-{next(_SEQ)}", buf.nixl_memory())
            self.keep.append(raw)
            raw.connect(reply["raw"])
            return raw
        except AnchorUnavailable as exc:
            self.anchor_notes.append(f"{label}: {exc}")
            return None

    def verify(self, op: str, buf: Buffer, loc: np.ndarray, rem: np.ndarray, ln: np.ndarray) -> int:
        """Wrong bytes after one transfer of these ranges: the whole client buffer after a
        READ, the whole server buffer after a WRITE (moved ranges and untouched rest)."""
        if op == "READ":
            expect = pattern(CLIENT_SEED, buf.nbytes).copy()
            server = pattern(SERVER_SEED, buf.nbytes)
            for lo, ro, n in zip(loc.tolist(), rem.tolist(), ln.tolist()):
                expect[lo:lo + n] = server[ro:ro + n]
            return int(np.count_nonzero(buf.host() != expect))
        v = self.call("verify_write", src=loc.tolist(), dst=rem.tolist(), len=ln.tolist(), client_nbytes=buf.nbytes)
        if "n_bad" not in v:
            raise SystemExit(f"gpu_validate: the server could not verify a WRITE: {v.get('error')}")
        return int(v["n_bad"])

    def anchor_case(self, label: str, op: str, name: str, raw: RawNixl, buf: Buffer,
                    loc: np.ndarray, rem: np.ndarray, ln: np.ndarray) -> tuple[Any, Any] | None:
        """Raw NIXL's first transfer of the case, checked like ours: (its prepared request,
        a callable that times one transfer) when every byte is right, else None (FAIL printed)."""
        check = f"raw NIXL@{label}: {op} {name} byte-exact"
        # --anchor-fault short (the self-test's proof that this check can fail): the anchor
        # moves only the first half of every range, the verification expects all of it
        mv = ln // 2 if self.args.anchor_fault == "short" else ln
        try:
            prepared = raw.prepare(op, loc, rem, mv)
        except Exception as exc:
            self.check(check, False, f"NIXL could not prepare the transfer: {type(exc).__name__}: {exc}", anchor=True)
            return None
        self.call("reset")
        buf.fill(CLIENT_SEED)
        why = raw.run(prepared, self.args.timeout)
        if why:
            self.check(check, False, why, anchor=True)
            return None
        bad = self.verify(op, buf, loc, rem, ln)
        if not self.check(check, bad == 0, f"{int(ln.sum())} bytes to move, {bad} wrong in the whole buffer",
                          anchor=True):
            return None
        return prepared, lambda: raw.run(prepared, self.args.timeout)

    def one_case(self, backend: str, op: str, name: str, agent: kvt.Agent, peer: Any, buf: Buffer,
                 remote: Any, loc: np.ndarray, rem: np.ndarray, ln: np.ndarray, raw: RawNixl | None) -> None:
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
        bad = self.verify(op, buf, loc, rem, ln)
        if not self.check(label, bad == 0, f"{int(ln.sum())} bytes moved, {bad} wrong in the whole buffer"):
            return
        anchor = self.anchor_case(backend, op, name, raw, buf, loc, rem, ln) if raw is not None else None
        raw_note = "n/a" if raw is None else ("FAIL" if anchor is None else "")
        # timed rounds: ours and raw NIXL's alternate, so load from other processes hits both alike
        lat: list[float] = []
        raw_lat: list[float] = []
        for _ in range(self.args.iters):
            t0 = time.perf_counter()
            st = fn(peer, local_segs, remote_segs)
            lat.append(time.perf_counter() - t0)
            if not st.ok:
                self.check(f"{backend}: {op} {name} timed runs", False, st.reason)
                return
            if anchor is not None:
                t0 = time.perf_counter()
                why = anchor[1]()
                raw_lat.append(time.perf_counter() - t0)
                if why:
                    self.check(f"raw NIXL@{backend}: {op} {name} timed runs", False, why, anchor=True)
                    anchor, raw_note, raw_lat = None, "FAIL", []
        if anchor is not None:
            raw.release(anchor[0])
        if lat:
            med = float(np.median(lat))
            nbytes = float(ln.sum())
            raw_gbps = nbytes / float(np.median(raw_lat)) / 1e9 if raw_lat else None
            self.table.append({"backend": backend, "op": op, "case": name, "MiB": nbytes / 2**20,
                               "GB/s": nbytes / med / 1e9, "ms": med * 1e3, "raw GB/s": raw_gbps,
                               "raw note": raw_note})

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


def print_table(rows: list[dict[str, Any]], memory: str, anchor_notes: list[str], raw_on: bool = True) -> None:
    """The GB/s table; raw NIXL's GB/s and ours/raw beside each row ("n/a" when it was not
    measured, the reasons below the table; "FAIL" when its bytes or transfer failed)."""
    note = "" if memory == "cuda" else "  (CPU memory: script self-test, NOT device memory)"
    print(f"\nthroughput, median of the timed runs{note}")
    hdr = f"{'backend':<16}{'op':<7}{'case':<26}{'MiB':>8}{'GB/s':>9}{'ms':>9}{'raw NIXL GB/s':>15}{'ours/raw':>10}"
    print(hdr + "\n" + "-" * len(hdr))
    for r in rows:
        raw, ratio = (r["raw note"], "-") if r["raw GB/s"] is None else (
            f"{r['raw GB/s']:.2f}", f"{r['GB/s'] / r['raw GB/s']:.2f}")
        print(f"{r['backend']:<16}{r['op']:<7}{r['case']:<26}{r['MiB']:>8.1f}{r['GB/s']:>9.2f}{r['ms']:>9.2f}"
              f"{raw:>15}{ratio:>10}")
    if not raw_on:
        print("raw NIXL n/a: not run (--raw-nixl off)")
        return
    print("raw NIXL: the same buffers through NIXL's Python API (UCX plugin; prep_xfer_dlist, "
          "make_prepped_xfer once per case, transfer + check_xfer_state each round)")
    for why in dict.fromkeys(anchor_notes):
        print(f"raw NIXL n/a for {why}")


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
    print_table(client.table, args.memory, client.anchor_notes, args.raw_nixl == "on")
    failed = [r for r in client.results if not r[1]]
    print(f"\n{len(client.results) - len(failed)} passed, {len(failed)} failed")
    raw_failed = [r for r in client.anchor_results if not r[1]]
    print(f"raw NIXL anchor: {len(client.anchor_results) - len(raw_failed)} passed, {len(raw_failed)} failed")
    return 1 if failed or raw_failed or not client.results else 0


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
    p.add_argument("--raw-nixl", choices=["on", "off"], default="on",
                   help="on (default): also move every case with NIXL's own API on the same buffers, "
                        "check its bytes and print its GB/s beside ours")
    # the self-test's fault injection: raw NIXL moves only half of each range, which the
    # byte check must report (tests/gpu/test_gpu_validate_script.py)
    p.add_argument("--anchor-fault", choices=["none", "short"], default="none", help=argparse.SUPPRESS)
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
