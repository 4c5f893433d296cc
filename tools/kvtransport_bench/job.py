"""The bench job: a prefill process (side-channel server) and a decode process (client,
the one that measures), started with ``spawn`` and watched by :func:`run_bench`.

READ: prefill fills blocks and names them, decode pulls them with one batched READ and
confirms. WRITE: decode names its free blocks, prefill fills and pushes them with one
batched WRITE plus a notification, decode verifies on the notification. The decode
process verifies every byte of every request before counting it.
"""

from __future__ import annotations

import multiprocessing as mp
import secrets
import time
from dataclasses import asdict
from typing import Any, Callable

import numpy as np
import zmq

import kvtransport as kvt

from .cache import KVCache
from .config import BenchConfig, ModeResult
from .protocol import Bye, Client, Confirm, Hello, Prepare, Prepared, Result, Server, WriteInto

__all__ = ["run_bench"]


def _open(cfg: BenchConfig, name: str) -> kvt.Agent:
    layout = {"layers": cfg.layers, "block_bytes": cfg.block_bytes, "num_blocks": cfg.num_blocks}
    return kvt.open(cfg.backend, name=name, layout=layout, default_timeout_s=cfg.timeout_s,
                    **cfg.backend_options)


def _await_notification(agent: kvt.Agent, want: bytes, timeout_s: float) -> bool:
    """Poll the agent's notifications until ``want`` arrives (True) or the deadline (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(n.payload == want for n in agent.notifications()):
            return True
        time.sleep(1e-4)
    return False


class _Prefill:
    """The prefill side's handlers, one per request message."""

    def __init__(self, cfg: BenchConfig, agent: kvt.Agent, cache: KVCache):
        self.cfg, self.agent, self.cache = cfg, agent, cache
        self.rng = np.random.default_rng(cfg.seed + 1)
        self.peer: kvt.Peer | None = None

    def hello(self, msg: Hello) -> Result:
        self.peer = self.agent.connect(msg.metadata)
        return Result(True, metadata=self.agent.metadata())

    def prepare(self, msg: Prepare) -> Prepared:
        blocks = self.rng.permutation(self.cfg.num_blocks)[: msg.n]
        self.cache.fill(msg.req, blocks)
        return Prepared(blocks.tolist())

    def confirm(self, msg: Confirm) -> Result:
        got = _await_notification(self.agent, f"read:{msg.req}".encode(), self.cfg.timeout_s)
        return Result(got, "" if got else "no read notification")

    def write_into(self, msg: WriteInto) -> Result:
        if self.peer is None:
            return Result(False, "WriteInto before Hello")
        blocks = self.rng.permutation(self.cfg.num_blocks)[: len(msg.blocks)]
        self.cache.fill(msg.req, blocks)
        remote = KVCache.remote_layout(self.peer, self.cfg)
        t = self.agent.write(self.peer, self.cache.layout.segments(blocks),
                             remote.segments(np.array(msg.blocks)), notify=f"written:{msg.req}".encode())
        st = t.wait()
        reply = Result(st.ok, st.reason, t.latency_s or 0.0)
        t.release()
        return reply


def _prefill_main(cfg: BenchConfig, port_q) -> None:  # pragma: no cover - child process
    try:
        agent = _open(cfg, "bench-prefill")
        cache = KVCache(agent, cfg)
    except Exception as exc:
        port_q.put(f"{type(exc).__name__}: {exc}")
        return
    ctx = zmq.Context()
    server = Server(ctx, cfg.secret, cfg.port)
    port_q.put(server.port)
    side = _Prefill(cfg, agent, cache)
    handlers: dict[type, Callable[[Any], Any]] = {
        Hello: side.hello, Prepare: side.prepare, Confirm: side.confirm, WriteInto: side.write_into}
    try:
        while True:
            msg = server.recv()
            if isinstance(msg, Result):  # refused: the reason goes back, the server goes on
                server.reply(msg)
                continue
            if isinstance(msg, Bye):
                server.reply(Result(True))
                break
            handler = handlers.get(type(msg))
            server.reply(handler(msg) if handler else Result(False, f"unexpected {type(msg).__name__}"))
    finally:
        server.close()
        ctx.term()
        agent.close()


def _decode_main(cfg: BenchConfig, port: int, progress_q) -> None:  # pragma: no cover - child
    agent = _open(cfg, "bench-decode")
    cache = KVCache(agent, cfg)
    ctx = zmq.Context()
    client = Client(ctx, cfg.secret, port, timeout_s=cfg.timeout_s + 5)
    rng = np.random.default_rng(cfg.seed + 2)
    try:
        hello = client.call(Hello(agent.metadata()))
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
                    theirs = np.array(client.call(Prepare(req, cfg.blocks_per_request)).blocks)
                    t = agent.read(peer, cache.layout.segments(mine), remote.segments(theirs),
                                   notify=f"read:{req}".encode())
                    st = t.wait()
                    took = t.latency_s or 0.0
                    t.release()
                    ok = st.ok and client.call(Confirm(req)).ok
                else:
                    res = client.call(WriteInto(req, mine.tolist()))
                    ok = res.ok and _await_notification(agent, f"written:{req}".encode(), cfg.timeout_s)
                    took = res.latency_s
                ok = ok and cache.verify(req, mine)
                if i >= cfg.warmup:
                    if ok:
                        verified += mine.size * 2 * cfg.layers
                        lat.append(took)
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
        client.call(Bye())
        progress_q.put(("done", [asdict(r) for r in results], agent.stats()))
    except Exception as exc:
        progress_q.put(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        client.close()
        ctx.term()
        agent.close()


def run_bench(cfg: BenchConfig, on_step: Callable[[str, bool], None] | None = None
              ) -> tuple[list[ModeResult], dict[str, Any]]:
    """Start both processes, wait for the result. ``on_step(mode, measured)`` per request.

    Raises ``BackendNotFoundError`` / ``BackendUnavailableError`` before starting anything
    when the backend is unknown or cannot run here."""
    from kvtransport.errors import BackendUnavailableError
    from kvtransport.registry import load_backend_class, probe_class

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
