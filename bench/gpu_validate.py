#!/usr/bin/env python
"""Validate GPU-memory transfers on a CUDA host: one command, separate processes, every byte checked.

    python bench/gpu_validate.py                      # ucx and nixl, CUDA device memory

The command starts a server process and acts as the client. With two GPUs the client is
on GPU 0 and the server on GPU 1 (cross-GPU); with one GPU both are on it
(``--placement`` forces ``same`` or ``cross``). For each backend (``--backends``, default
``ucx,nixl``) both sides open an agent, register one buffer (``--region-mib``, default
256 MiB) and swap metadata over a local ZeroMQ socket; the client then moves, READ and
WRITE:

  * each contiguous size of ``--sizes-mib`` (default 16 and 256 MiB);
  * ``--scatter`` blocks (default 4096 x 16 KiB) at random, different slots on each side;

verifies every byte (READ on the client, WRITE on the server; for WRITE the untouched
bytes too), then times ``--iters`` more transfers and verifies the last of them the same
way (the destination is reset before it, so a timed round that moved nothing fails), and
prints a GB/s table.

``--paths`` (default ``direct,staged,aliased``):

  * *direct* registers the device buffer itself;
  * *staged* is the vLLM connector's host staging (``kv_buffer_device: cpu``) with its own
    code (``kvtransport_vllm.staging.HostStaging``): the device buffer is a cache of
    ``--scatter``-sized blocks, its host mirror is registered, the sender copies the moved
    blocks device -> host before the transfer, the receiver host -> device after it, and
    the bytes are verified in device memory;
  * *aliased* is *staged* for a hybrid model: two KV cache groups whose layers alias the
    same device bytes (as vLLM allocates them), the moved blocks split between the groups.
    A staging that copies one group's ids through the other group's layer, or keeps a
    mirror per layer, writes wrong bytes into the cache, which the check reports.

Staged timings include both copies and one control round trip to the server.

Beside each row the table shows **raw NIXL**: the same case (same sizes and offsets, same
memory kind and GPUs) moved by NIXL's own Python API with nothing of kvtransport in
between (``--raw-nixl``, default on). It runs in two processes of its own (so its progress
threads do not share a process with ours), each with a buffer of the same size registered
whole with one plain ``nixl_agent`` (UCX plugin, progress thread); per case its client
prepares both descriptor lists once (``prep_xfer_dlist``), makes the request once
(``make_prepped_xfer``), re-posts it with ``transfer`` and polls ``check_xfer_state``. Its
first and last transfers are byte-checked exactly like ours (a mismatch is a FAIL line and
exit status 1); its timed rounds alternate with ours and are timed inside its process.
Both agents are released (handles, remote agent, registrations, the agent itself) before
the anchor processes exit. ``ours/raw`` is the ratio of the GB/s. Where NIXL is not
installed or cannot register the memory, the column reads ``n/a`` and a line under the
table says why; that alone does not fail the run.

Exit status: 0 when every check passed; 1 when a transfer failed, a byte differed (ours
or raw NIXL's), or a backend refused device memory (the reason is printed); 2 when this
host cannot validate anything (no CUDA device, no torch, or a ROCm build of torch: use
bench/moriio_validate.py), with a one-line reason. See docs/GPU.md.

``--memory cpu`` runs the same flow on CPU buffers. It tests this script (protocol,
verification, staging calls, table, the raw-NIXL column on DRAM), NOT device memory, and
says so in its output.
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import zmq

import kvtransport as kvt
from kvtransport.testing.ports import free_port_range

SERVER_SEED, CLIENT_SEED = 11, 22
NO_VALIDATION = 2  # exit status: nothing could be validated on this host
PATHS = ("direct", "staged", "aliased")
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


def placement(device_count: int, choice: str) -> tuple[int, int]:
    """(client GPU, server GPU): cross-GPU when two GPUs exist (``auto``) or asked for."""
    if choice == "cross" and device_count < 2:
        raise SystemExit(f"gpu_validate: --placement cross needs two GPUs; this host has {device_count}")
    cross = choice == "cross" or (choice == "auto" and device_count >= 2)
    return 0, 1 if cross else 0


@functools.lru_cache(maxsize=4)
def pattern(seed: int, nbytes: int) -> np.ndarray:
    out = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    out.flags.writeable = False
    return out


def make_staging(cache: Any, nblocks: int, groups: int) -> tuple[Any, Any]:
    """(HostStaging, the tensor to register) for a device cache of ``nblocks`` blocks, as the
    connector builds it. ``groups`` = 2: two layers of two KV cache groups aliasing the same
    cache bytes (a hybrid model's allocation); each layer copies only its own group's ids."""
    from kvtransport_vllm.kv_layout import describe_kv_caches
    from kvtransport_vllm.staging import HostStaging

    names = [f"model.layers.{g}.attn" for g in range(groups)]
    layers = describe_kv_caches({n: cache for n in names}, nblocks)
    staging = HostStaging(layers, layer_group=list(range(groups)) if groups > 1 else ())
    mirror = staging.registered(layers)[0].tensor
    return staging, mirror


def split_groups(ids: list[int], groups: int) -> tuple[list[int], list[int]]:
    """(block ids of every group one after another, ids per group): blocks alternate between
    the groups, the way the connector's metadata carries a hybrid model's ids."""
    if groups <= 1:
        return ids, []
    per = [ids[g::groups] for g in range(groups)]
    return [b for p in per for b in p], [len(p) for p in per]


class Buffer:
    """One buffer, in device memory (a torch CUDA tensor) or, for the script's self-test, CPU
    memory, registered with ``agent`` when one is given (the raw-NIXL anchor registers it
    itself). Filled and read back through host copies only: the transports move device
    bytes, numpy sees copies. Staged (``block_bytes`` > 0): the buffer is a cache of blocks
    and the transport moves its host mirror (connector host staging); ``groups`` = 2: two
    aliased KV cache groups."""

    def __init__(self, agent: kvt.Agent | None, nbytes: int, memory: str, gpu: int, block_bytes: int = 0,
                 groups: int = 1):
        self.nbytes, self.memory, self.block_bytes, self.groups = nbytes, memory, block_bytes, groups
        self.staging: Any = None
        self.mirror: Any = None
        if block_bytes or memory == "cuda":
            import torch

            self.dev = torch.device(f"cuda:{gpu}" if memory == "cuda" else "cpu")
            self.t = torch.zeros(nbytes, dtype=torch.uint8, device=self.dev)
            if block_bytes:
                nblocks = nbytes // block_bytes
                self.staging, self.mirror = make_staging(self.t.view(nblocks, block_bytes), nblocks, groups)
            target = self.mirror.view(-1) if block_bytes else self.t  # staged: the mirror, CPU memory
        else:
            self.a = np.zeros(nbytes, np.uint8)
            target = self.a
        self.region = agent.register(target) if agent is not None else None

    def fill(self, seed: int) -> None:
        data = pattern(seed, self.nbytes)
        if self.staging is not None:
            self.mirror.zero_()  # a missing staging copy cannot pass on stale bytes
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

    def stage(self, direction: str, offsets: list[int], lengths: list[int]) -> None:
        """Connector host staging of these ranges: ``out`` device -> mirror before sending,
        ``in`` mirror -> device after receiving (split between the groups when aliased)."""
        ids, sizes = split_groups(self.block_ids(offsets, lengths), self.groups)
        if direction == "out":
            self.staging.before_send(ids, sizes)
        else:  # the connector polls this fence before reporting the load; here: wait for it
            self.staging.after_receive(ids, sizes).synchronize()

    def nixl_memory(self) -> tuple[int, int, str, int]:
        """(address, length, NIXL memory kind, device) of the buffer the bytes are checked in."""
        if self.memory == "cuda":
            return self.t.data_ptr(), self.nbytes, "VRAM", self.t.device.index or 0
        if self.staging is not None:
            return self.t.data_ptr(), self.nbytes, "DRAM", 0
        return self.a.ctypes.data, self.nbytes, "DRAM", 0


def wrong_bytes(op: str, buf: Buffer, loc: np.ndarray, rem: np.ndarray, ln: np.ndarray,
                call: Callable[..., dict[str, Any]]) -> int:
    """Wrong bytes after one transfer of these ranges: the whole client buffer after a READ,
    the whole server buffer (asked with ``call``) after a WRITE (moved ranges and untouched rest)."""
    if op == "READ":
        expect = pattern(CLIENT_SEED, buf.nbytes).copy()
        server = pattern(SERVER_SEED, buf.nbytes)
        for lo, ro, n in zip(loc.tolist(), rem.tolist(), ln.tolist()):
            expect[lo:lo + n] = server[ro:ro + n]
        return int(np.count_nonzero(buf.host() != expect))
    v = call("verify_write", src=loc.tolist(), dst=rem.tolist(), len=ln.tolist(), client_nbytes=buf.nbytes)
    if "n_bad" not in v:
        raise SystemExit(f"gpu_validate: the server could not verify a WRITE: {v.get('error')}")
    return int(v["n_bad"])


class Channel:
    """Request/reply to one of this run's processes, with a deadline and, for a child
    process, a liveness check (a dead process is reported instead of waited for)."""

    def __init__(self, port: int, timeout: float, name: str, proc: subprocess.Popen | None = None) -> None:
        self.timeout, self.name, self.proc = timeout, name, proc
        self.sock = zmq.Context.instance().socket(zmq.REQ)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://127.0.0.1:{port}")

    def call(self, cmd: str, **kw: Any) -> dict[str, Any]:
        self.sock.send(_enc.encode({"cmd": cmd, **kw}))
        deadline = time.monotonic() + self.timeout
        while not self.sock.poll(200):
            if self.proc is not None and self.proc.poll() is not None:
                raise SystemExit(f"gpu_validate: the {self.name} process died (exit status "
                                 f"{self.proc.returncode}) before answering {cmd!r}")
            if time.monotonic() > deadline:
                raise SystemExit(f"gpu_validate: the {self.name} process did not answer {cmd!r} within {self.timeout}s")
        return _dec.decode(self.sock.recv())

    def close(self) -> None:
        self.sock.close()


# --------------------------------------------------------------------------- raw NIXL
class AnchorUnavailable(Exception):
    """Raw NIXL cannot run here; the message says why (shown under the table)."""


POLL_S = 5e-5  # raw NIXL completion polling interval, as in bench/test_bench_nixl.py


def raw_nixl_module() -> Any:
    """NIXL's Python API module, found the way the nixl backend finds it (which also keeps
    NIXL's UCX from loading RDMA modules on a host without an RDMA device)."""
    try:
        from kvtransport_nixl import probe as _probe
    except ImportError as exc:
        raise AnchorUnavailable(f"the kvtransport_nixl package is not importable ({exc})") from None
    mod, why = _probe.load_nixl()
    if mod is None:
        raise AnchorUnavailable(f"NIXL's Python API is not installed ({_probe.INSTALL_HINT}): {why}")
    return mod


class RawNixl:
    """The anchor: NIXL's own Python API moving a buffer like ours, with nothing of
    kvtransport in between, so each row can be read against what NIXL itself reaches on
    this host and memory kind. One agent per anchor process (UCX plugin, progress thread:
    NIXL's defaults), the buffer registered whole. Per case the client prepares both
    descriptor lists once, makes the request once and re-posts it each round -- the
    prepared path vLLM's NixlConnector uses, NIXL's fastest."""

    def __init__(self, name: str, mem: tuple[int, int, str, int]) -> None:
        m = raw_nixl_module()
        self.addr, self.nbytes, self.kind, self.dev = mem
        self.reg: Any = None
        try:
            self.agent: Any = m.nixl_agent(name, m.nixl_agent_config(backends=["UCX"]))
        except Exception as exc:
            raise AnchorUnavailable(f"NIXL could not start an agent: {type(exc).__name__}: {exc}") from None
        if "UCX" not in self.agent.backends:
            plugins = list(self.agent.get_plugin_list())
            self.close()
            raise AnchorUnavailable(f"NIXL's UCX plugin did not load (plugins found: {plugins}; "
                                    f"NIXL_PLUGIN_DIR={os.environ.get('NIXL_PLUGIN_DIR', 'unset')})")
        try:
            self.reg = self.agent.register_memory(np.array([[self.addr, self.nbytes, self.dev]], np.uint64),
                                                  self.kind)
        except Exception as exc:
            self.close()
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

    def close(self) -> None:
        """Release the agent: the remote agent, the registration, then the agent itself (its
        destructor joins NIXL's progress thread, which otherwise keeps polling a core)."""
        if self.agent is None:
            return
        if self.peer:
            self.agent.remove_remote_agent(self.peer)
            self.peer = ""
        if self.reg is not None:
            self.agent.deregister_memory(self.reg)
            self.reg = None
        self.agent = None


def thread_count() -> int:
    """Threads of this process, native ones included (NIXL's progress thread is one)."""
    return len(os.listdir("/proc/self/task"))


def release_anchor(raw: RawNixl | None) -> dict[str, Any]:
    """Close the anchor's agent; the reply says how many threads the process had before and
    after (a released agent has joined its progress thread)."""
    if raw is None:
        return {}
    before = thread_count()
    raw.close()
    return {"threads_before": before, "threads_after": thread_count()}


def serve_anchor_client(args: argparse.Namespace) -> int:
    """The raw-NIXL anchor's initiator, a process of its own: it moves each case with NIXL's
    API on its own buffer, checks its first and last transfers (READ here, WRITE on the
    anchor server, which it asks itself) and times its rounds where they run."""
    sock = zmq.Context.instance().socket(zmq.REP)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(f"tcp://127.0.0.1:{args.port}")
    target = Channel(args.target_port, args.timeout, "raw-NIXL anchor server")
    buf = Buffer(None, args.region_mib << 20, args.memory, args.gpu)
    raw: RawNixl | None = None
    first: tuple[Any, Any, Any] | None = None  # the case's prepared request (first/last rounds)
    timed: tuple[Any, Any, Any] | None = None  # its timed rounds' (differs only under a fault)
    case: tuple[str, np.ndarray, np.ndarray, np.ndarray] | None = None

    def release_case() -> None:
        nonlocal first, timed
        for p in {id(p): p for p in (first, timed) if p is not None}.values():
            raw.release(p)
        first = timed = None

    def transfer(prepared: tuple[Any, Any, Any], reset: bool) -> dict[str, Any]:
        """One transfer, timed here; with ``reset`` both buffers are refilled first and the
        whole result is checked."""
        op, loc, rem, ln = case
        if reset:
            target.call("reset")
            buf.fill(CLIENT_SEED)
        t0 = time.perf_counter()
        why = raw.run(prepared, args.timeout)
        out: dict[str, Any] = {"why": why, "s": time.perf_counter() - t0}
        if reset and not why:
            out["bad"] = wrong_bytes(op, buf, loc, rem, ln, target.call)
        return out

    while True:
        msg = _dec.decode(sock.recv())
        cmd, reply = msg["cmd"], {"ok": True}
        try:
            if cmd == "open":
                try:
                    raw = RawNixl(f"gpu-validate-raw-client-{os.getpid()}", buf.nixl_memory())
                    raw.connect(msg["info"])
                except AnchorUnavailable as exc:
                    reply = {"ok": False, "error": f"client: {exc}"}
            elif cmd == "case":  # prepare, then the first transfer, checked
                release_case()
                op = msg["op"]
                loc, rem, ln = (np.array(msg[k], np.uint64) for k in ("loc", "rem", "len"))
                case = (op, loc, rem, ln)
                # the self-test's faults: "short" moves only the first half of every range in
                # every round, "short-timed" only in the timed rounds (the checks expect all)
                first = raw.prepare(op, loc, rem, ln // 2 if args.anchor_fault == "short" else ln)
                timed = raw.prepare(op, loc, rem, ln // 2) if args.anchor_fault == "short-timed" else first
                reply.update(transfer(first, reset=True))
            elif cmd == "round":  # a timed round; the last one refilled first and checked
                reply.update(transfer(timed, reset=msg["last"]))
            elif cmd == "end_case":
                release_case()
            elif cmd == "bye":
                if raw is not None:
                    release_case()
                reply.update(release_anchor(raw))
                raw = None
                sock.send(_enc.encode(reply))
                break
            else:
                reply = {"ok": False, "error": f"unknown command {cmd!r}"}
        except Exception as exc:  # reported to the client, which prints it and fails the check
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        sock.send(_enc.encode(reply))
    target.close()
    sock.setsockopt(zmq.LINGER, 5000)  # deliver the reply to "bye" before this process exits
    sock.close()
    zmq.Context.instance().term()
    return 0


# --------------------------------------------------------------------------- server
def serve(args: argparse.Namespace) -> int:
    """The target of our transfers (``open``) or of raw NIXL's (``raw_open``: the anchor
    server, a process of its own): registers its buffer, refills it, stages, checks WRITEs."""
    sock = zmq.Context.instance().socket(zmq.REP)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(f"tcp://127.0.0.1:{args.port}")
    agent: kvt.Agent | None = None
    buf: Buffer | None = None
    raw: RawNixl | None = None
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
                buf = Buffer(agent, args.region_mib << 20, args.memory, args.gpu, msg.get("block_bytes", 0),
                             msg.get("groups", 1))
                agent.connect(msg["metadata"])
                reply.update(metadata=agent.metadata(), region_id=buf.region.id)
            elif cmd == "raw_open":  # the raw-NIXL anchor's target
                buf = Buffer(None, args.region_mib << 20, args.memory, args.gpu)
                try:
                    raw = RawNixl(f"gpu-validate-raw-server-{os.getpid()}", buf.nixl_memory())
                    reply["info"] = raw.export()
                except AnchorUnavailable as exc:
                    reply = {"ok": False, "error": f"server: {exc}"}
            elif cmd == "reset":
                buf.fill(SERVER_SEED)
            elif cmd == "stage_out":  # staged READ: our blocks device -> host mirror first
                buf.stage("out", msg["off"], msg["len"])
            elif cmd == "stage_in":  # staged WRITE: written blocks host mirror -> device
                buf.stage("in", msg["off"], msg["len"])
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
                reply.update(release_anchor(raw))
                raw = None
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


def _spawn(args: argparse.Namespace, role: str, port: int, gpu: int, *extra: str) -> subprocess.Popen:
    """One of this run's helper processes: this script in ``role``."""
    return subprocess.Popen([sys.executable, __file__, "--role", role, "--port", str(port), "--gpu", str(gpu),
                             "--memory", args.memory, "--region-mib", str(args.region_mib),
                             "--timeout", str(args.timeout), "--anchor-fault", args.anchor_fault, *extra])


class Anchor:
    """The raw-NIXL anchor as the client drives it: its two processes (server on the
    server's GPU, client on the client's), one case at a time."""

    def __init__(self, args: argparse.Namespace, client_gpu: int, server_gpu: int) -> None:
        sport, cport = free_port_range(1), free_port_range(1)
        self.procs = [_spawn(args, "server", sport, server_gpu)]
        self.server = Channel(sport, args.timeout, "raw-NIXL anchor server", self.procs[0])
        self.procs.append(_spawn(args, "anchor-client", cport, client_gpu, "--target-port", str(sport)))
        self.client = Channel(cport, args.timeout, "raw-NIXL anchor client", self.procs[1])

    def open(self) -> str:
        """"" when both agents are up and connected, else why raw NIXL cannot run here."""
        r = self.server.call("raw_open")
        if not r["ok"]:
            return r["error"]
        r = self.client.call("open", info=r["info"])
        return "" if r["ok"] else r["error"]

    def close(self, timeout: float) -> list[str]:
        """End both processes, their agents released first: one line per side saying so."""
        lines = []
        for ch in (self.client, self.server):
            if ch.proc.poll() is None:
                try:
                    r = ch.call("bye")
                    if "threads_after" in r:
                        lines.append(f"{ch.name} (pid {ch.proc.pid}): agent released, threads "
                                     f"{r['threads_before']} -> {r['threads_after']}")
                except SystemExit:
                    pass
            ch.close()
        for p in self.procs:
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        return lines


class Client:
    def __init__(self, args: argparse.Namespace, port: int, server: subprocess.Popen, anchor: Anchor | None):
        self.args, self.anchor = args, anchor
        self.keep: list[Any] = []  # closed agents and buffers, see serve()
        self.server = Channel(port, args.timeout, "server", server)
        self.call = self.server.call
        self.results: list[tuple[str, bool, str]] = []
        self.anchor_results: list[tuple[str, bool, str]] = []  # raw NIXL's checks, tallied apart
        self.anchor_note = ""  # why raw NIXL was not measured
        self.table: list[dict[str, Any]] = []

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

    def run_backend(self, backend: str, path: str = "direct") -> None:
        a = self.args
        nbytes = a.region_mib << 20
        bb = a.scatter[1] if path != "direct" else 0
        groups = 2 if path == "aliased" else 1
        label = backend if path == "direct" else f"{backend}+{path}"
        what = f"{a.memory} memory" + {"direct": "", "staged": " (staged through a host mirror)",
                                        "aliased": " (staged, two KV cache groups aliasing the cache)"}[path]
        try:
            agent = kvt.open(backend, name=f"gpu-validate-client-{label}", default_timeout_s=a.timeout)
            buf = Buffer(agent, nbytes, a.memory, a.client_gpu, bb, groups)
        except Exception as exc:
            self.check(f"{label}: register {what}", False, f"{type(exc).__name__}: {exc}")
            return
        try:
            r = self.call("open", backend=backend, metadata=agent.metadata(), block_bytes=bb, groups=groups)
            if not self.check(f"{label}: server registers {what}", r["ok"], r.get("error", "")):
                return
            peer = agent.connect(r["metadata"])
            remote = peer.region(r["region_id"])
            for name, loc, rem, ln in self.cases(nbytes):
                if bb and (ln % bb).any():
                    raise SystemExit(f"gpu_validate: staged cases need sizes that are multiples of {bb} bytes")
                for op in ("READ", "WRITE"):
                    self.one_case(label, op, name, agent, peer, buf, remote, loc, rem, ln)
        finally:
            self.call("close")
            agent.close()
            self.keep.append((agent, buf))

    def anchor_case(self, label: str, op: str, name: str, loc: np.ndarray, rem: np.ndarray,
                    ln: np.ndarray) -> bool:
        """Raw NIXL's first transfer of the case, checked like ours: True when every byte is
        right (its timed rounds may follow), else False (FAIL printed)."""
        r = self.anchor.client.call("case", op=op, loc=loc.tolist(), rem=rem.tolist(), len=ln.tolist())
        why = r.get("error") or r.get("why")
        return self.check(f"raw NIXL@{label}: {op} {name} byte-exact", not why and r.get("bad") == 0,
                          why or f"{int(ln.sum())} bytes to move, {r['bad']} wrong in the whole buffer", anchor=True)

    def one_case(self, backend: str, op: str, name: str, agent: kvt.Agent, peer: Any, buf: Buffer,
                 remote: Any, loc: np.ndarray, rem: np.ndarray, ln: np.ndarray) -> None:
        self.call("reset")
        buf.fill(CLIENT_SEED)
        move = agent.read if op == "READ" else agent.write
        local_segs, remote_segs = buf.region.segments(loc, ln), remote.segments(rem, ln)
        # the self-test's fault: our timed rounds move only the first half of every range
        tln = ln // 2 if self.args.fault == "short-timed" else ln
        timed_segs = (buf.region.segments(loc, tln), remote.segments(rem, tln))

        def fn(local_segs: Any, remote_segs: Any) -> Any:
            if buf.staging is None:
                return move(peer, local_segs, remote_segs).wait()
            return self.staged(op, buf, move, peer, local_segs, remote_segs, loc, rem, ln)

        st = fn(local_segs, remote_segs)
        label = f"{backend}: {op} {name} byte-exact"
        if not st.ok:
            self.check(label, False, st.reason)
            return
        bad = wrong_bytes(op, buf, loc, rem, ln, self.call)
        if not self.check(label, bad == 0, f"{int(ln.sum())} bytes moved, {bad} wrong in the whole buffer"):
            return
        anchor = self.anchor is not None and self.anchor_case(backend, op, name, loc, rem, ln)
        raw_note = "n/a" if self.anchor is None else ("FAIL" if not anchor else "")
        # timed rounds: ours and raw NIXL's alternate, so load from other processes hits both
        # alike; the last of each is run on refilled buffers and checked byte for byte
        lat: list[float] = []
        raw_lat: list[float] = []
        for i in range(self.args.iters):
            last = i == self.args.iters - 1
            if last:
                self.call("reset")
                buf.fill(CLIENT_SEED)
            t0 = time.perf_counter()
            st = fn(*timed_segs)
            lat.append(time.perf_counter() - t0)
            if not st.ok:
                self.check(f"{backend}: {op} {name} timed runs", False, st.reason)
                return
            if last:
                bad = wrong_bytes(op, buf, loc, rem, ln, self.call)
                self.check(f"{backend}: {op} {name} last timed round byte-exact", bad == 0,
                           f"{int(ln.sum())} bytes moved, {bad} wrong in the whole buffer")
            if anchor:
                r = self.anchor.client.call("round", last=last)
                why = r.get("error") or r.get("why")
                if why:
                    self.check(f"raw NIXL@{backend}: {op} {name} timed runs", False, why, anchor=True)
                    anchor, raw_note, raw_lat = False, "FAIL", []
                    continue
                raw_lat.append(r["s"])
                if last and not self.check(f"raw NIXL@{backend}: {op} {name} last timed round byte-exact",
                                           r["bad"] == 0, f"{int(ln.sum())} bytes to move, {r['bad']} wrong "
                                           "in the whole buffer", anchor=True):
                    raw_note, raw_lat = "FAIL", []
        if self.anchor is not None:
            self.anchor.client.call("end_case")
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
                buf.stage("in", off_l, lens)
            return st
        buf.stage("out", off_l, lens)
        st = move(peer, local_segs, remote_segs).wait()
        if st.ok:
            r = self.call("stage_in", off=off_r, len=lens)
            if not r["ok"]:
                return _Failed(f"server staging copy failed: {r.get('error')}")
        return st


def print_table(rows: list[dict[str, Any]], memory: str, anchor_note: str, raw_on: bool = True) -> None:
    """The GB/s table; raw NIXL's GB/s and ours/raw beside each row ("n/a" when it was not
    measured, the reason below the table; "FAIL" when its bytes or transfer failed)."""
    note = "" if memory == "cuda" else "  (CPU memory: script self-test, NOT device memory)"
    print(f"\nthroughput, median of the timed runs{note}")
    hdr = f"{'backend':<18}{'op':<7}{'case':<26}{'MiB':>8}{'GB/s':>9}{'ms':>9}{'raw NIXL GB/s':>15}{'ours/raw':>10}"
    print(hdr + "\n" + "-" * len(hdr))
    for r in rows:
        raw, ratio = (r["raw note"], "-") if r["raw GB/s"] is None else (
            f"{r['raw GB/s']:.2f}", f"{r['GB/s'] / r['raw GB/s']:.2f}")
        print(f"{r['backend']:<18}{r['op']:<7}{r['case']:<26}{r['MiB']:>8.1f}{r['GB/s']:>9.2f}{r['ms']:>9.2f}"
              f"{raw:>15}{ratio:>10}")
    if not raw_on:
        print("raw NIXL n/a: not run (--raw-nixl off)")
        return
    print("raw NIXL: the same cases in two processes of their own through NIXL's Python API (UCX plugin; "
          "prep_xfer_dlist, make_prepped_xfer once per case, transfer + check_xfer_state each round)")
    if anchor_note:
        print(f"raw NIXL n/a: {anchor_note}")


def run(args: argparse.Namespace) -> int:
    if args.memory == "cuda":
        import torch

        args.client_gpu, server_gpu = placement(torch.cuda.device_count(), args.placement)
        kind = "cross-GPU" if server_gpu != args.client_gpu else "one GPU"
        print(f"client on cuda:{args.client_gpu}, server on cuda:{server_gpu} ({kind}; "
              f"{torch.cuda.get_device_name(args.client_gpu)})", flush=True)
    else:
        args.client_gpu, server_gpu = 0, 0
        print("*** --memory cpu: tests this script only; it validates NO device memory ***", flush=True)
    port = free_port_range(1)
    server = _spawn(args, "server", port, server_gpu)
    anchor = Anchor(args, args.client_gpu, server_gpu) if args.raw_nixl == "on" else None
    client = Client(args, port, server, anchor)
    released: list[str] = []
    if anchor is not None:
        print(f"processes: ours {os.getpid()} (client) and {server.pid} (server); raw NIXL anchor "
              f"{anchor.procs[1].pid} (client) and {anchor.procs[0].pid} (server)", flush=True)
    try:
        if anchor is not None:
            client.anchor_note = anchor.open()
            if client.anchor_note:
                client.anchor = None
        for backend in args.backends:
            for path in PATHS:
                if path in args.paths:
                    client.run_backend(backend, path)
        client.call("bye")
    finally:
        client.server.close()
        if anchor is not None:
            released = anchor.close(30)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    print_table(client.table, args.memory, client.anchor_note, args.raw_nixl == "on")
    for line in released:
        print(line)
    failed = [r for r in client.results if not r[1]]
    print(f"\n{len(client.results) - len(failed)} passed, {len(failed)} failed")
    raw_failed = [r for r in client.anchor_results if not r[1]]
    print(f"raw NIXL anchor: {len(client.anchor_results) - len(raw_failed)} passed, {len(raw_failed)} failed")
    if args.json is not None:  # for bench/gpu_e2e.py, which puts raw NIXL beside its load waits
        with open(args.json, "w") as f:
            f.write(msgspec.json.encode({"rows": client.table, "failed": [r[0] for r in failed + raw_failed],
                                         "raw_note": client.anchor_note}).decode())
    return 1 if failed or raw_failed or not client.results else 0


def _list(kind: type, allowed: tuple[str, ...] = ()) -> Callable[[str], list[Any]]:
    def parse(s: str) -> list[Any]:
        items = [kind(x) for x in s.split(",") if x]
        bad = [x for x in items if allowed and x not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"{bad} not in {list(allowed)}")
        return items
    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", type=_list(str), default=["ucx", "nixl"])
    p.add_argument("--sizes-mib", type=_list(int), default=[16, 256], help="contiguous cases ('' for none)")
    p.add_argument("--scatter", type=lambda s: tuple(int(x) for x in s.lower().split("x")), default=(4096, 16384),
                   help="COUNTxBYTES scattered blocks (default 4096x16384)")
    p.add_argument("--paths", type=_list(str, PATHS), default=list(PATHS),
                   help="direct (register device memory), staged (host staging as the connector's "
                        "kv_buffer_device: cpu), aliased (staged, two KV cache groups aliasing the cache); "
                        "default all three")
    p.add_argument("--region-mib", type=int, default=256, help="registered buffer per side (MiB)")
    p.add_argument("--iters", type=int, default=5, help="timed transfers per case after the verified one; "
                                                        "the last is verified too")
    p.add_argument("--timeout", type=float, default=120.0, help="per-transfer and per-reply deadline (s)")
    p.add_argument("--memory", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: self-test of this script on CPU buffers (validates no device memory)")
    p.add_argument("--placement", choices=["auto", "same", "cross"], default="auto",
                   help="auto (default): client on GPU 0, server on GPU 1 when two GPUs exist, else both on "
                        "GPU 0; same: both on GPU 0; cross: GPU 0 and 1 (refused with one GPU)")
    p.add_argument("--raw-nixl", choices=["on", "off"], default="on",
                   help="on (default): also move every case with NIXL's own API in two processes of its own, "
                        "check its bytes and print its GB/s beside ours")
    p.add_argument("--json", help="also write the table and the failed checks to this file (JSON)")
    # the self-test's fault injection (tests/gpu/test_gpu_validate_script.py): raw NIXL moves
    # only half of each range, always (short) or in its timed rounds (short-timed); --fault
    # short-timed does the same to our timed rounds. The byte checks must report each.
    p.add_argument("--anchor-fault", choices=["none", "short", "short-timed"], default="none",
                   help=argparse.SUPPRESS)
    p.add_argument("--fault", choices=["none", "short-timed"], default="none", help=argparse.SUPPRESS)
    p.add_argument("--role", choices=["server", "anchor-client"], help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--target-port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--gpu", type=int, default=0, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.role == "server":
        return serve(args)
    if args.role == "anchor-client":
        return serve_anchor_client(args)
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
