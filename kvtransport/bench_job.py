"""The main job behind ``kvtransport bench``: a prefill and a decode process move a
paged KV cache through a backend, in READ and WRITE modes, and verify every byte.

Shape: ``layers`` layers, each one registered tensor holding K and V halves of
``num_blocks`` blocks of ``block_bytes`` (so two layout parts per layer, as vLLM's
paged caches lie). Each request moves ``blocks_per_request`` scattered blocks in every
part. Block contents are a cheap deterministic function of (request, part, block) so the
receiver recomputes what must have arrived and compares every byte.

The two processes hand-shake over a ZMQ side channel (REQ/REP, msgspec messages, each
sealed with the run's shared secret by ``kvtransport.auth``):
decode connects to prefill, they swap agent metadata and layouts, then per request:
READ — prefill fills blocks and names them, decode pulls with one batched READ and
confirms; WRITE — decode names its free blocks, prefill fills and pushes with one
batched WRITE plus a notification, decode verifies on the notification.
"""

from __future__ import annotations

import multiprocessing as mp
import secrets
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import msgspec
import numpy as np
import zmq

from .auth import AuthError, Authenticator

__all__ = ["BenchConfig", "ModeResult", "run_bench"]


@dataclass
class BenchConfig:
    backend: str = "loopback"
    backend_options: dict[str, Any] = field(default_factory=dict)
    layers: int = 32
    num_blocks: int = 128
    block_bytes: int = 32 * 1024  # 16 tokens x 8 KV heads x 128 dims x 2 bytes
    blocks_per_request: int = 32
    requests: int = 16
    warmup: int = 2
    modes: tuple[str, ...] = ("read", "write")
    timeout_s: float = 60.0
    port: int = 0
    seed: int = 0
    #: Cluster secret for the side channel; run_bench makes a random one per run.
    secret: bytes = b""

    @property
    def layer_bytes(self) -> int:
        return 2 * self.num_blocks * self.block_bytes

    @property
    def request_bytes(self) -> int:
        return 2 * self.layers * self.blocks_per_request * self.block_bytes


@dataclass
class ModeResult:
    mode: str
    requests: int
    bytes_per_request: int
    gbps: float
    latency_ms: dict[str, float]
    verified_blocks: int
    failed: int


# -- side-channel messages ------------------------------------------------------------

class Hello(msgspec.Struct, tag=True):
    metadata: bytes


class Prepare(msgspec.Struct, tag=True):  # READ: fill blocks for request, name them
    req: int
    n: int


class Prepared(msgspec.Struct, tag=True):
    blocks: list[int]


class Confirm(msgspec.Struct, tag=True):  # READ: decode read request `req`
    req: int


class WriteInto(msgspec.Struct, tag=True):  # WRITE: push request `req` into these blocks
    req: int
    blocks: list[int]


class Result(msgspec.Struct, tag=True):
    ok: bool
    detail: str = ""
    latency_s: float = 0.0
    metadata: bytes = b""


class Bye(msgspec.Struct, tag=True):
    pass


Msg = Hello | Prepare | Prepared | Confirm | WriteInto | Result | Bye
_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(Msg)


# -- the KV cache -----------------------------------------------------------------------

class KVCache:
    """``layers`` tensors of shape (2, num_blocks, block_bytes) bytes, registered."""

    def __init__(self, agent, cfg: BenchConfig):
        import kvtransport as kvt

        self.cfg = cfg
        self.tensors = [np.zeros((2, cfg.num_blocks, cfg.block_bytes), np.uint8) for _ in range(cfg.layers)]
        self.regions = [agent.register(t) for t in self.tensors]
        half = cfg.num_blocks * cfg.block_bytes
        self.layout = kvt.BlockLayout([(r, off) for r in self.regions for off in (0, half)],
                                      cfg.block_bytes, cfg.num_blocks)

    @staticmethod
    def remote_layout(peer, cfg: BenchConfig):
        import kvtransport as kvt

        half = cfg.num_blocks * cfg.block_bytes
        return kvt.BlockLayout([(r, off) for r in peer.regions for off in (0, half)],
                               cfg.block_bytes, cfg.num_blocks)

    def expected(self, req: int, nblocks: int) -> np.ndarray:
        """Content of request ``req``: (parts, blocks, block_bytes) from uint64 ramps."""
        words = self.cfg.block_bytes // 8
        parts = 2 * self.cfg.layers
        base = np.uint64((req + 1) * 0x9E3779B97F4A7C15 % (1 << 63))
        ramp = np.arange(parts * nblocks * words, dtype=np.uint64) + base
        return ramp.view(np.uint8).reshape(parts, nblocks, self.cfg.block_bytes)

    def fill(self, req: int, blocks: np.ndarray) -> None:
        exp = self.expected(req, blocks.size)
        for layer, t in enumerate(self.tensors):
            t[0, blocks] = exp[2 * layer]
            t[1, blocks] = exp[2 * layer + 1]

    def verify(self, req: int, blocks: np.ndarray) -> bool:
        exp = self.expected(req, blocks.size)
        return all(np.array_equal(t[0, blocks], exp[2 * i]) and np.array_equal(t[1, blocks], exp[2 * i + 1])
                   for i, t in enumerate(self.tensors))

    def scrub(self, blocks: np.ndarray) -> None:
        for t in self.tensors:
            t[:, blocks] = 0


