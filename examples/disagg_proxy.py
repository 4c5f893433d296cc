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

**Router flow** (``--flow router``, opt-in; WRITE mode only).  Both hops leave
at the same time, with one MoRIIO-style compound ``X-Request-Id`` naming both
engines' side channels and a fresh 32-hex uuid::

    <id>___prefill_addr_host:H,handshake:P,notify:P___decode_addr_host:H,handshake:D,notify:D_<uuid>

The prefill hop is the same as above; the decode hop carries only
``kv_transfer_params={"do_remote_prefill": true}``.  The decode engine finds the
prefill engine's side channel and the transfer key in the id, sends it its block
ids, and the prefill engine writes the KV into them as soon as its prefill is
done, so the decode engine need not wait for the prefill's HTTP answer
(docs/VLLM.md, Routers).  The decode response is passed through as soon as it
comes; if the prefill hop fails, the decode engine learns it from the prefill
engine ("aborted") or by its ``transfer_timeout_s``, and its
``kv_load_failure_policy`` decides (recompute, or an error the proxy passes
through).  READ mode cannot work this way (the decode engine needs the
prefill's block ids, which exist only once the prefill has answered): when a
prefill answer says ``kvtransport_mode: read`` the proxy refuses that request if
it can still (502) and every later one, with a message saying so, and its
``/health`` answers 503 with that message.  The
side-channel addresses are given per engine, in the order of the URLs::

    python examples/disagg_proxy.py --port 8000 --flow router \
        --prefill http://127.0.0.1:8100 --prefill-side-channel 127.0.0.1:5600 \
        --decode http://127.0.0.1:8200 --decode-side-channel 127.0.0.1:5700

Usage::

    python examples/disagg_proxy.py --port 8000 \
        --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200

Several ``--prefill`` / ``--decode`` URLs may be given; requests are spread
round-robin over the (prefill, decode) pairs so that consecutive requests
alternate engines on both sides and every prefill engine feeds every decode
engine (with 2 and 2: P0->D0, P1->D1, P0->D1, P1->D0, then again).  Only the
Python standard library and ``aiohttp`` (a vLLM dependency) are used.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import itertools
import json
import logging
import math
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

log = logging.getLogger("disagg_proxy")

#: Sent to the prefill engine: "compute the prompt, keep its KV for a remote decoder".
PREFILL_KV_PARAMS: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False}

#: Sent to the decode engine in the router flow: "load the prompt KV from the prefill engine
#: named in the request id" (WRITE mode: it will be pushed into this engine's blocks).
ROUTER_DECODE_KV_PARAMS: dict[str, Any] = {"do_remote_prefill": True}

FLOWS = ("two-hop", "router")

#: Request fields that make no sense for the 1-token prefill hop.
_DROP_FOR_PREFILL = ("stream_options", "min_tokens", "max_completion_tokens")


def parse_side_channel(text: str, flag: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) -> (host, port); ValueError naming ``flag``."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{flag} {text!r}: expected HOST:PORT (the engine's side_channel_host and "
                         "side_channel_port)")
    return host, int(port)


