"""The example proxy's own logic against FAKE upstream servers (no vLLM; seconds to run).

The fakes are tiny aiohttp apps that record what they receive and answer like a
vLLM server would. They test only the proxy's glue: what goes to the prefill and
decode hops, streaming pass-through, and the error paths. The real engines are
exercised in test_disagg.py.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web

from .harness import disagg_proxy_module, free_port

disagg_proxy = disagg_proxy_module()

KV = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 5600,
      "remote_block_ids": [3, 4], "transfer_id": "t-1"}


class FakeEngine:
    """Records request bodies; answers /v1/completions like a vLLM server."""

    def __init__(self, role: str, kv_params: dict | None = KV, status: int = 200) -> None:
        self.role, self.kv_params, self.status = role, kv_params, status
        self.bodies: list[dict] = []
        self.headers: list[dict] = []
        #: (host, port) the proxy connected from, per request: a new port is a new connection
        self.peers: list[tuple] = []
        #: set when a request has arrived (router flow: the other hop may wait for it)
        self.arrived = asyncio.Event()
        #: awaited before answering (router flow: answer only once the other hop arrived)
        self.wait_for: asyncio.Event | None = None

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.headers.append({k.lower(): v for k, v in request.headers.items()})
        self.peers.append(request.transport.get_extra_info("peername"))
        self.arrived.set()
        if self.wait_for is not None:
            await self.wait_for.wait()
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
        if body.get("return_token_ids"):  # vLLM's extension: the prompt's and the answer's ids
            prompt = body["prompt"] if isinstance(body["prompt"], list) else [10, 11, 12]
            out["choices"][0].update(prompt_token_ids=prompt, token_ids=[42] if self.role == "prefill" else [43, 44])
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
    """Start fake engines + the proxy in this event loop, run ``scenario(session, proxy_url)``
    (or ``scenario(session, proxy_url, proxy)`` when it takes three arguments)."""

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
                if scenario.__code__.co_argcount == 3:
                    return await scenario(s, proxy_url, proxy)
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


def test_fake_upstream_idle_engine_connections_dropped_before_vllm_closes_them():
    """vLLM closes a connection idle for VLLM_HTTP_TIMEOUT_KEEP_ALIVE (5 s); a proxy that
    reused one that long could send a request just as the server closes it ("server
    disconnected", seen in CI with 5 s clients). The proxy reuses a connection only while it
    is fresh: two requests close together share one, two further apart than
    UPSTREAM_KEEPALIVE_S do not."""
    from vllm import envs

    keep = disagg_proxy.UPSTREAM_KEEPALIVE_S
    assert keep < envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE - 1, (keep, envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE)
    pre, dec = FakeEngine("prefill"), FakeEngine("decode")

    async def scenario(s, url):
        for pause in (0.0, keep + 0.5, 0.0):
            await asyncio.sleep(pause)
            async with s.post(url + "/v1/completions", json={"model": "m", "prompt": "x"}) as r:
                assert r.status == 200, await r.text()

    run_with(pre, dec, scenario)
    assert pre.peers[0] != pre.peers[1] and pre.peers[1] == pre.peers[2], pre.peers
    assert dec.peers[0] != dec.peers[1] and dec.peers[1] == dec.peers[2], dec.peers


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


# --------------------------------------------------------------------------- --flow router
ROUTER = dict(flow="router", prefill_side_channels=["127.0.0.1:5611"], decode_side_channels=["127.0.0.1:5722"])


def _waiting_for_each_other(pre: FakeEngine, dec: FakeEngine) -> None:
    """Each fake answers only once the other hop has arrived: a proxy that waited for the
    prefill's answer before sending the decode hop never gets an answer (the safety stop
    in the scenario fails the test)."""
    pre.wait_for, dec.wait_for = dec.arrived, pre.arrived


def test_fake_upstream_router_flow_sends_both_hops_at_once_with_one_compound_id():
    from kvtransport_vllm.routing import parse_router_request_id

    pre, dec = FakeEngine("prefill"), FakeEngine("decode")
    _waiting_for_each_other(pre, dec)
    req = {"model": "m", "prompt": "hi", "max_tokens": 9, "temperature": 0, "stream_options": {"x": 1}}

    async def scenario(s, url):
        async def go():
            async with s.post(url + "/v1/completions", json=req, headers={"X-Request-Id": "client_7"}) as r:
                return r.status, await r.json()
        return await asyncio.wait_for(go(), timeout=30)  # safety stop, not a measured time

    status, body = run_with(pre, dec, scenario, **ROUTER)
    assert status == 200 and body["choices"][0]["text"] == "decode-text"
    (p,), (d,) = pre.bodies, dec.bodies
    # prefill hop: one token, not streamed, keep the KV for a remote decoder
    assert p["max_tokens"] == 1 and p["stream"] is False and "stream_options" not in p
    assert p["kv_transfer_params"]["do_remote_decode"] is True
    # decode hop: the client's request, asking only for a remote prefill (WRITE: no block ids)
    assert d["max_tokens"] == 9 and d["stream_options"] == {"x": 1}
    assert d["kv_transfer_params"] == {"do_remote_prefill": True}
    # one compound id on both hops, naming both side channels; the connector parses it
    rid = pre.headers[0]["x-request-id"]
    assert dec.headers[0]["x-request-id"] == rid
    parsed = parse_router_request_id(rid)
    assert parsed is not None and rid.startswith("client-7___prefill_addr_")
    assert (parsed.prefill.host, parsed.prefill.port) == ("127.0.0.1", 5611)
    assert (parsed.decode.host, parsed.decode.port) == ("127.0.0.1", 5722)
    assert len(parsed.uuid) == 32


def test_fake_upstream_router_flow_fresh_uuid_per_request_and_streaming():
    from kvtransport_vllm.routing import parse_router_request_id

    pre, dec = FakeEngine("prefill"), FakeEngine("decode")
    _waiting_for_each_other(pre, dec)

    async def scenario(s, url):
        out = []
        for _ in range(2):
            async with s.post(url + "/v1/chat/completions",
                              json={"model": "m", "messages": [], "stream": True}) as r:
                out.append((r.status, r.content_type, await r.text()))
        return out

    got = run_with(pre, dec, scenario, **ROUTER)
    for status, ctype, text in got:
        assert status == 200 and ctype == "text/event-stream"
        assert text.count("data:") == 4 and text.endswith("data: [DONE]\n\n")
    assert [b["stream"] for b in pre.bodies] == [False, False]
    assert [b["stream"] for b in dec.bodies] == [True, True]
    uuids = {parse_router_request_id(h["x-request-id"]).uuid for h in pre.headers}
    assert len(uuids) == 2  # a fresh transfer key per request
    assert [h["x-request-id"] for h in pre.headers] == [h["x-request-id"] for h in dec.headers]


@pytest.mark.parametrize("prefill_status", [None, 500])
def test_fake_upstream_router_flow_failed_prefill_returns_the_decode_answer(prefill_status):
    """The prefill hop fails (engine unreachable or an error status): the decode engine's
    answer (its load failure policy decides: recompute or an error) is what the client gets."""
    pre = None if prefill_status is None else FakeEngine("prefill", status=prefill_status)
    dec = FakeEngine("decode")

    async def scenario(s, url, proxy):
        async with s.post(url + "/v1/completions", json={"model": "m", "prompt": "x"}) as r:
            out = r.status, await r.json()
        await proxy.drain()
        return out

    status, body = run_with(pre, dec, scenario, **ROUTER)
    assert status == 200 and body["choices"][0]["text"] == "decode-text"
    assert len(dec.bodies) == 1


def test_fake_upstream_router_flow_decode_error_passes_through():
    pre, dec = FakeEngine("prefill"), FakeEngine("decode", status=500)

    async def scenario(s, url, proxy):
        async with s.post(url + "/v1/completions", json={"model": "m", "prompt": "x"}) as r:
            out = r.status, await r.json()
        await proxy.drain()
        return out

    status, body = run_with(pre, dec, scenario, **ROUTER)
    assert status == 500 and body["error"]["message"] == "bad prompt"


def test_fake_upstream_router_flow_refuses_a_read_mode_prefill():
    """READ mode cannot run the router flow: once a prefill answer says so, the proxy
    refuses (502 naming WRITE mode) without contacting either engine."""
    pre = FakeEngine("prefill", kv_params=dict(KV, kvtransport_mode="read"))
    dec = FakeEngine("decode")

    async def scenario(s, url, proxy):
        async with s.get(url + "/health") as r:
            healthy = r.status
        async with s.post(url + "/v1/completions", json={"model": "m", "prompt": "x"}) as r:
            first = r.status
        await proxy.drain()
        async with s.get(url + "/health") as r:
            health = r.status, await r.json()
        async with s.post(url + "/v1/completions", json={"model": "m", "prompt": "x"}) as r:
            return healthy, first, health, r.status, await r.json()

    healthy, first, health, status, body = run_with(pre, dec, scenario, **ROUTER)
    assert first in (200, 502)  # 502 when the prefill's answer came before the decode's
    # a load balancer sees a proxy that refuses every request as unhealthy, and why
    assert healthy == 200 and health[0] == 503, (healthy, health)
    assert health[1]["error"]["type"] == "router_flow_needs_write_mode"
    assert status == 502 and body["error"]["type"] == "router_flow_needs_write_mode"
    assert "READ mode" in body["error"]["message"] and "mode write" in body["error"]["message"]
    assert len(pre.bodies) == len(dec.bodies) == 1  # the refused request reached no engine


@pytest.mark.parametrize("cfg, message", [
    (dict(flow="router"), "one --prefill-side-channel HOST:PORT per --prefill URL"),
    (dict(flow="router", prefill_side_channels=["h:1"]), "one --decode-side-channel HOST:PORT per --decode URL"),
    (dict(flow="router", prefill_side_channels=["h:1", "h:2"], decode_side_channels=["h:3"]),
     "got 1 URL\\(s\\) and 2 side channel"),
    (dict(flow="router", prefill_side_channels=["h"], decode_side_channels=["h:3"]),
     "--prefill-side-channel 'h': expected HOST:PORT"),
    (dict(flow="router", prefill_side_channels=["h:1"], decode_side_channels=["h:99999"]),
     "--decode-side-channel 'h:99999': expected HOST:PORT"),
    (dict(prefill_side_channels=["h:1"], decode_side_channels=["h:3"]), "used only by --flow router"),
    (dict(flow="parallel"), "--flow 'parallel'"),
])
def test_proxy_config_router_flow_argument_checks(cfg, message):
    with pytest.raises(ValueError, match=message):
        disagg_proxy.ProxyConfig(["http://p"], ["http://d"], **cfg)


def test_proxy_cli_router_flow_refused_at_start_with_the_reason(capsys):
    with pytest.raises(SystemExit, match="--flow router needs one --decode-side-channel"):
        disagg_proxy.main(["--flow", "router", "--prefill", "http://p", "--prefill-side-channel", "127.0.0.1:5600",
                           "--decode", "http://d"])


def test_proxy_cli_router_flow_pairs_side_channels_with_urls():
    args = disagg_proxy.parse_args(["--flow", "router",
                                    "--prefill", "http://p1", "--prefill-side-channel", "10.0.0.1:5600",
                                    "--prefill", "http://p2", "--prefill-side-channel", "[::1]:5601",
                                    "--decode", "http://d1", "--decode-side-channel", "10.0.0.9:5700"])
    cfg = disagg_proxy.make_config(args)
    pairs = [cfg.next_router_pair() for _ in range(3)]
    assert [p[0] for p in pairs] == [("http://p1", ("10.0.0.1", 5600)), ("http://p2", ("::1", 5601)),
                                     ("http://p1", ("10.0.0.1", 5600))]
    assert all(p[1] == ("http://d1", ("10.0.0.9", 5700)) for p in pairs)


def test_fake_upstream_several_engines_every_prefill_feeds_every_decode():
    """2 prefill and 2 decode engines: each request goes to the next (prefill, decode) pair
    of a round that holds every pair once, so both sides alternate engines and each decode
    engine loads from each prefill engine (two lockstep round-robins would pair P0-D0 and
    P1-D1 only). 8 requests: every pair twice, every engine 4 times."""
    pres = [FakeEngine("prefill", dict(KV, transfer_id=f"P{i}")) for i in range(2)]
    decs = [FakeEngine("decode") for _ in range(2)]

    async def main():
        runners, urls = [], []
        try:
            for e in pres + decs:
                r, u = await _serve(e.app())
                runners.append(r)
                urls.append(u)
            proxy = disagg_proxy.DisaggProxy(disagg_proxy.ProxyConfig(urls[:2], urls[2:]))
            r, proxy_url = await _serve(proxy.app())
            runners.insert(0, r)
            async with aiohttp.ClientSession() as s:
                for _ in range(8):
                    async with s.post(proxy_url + "/v1/completions", json={"model": "m", "prompt": "hi"}) as resp:
                        assert resp.status == 200
        finally:
            for r in runners:
                await r.cleanup()

    asyncio.run(main())
    assert [len(e.bodies) for e in pres + decs] == [4, 4, 4, 4]
    fed = [sorted(b["kv_transfer_params"]["transfer_id"] for b in d.bodies) for d in decs]
    assert fed == [["P0", "P0", "P1", "P1"]] * 2, fed


def test_fake_upstream_first_token_handover_continues_from_prompt_and_first_token():
    """--first-token handover: the prefill hop asks for token ids; the decode hop gets the
    prompt's ids + the first token, one token fewer, and the prefill's kv_transfer_params;
    the client's answer is the first token then the decode's (streamed: the first event is
    the first token). A chat request takes the ordinary two hops."""
    pre, dec = FakeEngine("prefill"), FakeEngine("decode")
    req = {"model": "m", "prompt": "hi", "max_tokens": 9, "temperature": 0, "return_token_ids": True}

    async def scenario(s, url):
        async with s.post(url + "/v1/completions", json=req) as r:
            plain = await r.json()
        async with s.post(url + "/v1/completions", json={**req, "stream": True}) as r:
            streamed = (await r.read()).decode()
        async with s.post(url + "/v1/chat/completions", json={"model": "m", "messages": [], "max_tokens": 9}) as r:
            chat = await r.json()
        return plain, streamed, chat

    plain, streamed, chat = run_with(pre, dec, scenario, first_token="handover")
    assert pre.bodies[0]["return_token_ids"] is True and pre.bodies[0]["max_tokens"] == 1
    d = dec.bodies[0]
    assert d["prompt"] == [10, 11, 12, 42] and d["max_tokens"] == 8 and d["kv_transfer_params"] == KV
    choice = plain["choices"][0]
    assert choice["text"] == "prefill-textdecode-text" and choice["token_ids"] == [42, 43, 44]
    assert choice["prompt_token_ids"] == [10, 11, 12]  # the client's prompt, not prompt + first token
    events = [e.removeprefix("data: ") for e in streamed.split("\n\n") if e]
    assert json.loads(events[0])["choices"][0]["token_ids"] == [42]  # the first token, from the prefill
    assert [json.loads(e)["choices"][0]["text"] for e in events[1:-1]] == ["a", "b", "c"] and events[-1] == "[DONE]"
    assert dec.bodies[1]["stream"] is True and dec.bodies[1]["prompt"] == [10, 11, 12, 42]
    assert chat["choices"][0]["text"] == "decode-text" and "return_token_ids" not in pre.bodies[2]


def test_proxy_config_first_token_handover_needs_the_two_hop_flow():
    with pytest.raises(ValueError, match="two-hop"):
        disagg_proxy.ProxyConfig(["http://p"], ["http://d"], flow="router", first_token="handover",
                                 prefill_side_channels=["h:1"], decode_side_channels=["h:2"])
