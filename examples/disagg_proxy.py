#!/usr/bin/env python
"""A small prefill/decode disaggregation proxy for vLLM + kvtransport.

Run two vLLM OpenAI-compatible servers with ``KVTransportConnector`` -- one with
``kv_role=kv_producer`` (prefill), one with ``kv_role=kv_consumer`` (decode) --
then put this proxy in front of them.  Clients talk to the proxy exactly as they
would talk to a single vLLM server (``/v1/completions``, ``/v1/chat/completions``).

For every request the proxy does two hops:

1. **Prefill hop.**  The request is sent to a prefill server with
   ``max_tokens=1``, streaming off, and a top-level
   ``kv_transfer_params={"do_remote_decode": true, ...}``.  The prefill engine
   computes the prompt KV, keeps the blocks (under a lease) and answers with the
   ``kv_transfer_params`` the decode side needs to find them.
2. **Decode hop.**  The *original* request is sent to a decode server with the
   ``kv_transfer_params`` taken from the prefill response.  The decode engine
   loads the prompt KV from the prefill engine instead of recomputing it, then
   generates.  Its response (streamed or not) is passed straight back.

The proxy is stateless: everything the decode engine needs travels in
``kv_transfer_params``, so the proxy does not care whether the connector runs
in READ (decode pulls) or WRITE (prefill pushes) mode.

Usage::

    python examples/disagg_proxy.py --port 8000 \
        --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200

Several ``--prefill`` / ``--decode`` URLs may be given; requests are spread
round-robin.  Only the Python standard library and ``aiohttp`` (a vLLM
dependency) are used.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import itertools
import json
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

log = logging.getLogger("disagg_proxy")

#: Sent to the prefill engine: "compute the prompt, keep its KV for a remote decoder".
PREFILL_KV_PARAMS: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False}

#: Request fields that make no sense for the 1-token prefill hop.
_DROP_FOR_PREFILL = ("stream_options", "min_tokens", "max_completion_tokens")


@dataclass
class ProxyConfig:
    prefill_urls: list[str]
    decode_urls: list[str]
    #: Seconds allowed for the prefill hop (prompt computation).  Bounded so a
    #: dead prefill engine turns into a clear 502/504, never a hung client.
    prefill_timeout_s: float = 120.0
    #: Seconds allowed for the whole decode hop.
    decode_timeout_s: float = 600.0
    _prefill_rr: Any = field(init=False, repr=False)
    _decode_rr: Any = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.prefill_urls or not self.decode_urls:
            raise ValueError("need at least one --prefill URL and one --decode URL")
        self.prefill_urls = [u.rstrip("/") for u in self.prefill_urls]
        self.decode_urls = [u.rstrip("/") for u in self.decode_urls]
        self._prefill_rr = itertools.cycle(self.prefill_urls)
        self._decode_rr = itertools.cycle(self.decode_urls)

    def next_prefill(self) -> str:
        return next(self._prefill_rr)

    def next_decode(self) -> str:
        return next(self._decode_rr)


def make_prefill_request(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill hop's body: same prompt and sampling, one token, no streaming."""
    req = copy.deepcopy(body)
    req["max_tokens"] = 1
    req["stream"] = False
    for key in _DROP_FOR_PREFILL:
        req.pop(key, None)
    kv = dict(PREFILL_KV_PARAMS)
    kv.update(body.get("kv_transfer_params") or {})  # a client may add connector options
    req["kv_transfer_params"] = kv
    return req


def make_decode_request(body: dict[str, Any], kv_transfer_params: dict[str, Any]) -> dict[str, Any]:
    """The decode hop's body: the client's request plus where to find the prompt KV."""
    req = copy.deepcopy(body)
    req["kv_transfer_params"] = kv_transfer_params
    return req


def _error(status: int, message: str, kind: str = "proxy_error") -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": kind, "code": status}}, status=status
    )