@dataclass
class ProxyConfig:
    prefill_urls: list[str]
    decode_urls: list[str]
    #: Seconds allowed for the prefill hop (prompt computation).  Bounded so a
    #: dead prefill engine turns into a clear 502/504, never a hung client.
    prefill_timeout_s: float = 120.0
    #: Seconds allowed for the whole decode hop.
    decode_timeout_s: float = 600.0
    #: "two-hop" (prefill, then decode with its answer) or "router" (both at once).
    flow: str = "two-hop"
    #: Router flow: each prefill / decode engine's side channel, ``HOST:PORT``, in
    #: the order of the URLs.
    prefill_side_channels: list[str] = field(default_factory=list)
    decode_side_channels: list[str] = field(default_factory=list)
    #: "wait" (the first token comes from the decode engine) or "handover" (from the prefill's answer)
    first_token: str = "wait"
    _prefill_rr: Any = field(init=False, repr=False)
    _decode_rr: Any = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.prefill_urls or not self.decode_urls:
            raise ValueError("need at least one --prefill URL and one --decode URL")
        if self.flow not in FLOWS:
            raise ValueError(f"--flow {self.flow!r}: expected one of {', '.join(FLOWS)}")
        if self.first_token not in ("wait", "handover"):
            raise ValueError(f"--first-token {self.first_token!r}: expected wait or handover")
        if self.first_token == "handover" and self.flow == "router":
            raise ValueError("--first-token handover needs the two-hop flow: the router flow does not wait for "
                             "the prefill's answer, which carries the first token")
        self.prefill_urls = [u.rstrip("/") for u in self.prefill_urls]
        self.decode_urls = [u.rstrip("/") for u in self.decode_urls]
        pre_sc = [parse_side_channel(t, "--prefill-side-channel") for t in self.prefill_side_channels]
        dec_sc = [parse_side_channel(t, "--decode-side-channel") for t in self.decode_side_channels]
        if self.flow == "router":
            for flag, urls, scs in (("prefill", self.prefill_urls, pre_sc), ("decode", self.decode_urls, dec_sc)):
                if len(scs) != len(urls):
                    raise ValueError(
                        f"--flow router needs one --{flag}-side-channel HOST:PORT per --{flag} URL, in the "
                        f"same order (the engine's side_channel_host and side_channel_port: the decode engine "
                        f"finds the prefill engine through them): got {len(urls)} URL(s) and {len(scs)} "
                        "side channel(s)")
        elif pre_sc or dec_sc:
            raise ValueError("--prefill-side-channel / --decode-side-channel are used only by --flow router")
        # round-robin over (URL, side channel) pairs of both sides; two-hop: no side channel
        prefills = list(zip(self.prefill_urls, pre_sc or [None] * len(self.prefill_urls)))
        decodes = list(zip(self.decode_urls, dec_sc or [None] * len(self.decode_urls)))
        self._pairs = itertools.cycle([(prefills[p], decodes[d]) for p, d in pair_order(len(prefills), len(decodes))])

    def next_pair(self) -> tuple[tuple[str, Any], tuple[str, Any]]:
        """The next ((prefill URL, its side channel), (decode URL, its side channel)); the
        side channels are None in the two-hop flow."""
        return next(self._pairs)

    def next_router_pair(self) -> tuple[tuple[str, tuple[str, int]], tuple[str, tuple[str, int]]]:
        """Router flow: ((prefill URL, its side channel), (decode URL, its side channel))."""
        return self.next_pair()