# -- the two processes ----------------------------------------------------------------

def _open(cfg: BenchConfig, name: str):
    import kvtransport as kvt

    layout = {"layers": cfg.layers, "block_bytes": cfg.block_bytes, "num_blocks": cfg.num_blocks}
    return kvt.open(cfg.backend, name=name, layout=layout, default_timeout_s=cfg.timeout_s,
                    **cfg.backend_options)


def _prefill_main(cfg: BenchConfig, port_q) -> None:  # pragma: no cover - child process
    try:
        agent = _open(cfg, "bench-prefill")
        cache = KVCache(agent, cfg)
    except Exception as exc:
        port_q.put(f"{type(exc).__name__}: {exc}")
        return
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REP)
    sock.setsockopt(zmq.MAXMSGSIZE, 64 << 20)
    port = sock.bind_to_random_port("tcp://127.0.0.1") if not cfg.port else (sock.bind(f"tcp://127.0.0.1:{cfg.port}") or cfg.port)
    port_q.put(port)
    rng = np.random.default_rng(cfg.seed + 1)
    auth = Authenticator(cfg.secret, "kvtransport-bench")
    peer = None
    try:
        while True:
            try:
                msg = _dec.decode(auth.open(sock.recv(), "req"))
            except (AuthError, msgspec.DecodeError, msgspec.ValidationError) as exc:
                sock.send(auth.seal(_enc.encode(Result(False, f"refused: {exc}")), "rep"))
                continue
            if isinstance(msg, Hello):
                peer = agent.connect(msg.metadata)
                reply: Any = Result(True, metadata=agent.metadata())
            elif isinstance(msg, Prepare):
                blocks = rng.permutation(cfg.num_blocks)[: msg.n]
                cache.fill(msg.req, blocks)
                reply = Prepared(blocks.tolist())
            elif isinstance(msg, Confirm):
                deadline = time.monotonic() + cfg.timeout_s
                want = f"read:{msg.req}".encode()
                got = False
                while not got and time.monotonic() < deadline:
                    got = any(n.payload == want for n in agent.notifications())
                    if not got:
                        time.sleep(1e-4)
                reply = Result(got, "" if got else "no read notification")
            elif isinstance(msg, WriteInto):
                blocks = rng.permutation(cfg.num_blocks)[: len(msg.blocks)]
                cache.fill(msg.req, blocks)
                remote = KVCache.remote_layout(peer, cfg)
                t = agent.write(peer, cache.layout.segments(blocks), remote.segments(np.array(msg.blocks)),
                                notify=f"written:{msg.req}".encode())
                st = t.wait()
                reply = Result(st.ok, st.reason, t.latency_s or 0.0)
                t.release()
            elif isinstance(msg, Bye):
                sock.send(auth.seal(_enc.encode(Result(True)), "rep"))
                break
            else:
                reply = Result(False, f"unexpected {type(msg).__name__}")
            sock.send(auth.seal(_enc.encode(reply), "rep"))
    finally:
        sock.close(0)
        ctx.term()
        agent.close()


