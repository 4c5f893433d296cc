r"""Layer-wise WRITE end to end: two real vLLM CPU engines, the prefill engine with
``layerwise_write``.

vLLM's ``maybe_transfer_kv_layer`` wraps the attention op on CPU too, so the connector's
``save_kv_layer`` runs after each layer's real attention; the prefill engine posts each
layer's completed blocks from there when the decode's block ids arrived first.

* Behind ``disagg_proxy.py --flow router`` (both hops at once): greedy tokens equal the
  single engine's and the decode engine took the prompt KV from the prefill engine.
  Which hop reaches its engine first is a race there, so layer posts are only counted.
* The same two hops with the decode hop first, the prefill hop sent once the prefill
  engine has logged that it kept the decode's destination: the order layer-wise WRITE
  is for, made certain. Tokens equal, and the prefill engine's log shows layer posts (the
  hooks ran and the layer-wise path, not only the whole-request one, moved KV).

Both engines end with no KV block in use.

Run: ``KVT_E2E_BACKENDS=loopback python -m pytest tests/e2e/test_layerwise_write.py -q``.
"""

from __future__ import annotations

import json
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

from kvtransport.testing.required import skip_unless_usable

from . import harness, prompts
from .conftest import _LIVE, BASELINE_SEEDS, connector_config
from .harness import BLOCK_SIZE

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

EXTERNAL = {"source": "external_kv_transfer"}
LAYER_LINE = "layer-wise WRITE "
KEPT_LINE = "came before its prefill: destination kept"

disagg_proxy = harness.disagg_proxy_module()


@dataclass
class Pair:
    prefill: harness.VllmServer
    decode: harness.VllmServer
    proxy: harness.VllmServer
    prefill_side_channel: tuple[str, int]
    decode_side_channel: tuple[str, int]


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
        yield Pair(prefill, decode, proxy, ("127.0.0.1", pre_port), ("127.0.0.1", dec_port))
    finally:
        for s in procs:
            s.stop()
            _LIVE.remove(s)


def _no_block_in_use(*servers: harness.VllmServer) -> None:
    for s in servers:  # every block handed back (holds ended, loads reported)
        deadline = time.monotonic() + 60
        while s.metric("vllm:kv_cache_usage_perc") != 0 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert s.metric("vllm:kv_cache_usage_perc") == 0, f"{s.name} still uses KV blocks"


def _layer_posts(s: harness.VllmServer) -> int:
    return s.log_path.read_text(errors="replace").count(LAYER_LINE)


def test_layerwise_router_flow_matches_single_engine(layerwise_pair, baseline, vocab_size):
    pair = layerwise_pair
    client = prompts.client(pair.proxy.url)
    ps = [p for seed in BASELINE_SEEDS[:2] for p in prompts.router_prompts(vocab_size, seed)]
    mismatches, not_remote = [], []
    posts0 = _layer_posts(pair.prefill)
    for p in ps:
        ext0 = pair.decode.metric("vllm:prompt_tokens_by_source_total", **EXTERNAL)
        got = prompts.complete(client, p)
        remote = pair.decode.metric("vllm:prompt_tokens_by_source_total", **EXTERNAL) - ext0
        if got != baseline[tuple(p)]:
            mismatches.append((len(p), got, baseline[tuple(p)]))
        if len(p) >= BLOCK_SIZE and remote <= 0:
            not_remote.append(len(p))
    print(f"\n[e2e] layer-wise router flow: {len(ps)} prompts, {_layer_posts(pair.prefill) - posts0} layer "
          "posts on the prefill engine (the hops race: any number is right)")
    assert not mismatches, f"layer-wise WRITE output differs from the single engine: {mismatches}"
    assert not not_remote, f"decode engine recomputed instead of loading (prompt lengths): {not_remote}"
    _no_block_in_use(pair.prefill, pair.decode)


def _wait_for_kept_destination(prefill: harness.VllmServer, router_uuid: str, timeout_s: float = 60) -> None:
    """Until the prefill engine logs that the decode's write request for this request came
    first and its destination is kept (the side channel answered it "pending")."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(KEPT_LINE in ln and router_uuid in ln
               for ln in prefill.log_path.read_text(errors="replace").splitlines()):
            return
        time.sleep(0.1)
    raise AssertionError(f"the prefill engine never logged the decode's write request for {router_uuid} "
                         f"(log {prefill.log_path})")


def test_layerwise_posts_when_decode_block_ids_come_first(layerwise_pair, baseline, vocab_size):
    pair = layerwise_pair
    pre_client, dec_client = prompts.client(pair.prefill.url), prompts.client(pair.decode.url)
    # prompts this pair has not seen (its prefix caches cannot hide a load), each of whole blocks
    ps = [p for p in prompts.router_concurrent_prompts(vocab_size, BASELINE_SEEDS[0]) if len(p) >= BLOCK_SIZE][:4]
    assert ps, "no prompt of a whole block in the set"
    posts0 = _layer_posts(pair.prefill)
    mismatches, not_remote = [], []
    with ThreadPoolExecutor(1) as pool:
        for p in ps:
            rid = disagg_proxy.router_request_id("layerwise", pair.prefill_side_channel, pair.decode_side_channel)
            hdrs = {"X-Request-Id": rid}
            ext0 = pair.decode.metric("vllm:prompt_tokens_by_source_total", **EXTERNAL)
            decode_hop = pool.submit(
                dec_client.completions.create, model="tiny", prompt=p, max_tokens=prompts.MAX_TOKENS,
                temperature=0.0, extra_headers=hdrs,
                extra_body=dict(prompts.GREEDY["extra_body"], kv_transfer_params=disagg_proxy.ROUTER_DECODE_KV_PARAMS))
            _wait_for_kept_destination(pair.prefill, rid.rsplit("_", 1)[1])
            pre_client.completions.create(model="tiny", prompt=p, max_tokens=1, temperature=0.0, extra_headers=hdrs,
                                          extra_body={"kv_transfer_params": disagg_proxy.PREFILL_KV_PARAMS})
            got = prompts.completion_ids(decode_hop.result(timeout=120))
            if got != baseline[tuple(p)]:
                mismatches.append((len(p), got, baseline[tuple(p)]))
            if pair.decode.metric("vllm:prompt_tokens_by_source_total", **EXTERNAL) - ext0 <= 0:
                not_remote.append(len(p))
    posts = _layer_posts(pair.prefill) - posts0
    print(f"\n[e2e] layer-wise, decode hop first: {len(ps)} prompts, {posts} layer posts on the prefill engine")
    assert not mismatches, f"layer-wise WRITE output differs from the single engine: {mismatches}"
    assert not not_remote, f"decode engine recomputed instead of loading (prompt lengths): {not_remote}"
    assert posts > 0, "no layer was posted from save_kv_layer: only whole-request writes moved KV"
    _no_block_in_use(pair.prefill, pair.decode)
