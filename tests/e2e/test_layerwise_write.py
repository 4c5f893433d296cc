r"""Layer-wise WRITE end to end: two real vLLM CPU engines behind ``disagg_proxy.py --flow
router`` (both hops at once), the prefill engine with ``layerwise_write``.

vLLM's ``maybe_transfer_kv_layer`` wraps the attention op on CPU too, so the connector's
``save_kv_layer`` runs after each layer's real attention; the prefill engine posts each
layer's completed blocks from there when the decode's block ids arrived first. What is
asserted: greedy tokens equal the single engine's, the decode engine took the prompt KV
from the prefill engine, and the prefill engine's log shows layer posts (so the hooks ran
and the layer-wise path, not only the whole-request one, moved KV). Both engines end with
no KV block in use.

Run: ``KVT_E2E_BACKENDS=loopback python -m pytest tests/e2e/test_layerwise_write.py -q``.
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
LAYER_LINE = "layer-wise WRITE "


def _logging_config(path) -> str:
    """vLLM's logging plus our package's DEBUG lines (one per layer post)."""
    handler = {"class": "logging.StreamHandler", "stream": "ext://sys.stdout", "formatter": "plain"}
    cfg = {
        "version": 1, "disable_existing_loggers": False,
        "formatters": {"plain": {"format": "%(levelname)s %(asctime)s %(name)s: %(message)s"}},
        "handlers": {"out": handler},
        "loggers": {"vllm": {"handlers": ["out"], "level": "INFO", "propagate": False},
                    "kvtransport_vllm": {"handlers": ["out"], "level": "DEBUG", "propagate": False}},
    }
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.fixture(scope="module")
def layerwise_pair(tiny_model, log_dir, baseline, tmp_path_factory):
    backend, mode = "loopback", "write"
    skip_unless_usable(backend)
    tag = "layerwise-loopback-write"
    pre_port, dec_port = harness.free_port(), harness.free_port()
    env = {"KVTRANSPORT_SECRET": secrets.token_hex(16),
           "VLLM_LOGGING_CONFIG_PATH": _logging_config(tmp_path_factory.mktemp("logcfg") / "logging.json")}
    pre_cfg = connector_config("kv_producer", mode, backend, pre_port)
    pre_cfg["kv_connector_extra_config"]["layerwise_write"] = True
    prefill = harness.vllm_server(f"prefill-{tag}", tiny_model, log_dir, cpu=0, env_extra=env,
                                  kv_transfer_config=pre_cfg)
    decode = harness.vllm_server(f"decode-{tag}", tiny_model, log_dir, cpu=1, env_extra=env,
                                 kv_transfer_config=connector_config("kv_consumer", mode, backend, dec_port))
    proxy = harness.proxy_process(f"proxy-{tag}", log_dir, prefill.url, decode.url,
                                  prefill_timeout_s=60, decode_timeout_s=120,
                                  extra_args=["--flow", "router", "--prefill-side-channel", f"127.0.0.1:{pre_port}",
                                              "--decode-side-channel", f"127.0.0.1:{dec_port}"])
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


def test_layerwise_router_flow_matches_single_engine(layerwise_pair, baseline, vocab_size):
    prefill, decode, proxy = layerwise_pair
    client = prompts.client(proxy.url)
    ps = [p for seed in BASELINE_SEEDS[:2] for p in prompts.router_prompts(vocab_size, seed)]
    mismatches, not_remote = [], []
    for p in ps:
        ext0 = decode.metric("vllm:prompt_tokens_by_source_total", **EXTERNAL)
        got = prompts.complete(client, p)
        remote = decode.metric("vllm:prompt_tokens_by_source_total", **EXTERNAL) - ext0
        if got != baseline[tuple(p)]:
            mismatches.append((len(p), got, baseline[tuple(p)]))
        if len(p) >= BLOCK_SIZE and remote <= 0:
            not_remote.append(len(p))
    layer_posts = prefill.log_path.read_text(errors="replace").count(LAYER_LINE)
    print(f"\n[e2e] layer-wise router flow: {len(ps)} prompts, {layer_posts} layer posts on the prefill engine")
    assert not mismatches, f"layer-wise WRITE output differs from the single engine: {mismatches}"
    assert not not_remote, f"decode engine recomputed instead of loading (prompt lengths): {not_remote}"
    assert layer_posts > 0, "no layer was posted from save_kv_layer: only whole-request writes moved KV"
    for s in (prefill, decode):  # every block handed back (holds ended, loads reported)
        deadline = time.monotonic() + 60
        while s.metric("vllm:kv_cache_usage_perc") != 0 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert s.metric("vllm:kv_cache_usage_perc") == 0, f"{s.name} still uses KV blocks"