def _decode_main(cfg: BenchConfig, port: int, progress_q) -> None:  # pragma: no cover - child
    agent = _open(cfg, "bench-decode")
    cache = KVCache(agent, cfg)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.RCVTIMEO, int(cfg.timeout_s * 1000) + 5000)
    sock.connect(f"tcp://127.0.0.1:{port}")

    auth = Authenticator(cfg.secret, "kvtransport-bench")

    def rpc(m: Any) -> Any:
        sock.send(auth.seal(_enc.encode(m), "req"))
        return _dec.decode(auth.open(sock.recv(), "rep"))

    rng = np.random.default_rng(cfg.seed + 2)
    try:
        hello = rpc(Hello(agent.metadata()))
        peer = agent.connect(hello.metadata)
        remote = KVCache.remote_layout(peer, cfg)
        results = []
        req = 0
        for mode in cfg.modes:
            lat: list[float] = []
            verified = failed = 0
            for i in range(cfg.warmup + cfg.requests):
                req += 1
                mine = rng.permutation(cfg.num_blocks)[: cfg.blocks_per_request]
                cache.scrub(mine)
                if mode == "read":
                    theirs = np.array(rpc(Prepare(req, cfg.blocks_per_request)).blocks)
                    t = agent.read(peer, cache.layout.segments(mine), remote.segments(theirs),
                                   notify=f"read:{req}".encode())
                    st = t.wait()
                    elapsed = t.latency_s or 0.0
                    t.release()
                    ok = st.ok and rpc(Confirm(req)).ok
                else:
                    res = rpc(WriteInto(req, mine.tolist()))
                    want = f"written:{req}".encode()
                    deadline = time.monotonic() + cfg.timeout_s
                    seen = False
                    while res.ok and not seen and time.monotonic() < deadline:
                        seen = any(n.payload == want for n in agent.notifications())
                        if not seen:
                            time.sleep(1e-4)
                    ok = res.ok and seen
                    elapsed = res.latency_s
                ok = ok and cache.verify(req, mine)
                if i >= cfg.warmup:
                    if ok:
                        verified += mine.size * 2 * cfg.layers
                        lat.append(elapsed)
                    else:
                        failed += 1
                progress_q.put(("step", mode, i >= cfg.warmup))
            lat_a = np.array(lat or [float("nan")])
            total = float(lat_a.sum()) if lat else float("nan")
            results.append(ModeResult(
                mode=mode, requests=cfg.requests, bytes_per_request=cfg.request_bytes,
                gbps=(cfg.request_bytes * len(lat) / total / 1e9) if lat else 0.0,
                latency_ms={f"p{p}": float(np.percentile(lat_a, p) * 1e3) for p in (50, 90, 99)},
                verified_blocks=verified, failed=failed,
            ))
        rpc(Bye())
        progress_q.put(("done", [asdict(r) for r in results], agent.stats()))
    except Exception as exc:
        progress_q.put(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        sock.close(0)
        ctx.term()
        agent.close()


def run_bench(cfg: BenchConfig, on_step=None) -> tuple[list[ModeResult], dict[str, Any]]:
    """Start both processes, wait for the result. ``on_step(mode, measured)`` per request."""
    from .errors import BackendUnavailableError
    from .registry import load_backend_class, probe_class

    av = probe_class(load_backend_class(cfg.backend))  # unknown name: BackendNotFoundError now
    if not av.usable:
        raise BackendUnavailableError(cfg.backend, av.reason, av.install_hint)
    if not cfg.secret:
        cfg.secret = secrets.token_bytes(32)
    ctx = mp.get_context("spawn")
    port_q = ctx.Queue()
    progress_q = ctx.Queue()
    prefill = ctx.Process(target=_prefill_main, args=(cfg, port_q), daemon=True)
    prefill.start()
    try:
        port = port_q.get(timeout=120)
    except Exception:
        prefill.kill()
        raise RuntimeError("prefill process did not start (see its error output above)") from None
    if isinstance(port, str):
        prefill.join(10)
        raise RuntimeError(f"prefill process failed: {port}")
    decode = ctx.Process(target=_decode_main, args=(cfg, port, progress_q), daemon=True)
    decode.start()
    try:
        limit = time.monotonic() + 120 + cfg.timeout_s * (cfg.requests + cfg.warmup) * len(cfg.modes)
        while True:
            remaining = limit - time.monotonic()
            if remaining <= 0:
                raise RuntimeError("benchmark did not finish in time")
            try:
                kind, *rest = progress_q.get(timeout=min(remaining, 5))
            except Exception:
                if not decode.is_alive():
                    raise RuntimeError(f"decode process exited with code {decode.exitcode}") from None
                continue
            if kind == "step":
                if on_step:
                    on_step(*rest)
            elif kind == "error":
                raise RuntimeError(f"benchmark failed in the decode process: {rest[0]}")
            else:
                results, stats = rest
                return [ModeResult(**r) for r in results], stats
    finally:
        decode.join(30)
        prefill.join(30)
        for p in (decode, prefill):
            if p.is_alive():
                p.kill()
