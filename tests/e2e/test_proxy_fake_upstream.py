"""The example proxy's own logic against FAKE upstream servers (no vLLM; seconds to run).

The fakes are tiny aiohttp apps that record what they receive and answer like a
vLLM server would. They test only the proxy's glue: what goes to the prefill and
decode hops, streaming pass-through, and the error paths. The real engines are
exercised in test_disagg.py.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys

import aiohttp
import pytest
from aiohttp import web

from .harness import REPO, free_port

_spec = importlib.util.spec_from_file_location("disagg_proxy", REPO / "examples" / "disagg_proxy.py")
disagg_proxy = importlib.util.module_from_spec(_spec)
sys.modules["disagg_proxy"] = disagg_proxy  # dataclasses look their module up here
_spec.loader.exec_module(disagg_proxy)

KV = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 5600,
      "remote_block_ids": [3, 4], "transfer_id": "t-1"}


class FakeEngine:
    """Records request bodies; answers /v1/completions like a vLLM server."""

    def __init__(self, role: str, kv_params: dict | None = KV, status: int = 200) -> None:
        self.role, self.kv_params, self.status = role, kv_params, status
        self.bodies: list[dict] = []
        self.headers: list[dict] = []

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.headers.append({k.lower(): v for k, v in request.headers.items()})
        if self.status != 200:
            return web.json_response({"error": {"message": "bad prompt"}}, status=self.status)
        if body.get("stream"):
            resp = web.StreamResponse()
            resp.content_type = "text/event-stream"
            await resp.prepare(request)
            for tok in ("a", "b", "c"):
                await resp.write(f"data: {json.dumps({'choices': [{'text': tok}]})}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            return resp
        out = {"choices": [{"text": f"{self.role}-text", "finish_reason": "length"}]}
        out["kv_transfer_params"] = self.kv_params if self.role == "prefill" else None
        return web.json_response(out)

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.completions)
        app.router.add_get("/health", self.health)
        return app


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


def run_with(prefill: FakeEngine | None, decode: FakeEngine, scenario, **cfg):
    """Start fake engines + the proxy in this event loop, run ``scenario(session, proxy_url)``."""

    async def main():
        runners = []
        try:
            if prefill is not None:
                r, pre_url = await _serve(prefill.app())
                runners.append(r)
            else:
                pre_url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
            r, dec_url = await _serve(decode.app())
            runners.append(r)
            proxy = disagg_proxy.DisaggProxy(disagg_proxy.ProxyConfig([pre_url], [dec_url], **cfg))
            r, proxy_url = await _serve(proxy.app())
            runners.insert(0, r)
            async with aiohttp.ClientSession() as s:
                return await scenario(s, proxy_url)
        finally:
            for r in runners:
                await r.cleanup()

    return asyncio.run(main())


def test_fake_upstream_two_hops_carry_kv_transfer_params():
    pre, dec = FakeEngine("prefill"), FakeEngine("decode")
    req = {"model": "m", "prompt": "hi", "max_tokens": 9, "temperature": 0, "stream_options": {"x": 1}}

    async def scenario(s, url):
        async with s.post(url + "/v1/completions", json=req) as r:
            return r.status, await r.json()

    status, body = run_with(pre, dec, scenario)
    assert status == 200 and body["choices"][0]["text"] == "decode-text"
    # Prefill hop: one token, no stream, asks the producer to keep the KV.
    (p,) = pre.bodies
    assert p["max_tokens"] == 1 and p["stream"] is False and "stream_options" not in p
    assert p["kv_transfer_params"]["do_remote_decode"] is True
    assert p["prompt"] == "hi"
    # Decode hop: the client's request unchanged, plus the producer's answer.
    (d,) = dec.bodies
    assert d["max_tokens"] == 9 and d["kv_transfer_params"] == KV
    # Both hops share one request id, so the two engines' logs can be joined.
    assert pre.headers[0]["x-request-id"] == dec.headers[0]["x-request-id"]


def test_fake_upstream_chat_and_streaming_pass_through():
    pre, dec = FakeEngine("prefill"), FakeEngine("decode")

    async def scenario(s, url):
        async with s.post(url + "/v1/chat/completions",
                          json={"model": "m", "messages": [], "stream": True}) as r:
            return r.status, r.content_type, await r.text()

    status, ctype, text = run_with(pre, dec, scenario)
    assert status == 200 and ctype == "text/event-stream"
    assert text.count("data:") == 4 and text.endswith("data: [DONE]\n\n")
    assert pre.bodies[0]["stream"] is False and dec.bodies[0]["stream"] is True


def test_fake_upstream_prefill_unreachable_is_502():
    dec = FakeEngine("decode")

    async def scenario(s, url):
        async with s.post(url + "/v1/completions", json={"model": "m", "prompt": "x"}) as r:
            return r.status, await r.json()

    status, body = run_with(None, dec, scenario)
    assert status == 502 and body["error"]["type"] == "prefill_unreachable"
    assert not dec.bodies  # never reaches decode without KV


def test_fake_upstream_prefill_without_connector_is_502_with_hint():
    pre, dec = FakeEngine("prefill", kv_params=None), FakeEngine("decode")

    async def scenario(s, url):
        async with s.post(url + "/v1/completions", json={"model": "m", "prompt": "x"}) as r:
            return r.status, await r.json()

    status, body = run_with(pre, dec, scenario)
    assert status == 502 and "kv_producer" in body["error"]["message"]
    assert not dec.bodies


def test_fake_upstream_engine_error_passes_through():
    pre, dec = FakeEngine("prefill", status=400), FakeEngine("decode")

    async def scenario(s, url):
        async with s.post(url + "/v1/completions", json={"model": "m", "prompt": "x"}) as r:
            return r.status, await r.json()

    status, body = run_with(pre, dec, scenario)
    assert status == 400 and body["error"]["message"] == "bad prompt"


@pytest.mark.parametrize("payload", [b"not json", b"[1, 2]"])
def test_fake_upstream_bad_request_body_is_400(payload):
    pre, dec = FakeEngine("prefill"), FakeEngine("decode")

    async def scenario(s, url):
        async with s.post(url + "/v1/completions", data=payload,
                          headers={"content-type": "application/json"}) as r:
            return r.status, await r.json()

    status, body = run_with(pre, dec, scenario)
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    assert not pre.bodies


def test_proxy_config_needs_both_sides():
    with pytest.raises(ValueError, match="--prefill"):
        disagg_proxy.ProxyConfig([], ["http://x"])