class DisaggProxy:
    """aiohttp application doing the prefill hop, then the decode hop."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self._session: aiohttp.ClientSession | None = None

    # -- lifecycle -------------------------------------------------------------
    async def _startup(self, app: web.Application) -> None:
        # No total timeout on the session: each hop sets its own.
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None),
            connector=aiohttp.TCPConnector(limit=0),
        )

    async def _cleanup(self, app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/completions", self.handle_generate)
        app.router.add_post("/v1/chat/completions", self.handle_generate)
        app.router.add_get("/health", self.handle_health)
        app.router.add_get("/v1/models", self.handle_models)
        app.on_startup.append(self._startup)
        app.on_cleanup.append(self._cleanup)
        return app

    # -- handlers --------------------------------------------------------------
    async def handle_health(self, request: web.Request) -> web.Response:
        """200 only if every backend server answers its own /health."""
        assert self._session is not None
        bad = []
        for url in self.config.prefill_urls + self.config.decode_urls:
            try:
                async with self._session.get(
                    url + "/health", timeout=aiohttp.ClientTimeout(total=5)
                ) as r:
                    if r.status != 200:
                        bad.append(f"{url}: HTTP {r.status}")
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                bad.append(f"{url}: {type(e).__name__}")
        if bad:
            return _error(503, "unhealthy backends: " + "; ".join(bad), "unhealthy")
        return web.json_response({"status": "ok"})

    async def handle_models(self, request: web.Request) -> web.Response:
        assert self._session is not None
        async with self._session.get(self.config.decode_urls[0] + "/v1/models") as r:
            return web.Response(
                body=await r.read(), status=r.status, content_type="application/json"
            )

    async def handle_generate(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        try:
            body = await request.json()
        except json.JSONDecodeError as e:
            return _error(400, f"request body is not JSON: {e}", "invalid_request_error")
        if not isinstance(body, dict):
            return _error(400, "request body must be a JSON object", "invalid_request_error")

        path = request.path
        # One id for both hops, so logs on both engines can be correlated.
        request_id = request.headers.get("X-Request-Id") or f"disagg-{uuid.uuid4().hex}"
        headers = {"X-Request-Id": request_id}
        if "Authorization" in request.headers:
            headers["Authorization"] = request.headers["Authorization"]

        # ---- prefill hop ----
        prefill_url = self.config.next_prefill()
        try:
            async with self._session.post(
                prefill_url + path,
                json=make_prefill_request(body),
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=self.config.prefill_timeout_s),
            ) as r:
                if r.status != 200:
                    # Pass the engine's own error through (e.g. 400 for a bad prompt).
                    return web.Response(
                        body=await r.read(), status=r.status, content_type="application/json"
                    )
                prefill_resp = await r.json()
        except asyncio.TimeoutError:
            return _error(504, f"prefill server {prefill_url} did not answer in "
                               f"{self.config.prefill_timeout_s:.0f}s", "prefill_timeout")
        except aiohttp.ClientError as e:
            return _error(502, f"prefill server {prefill_url} unreachable: {e}", "prefill_unreachable")

        kv_params = prefill_resp.get("kv_transfer_params")
        if not kv_params:
            return _error(
                502,
                f"prefill server {prefill_url} returned no kv_transfer_params; is it started "
                "with --kv-transfer-config ... \"kv_role\": \"kv_producer\"?",
                "prefill_misconfigured",
            )
        log.debug("%s: prefill on %s -> %s", request_id, prefill_url, kv_params)

        # ---- decode hop ----
        decode_url = self.config.next_decode()
        decode_body = make_decode_request(body, kv_params)
        try:
            async with self._session.post(
                decode_url + path,
                json=decode_body,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=self.config.decode_timeout_s),
            ) as r:
                if not decode_body.get("stream"):
                    return web.Response(
                        body=await r.read(), status=r.status,
                        content_type=r.content_type or "application/json",
                    )
                resp = web.StreamResponse(status=r.status)
                resp.content_type = r.content_type or "text/event-stream"
                await resp.prepare(request)
                async for chunk in r.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
                return resp
        except asyncio.TimeoutError:
            return _error(504, f"decode server {decode_url} did not finish in "
                               f"{self.config.decode_timeout_s:.0f}s", "decode_timeout")
        except aiohttp.ClientError as e:
            return _error(502, f"decode server {decode_url} unreachable: {e}", "decode_unreachable")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--prefill", action="append", required=True, metavar="URL",
                   help="base URL of a kv_producer vLLM server (repeatable)")
    p.add_argument("--decode", action="append", required=True, metavar="URL",
                   help="base URL of a kv_consumer vLLM server (repeatable)")
    p.add_argument("--prefill-timeout", type=float, default=120.0, metavar="S")
    p.add_argument("--decode-timeout", type=float, default=600.0, metavar="S")
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = ProxyConfig(
        prefill_urls=args.prefill, decode_urls=args.decode,
        prefill_timeout_s=args.prefill_timeout, decode_timeout_s=args.decode_timeout,
    )
    log.info("proxy on http://%s:%d  prefill=%s  decode=%s",
             args.host, args.port, config.prefill_urls, config.decode_urls)
    web.run_app(DisaggProxy(config).app(), host=args.host, port=args.port,
                print=None, access_log=None)


if __name__ == "__main__":
    main()