def pair_order(n_prefill: int, n_decode: int) -> list[tuple[int, int]]:
    """One round of (prefill, decode) index pairs: every pair exactly once, the prefill
    index advancing by one each request and the decode index too (two independent
    round-robins of 2 and 2 would pair P0 with D0 and P1 with D1 forever). Step s takes
    prefill s mod P and decode (s + s // lcm(P, D)) mod D: within each run of lcm(P, D)
    steps the pairs differ, and each run shifts the decode side by one more, which
    reaches the gcd(P, D) pairings a plain lockstep never meets."""
    run = math.lcm(n_prefill, n_decode)
    return [(s % n_prefill, (s + s // run) % n_decode) for s in range(n_prefill * n_decode)]


def router_request_id(base: str, prefill: tuple[str, int], decode: tuple[str, int]) -> str:
    """The compound id both hops carry (kvtransport_vllm.routing parses it on both engines):
    both side channels and a fresh uuid, the key the two engines agree on. ``base`` (the
    client's id, if any) is kept, reduced to characters that cannot confuse the parser."""
    addr = lambda hp: f"host:{hp[0]},handshake:{hp[1]},notify:{hp[1]}"  # noqa: E731
    base = re.sub(r"[^A-Za-z0-9.-]", "-", base)[:64] or "disagg"
    return f"{base}___prefill_addr_{addr(prefill)}___decode_addr_{addr(decode)}_{uuid.uuid4().hex}"


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


# -- first-token hand-over (``--first-token handover``) --------------------------------
# Why: the prefill engine has already sampled the first token when it answers the prefill
# hop. Without a hand-over the client also waits for the decode engine to load the prompt's
# KV and run a step before it sees any token. With it, the proxy sends the prefill's first
# token at once (the first streamed event) and asks the decode engine to continue from
# prompt + first token: it loads the prompt's KV (the prefill's kv_transfer_params name
# the prompt's blocks and tokens), computes the first token's KV itself and samples the
# second. Under greedy sampling the tokens are one engine's; the time to first token is
# the prefill's. Only requests whose two answers need no token-by-token merge qualify
# (handover_refusal); the others take the ordinary two hops.
HANDOVER_PATH = "/v1/completions"
#: request fields the hand-over cannot honour across two answers
_UNSUPPORTED = ("echo", "logprobs", "best_of", "stop", "min_tokens", "prompt_logprobs")


def handover_refusal(path: str, body: dict[str, Any]) -> str:
    """Why this request takes the ordinary two hops ("" when it is handed over)."""
    if path != HANDOVER_PATH:
        return f"{path}: only {HANDOVER_PATH} is handed over"
    prompt = body.get("prompt")
    one = isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt))
    if not one:
        return "not one prompt"
    if int(body.get("n") or 1) != 1:
        return "n > 1"
    if any(body.get(k) not in (None, False, [], "") for k in _UNSUPPORTED):
        return "echo / logprobs / best_of / stop / min_tokens given"
    if int(body.get("max_tokens") or 16) < 2:
        return "max_tokens < 2: the prefill's answer is the whole answer"
    return ""


def handover_prefill_request(base: dict[str, Any]) -> dict[str, Any]:
    """The prefill hop (already made by the proxy) asking for the token ids too."""
    req = copy.deepcopy(base)
    req["return_token_ids"] = True
    return req


def first_token_of(prefill_answer: dict[str, Any]) -> tuple[list[int], int, str, str | None]:
    """(prompt token ids, first token id, its text, its finish reason) from the prefill's
    answer; ValueError when the engine did not return the token ids."""
    choice = (prefill_answer.get("choices") or [{}])[0]
    prompt_ids = choice.get("prompt_token_ids") or prefill_answer.get("prompt_token_ids")
    ids = choice.get("token_ids")
    if not prompt_ids or not ids:
        raise ValueError("the prefill engine returned no prompt_token_ids / token_ids (return_token_ids): a vLLM "
                         "that does not support it cannot hand the first token over")
    return list(prompt_ids), int(ids[0]), str(choice.get("text") or ""), choice.get("finish_reason")


def continuation_request(body: dict[str, Any], prompt_ids: list[int], first: int,
                         kv_transfer_params: dict[str, Any]) -> dict[str, Any]:
    """The decode hop: prompt + first token, one token fewer to generate, and the prefill's
    kv_transfer_params (the prompt's KV)."""
    req = copy.deepcopy(body)
    req["prompt"] = [*prompt_ids, first]
    req["max_tokens"] = int(body.get("max_tokens") or 16) - 1
    req["kv_transfer_params"] = kv_transfer_params
    return req


def first_token_event(prefill_answer: dict[str, Any], text: str, token: int, finish_reason: str | None,
                      with_ids: bool) -> bytes:
    """The first server-sent event of a streamed answer: the first token (its id too when
    the client asked for token ids)."""
    choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    if with_ids:
        choice["token_ids"] = [token]
    event = {"id": prefill_answer.get("id"), "object": "text_completion", "created": prefill_answer.get("created"),
             "model": prefill_answer.get("model"), "choices": [choice]}
    return b"data: " + json.dumps(event).encode() + b"\n\n"


def with_first_token(prefill_answer: dict[str, Any], decode_answer: dict[str, Any], text: str,
                     token: int) -> dict[str, Any]:
    """A non-streamed answer: the decode's, with the first token in front."""
    out = copy.deepcopy(decode_answer)
    choice = out["choices"][0]
    choice["text"] = text + str(choice.get("text") or "")
    if choice.get("token_ids") is not None:
        choice["token_ids"] = [token, *choice["token_ids"]]
    if isinstance(choice.get("prompt_token_ids"), list):
        choice["prompt_token_ids"] = choice["prompt_token_ids"][:-1]  # the client's prompt, not + first token
    usage = out.get("usage")
    if isinstance(usage, dict):
        usage["prompt_tokens"] = max(0, int(usage.get("prompt_tokens") or 0) - 1)
        usage["completion_tokens"] = int(usage.get("completion_tokens") or 0) + 1
    out["id"] = prefill_answer.get("id", out.get("id"))
    return out


#: Marks the proxy's own error responses (not an engine's) with their kind.
PROXY_ERROR = web.ResponseKey("proxy_error", str) if hasattr(web, "ResponseKey") else "proxy_error"


def _error(status: int, message: str, kind: str = "proxy_error") -> web.Response:
    resp = web.json_response(
        {"error": {"message": message, "type": kind, "code": status}}, status=status
    )
    resp[PROXY_ERROR] = kind
    return resp


#: How long an idle connection to an engine is kept for reuse. vLLM's servers close one after
#: ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE`` (5 s by default); a client that keeps it as long or longer
#: can send a request on a connection the server is closing at that moment, and the request
#: fails with "server disconnected" although both ends are healthy. Well under 5 s, the
#: server never closes a connection the proxy may still pick.
UPSTREAM_KEEPALIVE_S = 2.0

READ_MODE_REFUSAL = (
    "the prefill engine runs KVTransportConnector in READ mode (its kv_transfer_params say "
    "kvtransport_mode: read); --flow router needs WRITE mode on both engines (mode: write): "
    "in READ mode the decode engine needs the prefill's block ids, which exist only after the "
    "prefill has answered. Restart the proxy without --flow router, or the engines with mode write."
)


class DisaggProxy:
    """aiohttp application doing the prefill hop, then the decode hop (or, with
    ``flow="router"``, both at once)."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self._session: aiohttp.ClientSession | None = None
        #: router flow: set once a prefill engine turned out to run READ mode
        self.router_refusal: str | None = None
        #: router flow: prefill hops still running after their decode hop answered
        self._background: set[asyncio.Task] = set()

    # -- lifecycle -------------------------------------------------------------
    async def _startup(self, app: web.Application) -> None:
        # No total timeout on the session: each hop sets its own.
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None),
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=UPSTREAM_KEEPALIVE_S),
        )

    async def _cleanup(self, app: web.Application) -> None:
        for t in list(self._background):
            t.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
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
        """200 only if every backend server answers its own /health; 503 too once the
        router flow found a READ-mode prefill engine (every request is refused then)."""
        assert self._session is not None
        if self.router_refusal:
            return _error(503, self.router_refusal, "router_flow_needs_write_mode")
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
        if self.config.flow == "router":
            return await self._router_flow(request, path, body, request_id, headers)

        # ---- prefill hop ----
        (prefill_url, _), (decode_url, _) = self.config.next_pair()
        handing_over = self.config.first_token == "handover" and not handover_refusal(path, body)
        prefill_body = make_prefill_request(body)
        try:
            async with self._session.post(
                prefill_url + path,
                json=handover_prefill_request(prefill_body) if handing_over else prefill_body,
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

        if handing_over:
            return await self._hand_over(request, decode_url + path, body, prefill_resp, kv_params, headers)
        # ---- decode hop ----
        return await self._decode_hop(request, decode_url + path, make_decode_request(body, kv_params), headers)

    async def _hand_over(self, request: web.Request, url: str, body: dict[str, Any], prefill_resp: dict[str, Any],
                         kv_params: dict[str, Any], headers: dict[str, str]) -> web.StreamResponse:
        """The first token from the prefill's answer, the rest from the decode engine
        continuing from prompt + first token (module section "first-token hand-over")."""
        try:
            prompt_ids, first, text, finished = first_token_of(prefill_resp)
        except ValueError as e:
            return _error(502, str(e), "prefill_misconfigured")
        cont = continuation_request(body, prompt_ids, first, kv_params)
        finished = finished if finished == "stop" else None  # "length" is the prefill hop's own max_tokens=1
        if finished:  # the first token ends the answer (EOS): the decode hop only frees the prefill's blocks
            cont.update(max_tokens=1, stream=False)
            task = asyncio.ensure_future(self._decode_hop(request, url, cont, headers))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
            answer = copy.deepcopy(prefill_resp)
            answer.pop("kv_transfer_params", None)
            if not body.get("stream"):
                return web.json_response(answer)
        if not body.get("stream"):
            resp = await self._decode_hop(request, url, cont, headers)
            if resp.status != 200 or not isinstance(resp, web.Response) or resp.body is None:
                return resp
            merged = with_first_token(prefill_resp, json.loads(bytes(resp.body)), text, first)
            return web.json_response(merged)
        out = web.StreamResponse(status=200)
        out.content_type = "text/event-stream"
        await out.prepare(request)
        await out.write(first_token_event(prefill_resp, text, first, finished, bool(body.get("return_token_ids"))))
        if finished:
            await out.write(b"data: [DONE]\n\n")
        else:
            await self._decode_hop(request, url, cont, headers, relay_to=out)
        await out.write_eof()
        return out

    async def _decode_hop(self, request: web.Request, url: str, decode_body: dict[str, Any],
                          headers: dict[str, str], before_relay: Any = None,
                          relay_to: web.StreamResponse | None = None) -> web.StreamResponse:
        """Send the decode hop and pass its answer through (streamed or not).
        ``before_relay()``, when given, may return an error response to send instead
        (router flow: the prefill turned out to run READ mode); ``relay_to``: a streamed
        answer already started (the first-token hand-over) the decode's events go on."""
        assert self._session is not None
        try:
            async with self._session.post(
                url,
                json=decode_body,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=self.config.decode_timeout_s),
            ) as r:
                if not decode_body.get("stream"):
                    data = await r.read()
                    refused = before_relay() if before_relay else None
                    return refused or web.Response(
                        body=data, status=r.status,
                        content_type=r.content_type or "application/json",
                    )
                refused = before_relay() if before_relay else None
                if refused is not None:
                    return refused
                if relay_to is not None:
                    async for chunk in r.content.iter_any():
                        await relay_to.write(chunk)
                    return relay_to
                resp = web.StreamResponse(status=r.status)
                resp.content_type = r.content_type or "text/event-stream"
                await resp.prepare(request)
                async for chunk in r.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
                return resp
        except asyncio.TimeoutError:
            return _error(504, f"decode server {url} did not finish in "
                               f"{self.config.decode_timeout_s:.0f}s", "decode_timeout")
        except aiohttp.ClientError as e:
            return _error(502, f"decode server {url} unreachable: {e}", "decode_unreachable")

    # -- router flow -------------------------------------------------------------
    async def _router_flow(self, request: web.Request, path: str, body: dict[str, Any],
                           request_id: str, headers: dict[str, str]) -> web.StreamResponse:
        """Both hops at once, one compound id; the decode answer is passed through."""
        if self.router_refusal:
            return _error(502, self.router_refusal, "router_flow_needs_write_mode")
        (prefill_url, prefill_sc), (decode_url, decode_sc) = self.config.next_router_pair()
        rid = router_request_id(request_id, prefill_sc, decode_sc)
        hdrs = dict(headers, **{"X-Request-Id": rid})
        prefill = asyncio.ensure_future(self._router_prefill(prefill_url + path, make_prefill_request(body), hdrs))
        decode_body = copy.deepcopy(body)
        decode_body["kv_transfer_params"] = dict(ROUTER_DECODE_KV_PARAMS)

        def refused() -> web.Response | None:
            # the prefill has answered that it runs READ mode: this decode answer (a
            # refused load, recomputed or failed per policy) is not what was asked for
            if self.router_refusal and prefill.done():
                return _error(502, self.router_refusal, "router_flow_needs_write_mode")
            return None

        try:
            resp = await self._decode_hop(request, decode_url + path, decode_body, hdrs, refused)
        except BaseException:
            prefill.cancel()  # the client went away: abort the prefill too
            raise
        if not prefill.done():
            if str(resp.get(PROXY_ERROR, "")).startswith("decode_"):
                # the decode engine never answered: abort the prefill (its engine frees the blocks)
                prefill.cancel()
            else:
                # normally done by now; else let it finish on its own (its hold ends when the
                # decode engine releases it or the lease lapses)
                self._background.add(prefill)
                prefill.add_done_callback(self._background.discard)
        return resp

    async def drain(self) -> None:
        """Wait for the router flow's prefill hops still running after their decode hop."""
        await asyncio.gather(*list(self._background), return_exceptions=True)

    async def _router_prefill(self, url: str, prefill_body: dict[str, Any], headers: dict[str, str]) -> None:
        """The router flow's prefill hop: its answer is not needed, only checked. A failure
        is logged: the decode engine learns of it from the prefill engine or its deadline."""
        assert self._session is not None
        try:
            async with self._session.post(
                url, json=prefill_body, headers=headers,
                timeout=aiohttp.ClientTimeout(total=self.config.prefill_timeout_s),
            ) as r:
                if r.status != 200:
                    log.warning("%s: prefill hop on %s answered HTTP %d: %s", headers["X-Request-Id"], url,
                                r.status, (await r.text())[:300])
                    return
                kv = (await r.json()).get("kv_transfer_params") or {}
        except (asyncio.TimeoutError, aiohttp.ClientError) as e:
            log.warning("%s: prefill hop on %s failed: %s", headers["X-Request-Id"], url, type(e).__name__)
            return
        if kv.get("kvtransport_mode") == "read" and not self.router_refusal:
            self.router_refusal = READ_MODE_REFUSAL
            log.error("%s: %s", url, READ_MODE_REFUSAL)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--prefill", action="append", required=True, metavar="URL",
                   help="base URL of a kv_producer vLLM server (repeatable)")
    p.add_argument("--decode", action="append", required=True, metavar="URL",
                   help="base URL of a kv_consumer vLLM server (repeatable)")
    p.add_argument("--flow", choices=FLOWS, default="two-hop",
                   help="two-hop (default): prefill, then decode with the prefill's kv_transfer_params; "
                        "router: both at once with a compound request id (KVTransportConnector WRITE mode only; "
                        "needs the side-channel flags below)")
    p.add_argument("--prefill-side-channel", action="append", default=[], metavar="HOST:PORT",
                   help="--flow router: side_channel_host:side_channel_port of each --prefill engine, same order")
    p.add_argument("--decode-side-channel", action="append", default=[], metavar="HOST:PORT",
                   help="--flow router: side_channel_host:side_channel_port of each --decode engine, same order")
    p.add_argument("--first-token", choices=("wait", "handover"), default="wait",
                   help="handover: stream the prefill's first token at once, the decode engine continues from "
                        "prompt + first token (/v1/completions, one prompt)")
    p.add_argument("--prefill-timeout", type=float, default=120.0, metavar="S")
    p.add_argument("--decode-timeout", type=float, default=600.0, metavar="S")
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


def make_config(args: argparse.Namespace) -> ProxyConfig:
    return ProxyConfig(
        prefill_urls=args.prefill, decode_urls=args.decode,
        prefill_timeout_s=args.prefill_timeout, decode_timeout_s=args.decode_timeout,
        flow=args.flow, prefill_side_channels=args.prefill_side_channel,
        decode_side_channels=args.decode_side_channel, first_token=args.first_token,
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = make_config(args)
    except ValueError as e:
        raise SystemExit(f"disagg_proxy: {e}") from None
    log.info("proxy on http://%s:%d  flow=%s  prefill=%s  decode=%s", args.host, args.port,
             config.flow, config.prefill_urls, config.decode_urls)
    web.run_app(DisaggProxy(config).app(), host=args.host, port=args.port,
                print=None, access_log=None)


if __name__ == "__main__":
    main()
