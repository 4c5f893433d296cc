r"""End-to-end prefill/decode disaggregation with two real vLLM CPU engines (issue 6).

Topology per (backend, mode)::

    OpenAI client --HTTP--> examples/disagg_proxy.py --> prefill engine (kv_producer, CPU 0)
                                                     \-> decode engine  (kv_consumer, CPU 1)

What a user would check, and what these tests assert:

* the answer is the same as from one ordinary engine, token for token (greedy);
* the decode engine really took the prompt KV from the prefill engine
  (vLLM's ``prompt_tokens_by_source{source="external_kv_transfer"}`` counter);
* under 32 concurrent requests nothing is stranded and both KV caches return to
  fully free (``kv_cache_usage_perc == 0``);
* killing the prefill engine ends the decode engine's in-flight requests by the
  transfer deadline -- before the (much longer) lease could have -- recomputed or
  failed per policy; a recomputed request's tokens equal the single engine's; and
  the decode engine keeps serving.

* a prefill engine restarted on the same address is used again;
* the router flow (``disagg_proxy.py --flow router``: both hops at once, one compound
  request id): WRITE loads every prompt of a block or more and answers like one engine,
  sequentially and 8 at once, leaking nothing; READ (which cannot run it) refuses the load,
  recomputes, and the proxy then refuses the flow naming WRITE mode.

Cost is start-up: one baseline engine (~25 s) and, per (backend, mode), a prefill +
decode pair (~35 s) plus one prefill restart (~25 s). Measured on the 2-core dev box:
about 5 minutes for loopback + ucx, READ + WRITE (more while the machine is busy).

Run: ``python -m pytest tests/e2e -q`` (``-m e2e`` selects these tests).
Environment: ``KVT_E2E_BACKENDS=loopback`` limits the backends (default
``loopback,ucx``; an unusable one is skipped with the registry's reason);
``KVT_E2E_LOG_DIR=DIR`` keeps every server's log there (default: a pytest temp dir;
failing tests get the log tails attached).
"""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from kvtransport_vllm.load_stats import Cause

from . import harness, prompts
from .conftest import BASELINE_SEEDS, LEASE_S, TRANSFER_TIMEOUT_S
from .harness import BLOCK_SIZE, VllmServer, proxy_process, side_channel_port
from .harness import start_all as harness_start

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

EXTERNAL = {"source": "external_kv_transfer"}
LOCAL = {"source": "local_compute"}


def _seed(pair) -> int:
    return prompts.pair_seed(pair.backend, pair.mode)


def _prompt_tokens(server: VllmServer) -> tuple[float, float]:
    """(external_kv_transfer, local_compute) prompt-token counters of one engine."""
    return (server.metric("vllm:prompt_tokens_by_source_total", **EXTERNAL),
            server.metric("vllm:prompt_tokens_by_source_total", **LOCAL))


def _idle_state(server: VllmServer) -> dict[str, float]:
    m = {
        "running": server.metric("vllm:num_requests_running"),
        "waiting": server.metric("vllm:num_requests_waiting"),
        "kv_cache_usage": server.metric("vllm:kv_cache_usage_perc"),
        # Consumer only: requests in WAITING_FOR_REMOTE_KVS, by load stage.
        "kv_fetch": server.metric("vllm:num_requests_kv_fetch_by_stage"),
    }
    return m


def wait_idle(server: VllmServer, timeout_s: float = 60.0) -> dict[str, float]:
    """Poll /metrics until nothing runs, nothing waits and no KV block is in use."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = _idle_state(server)
        if all(v == 0 for v in state.values()):
            return state
        if time.monotonic() > deadline:
            raise AssertionError(f"{server.name} not idle {timeout_s}s after the run: {state}")
        time.sleep(0.5)


def _outcomes(server: VllmServer, side: str, cause: str | None = None) -> float:
    """The connector's outcome counter on /metrics (issue 17: vllm:kvtransport_outcomes_total)."""
    labels = {"side": side} if cause is None else {"side": side, "cause": cause}
    return server.metric("vllm:kvtransport_outcomes_total", **labels)


def wait_for_count(what: str, read, want: float, timeout_s: float = 30.0) -> float:
    """Poll a counter until it reaches ``want`` (stats reach /metrics with the next engine step)."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = read()
        if got >= want:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: {got} after {timeout_s}s, expected {want}")
        time.sleep(0.2)


# --------------------------------------------------------------------------- baseline
def test_baseline_single_engine_answers_every_prompt(baseline, vocab_size):
    """The reference: one plain engine, full-length greedy completions, reproducible."""
    wanted = prompts.all_prompts(vocab_size, BASELINE_SEEDS)
    assert len(baseline) == len({tuple(p) for p, _ in wanted})
    assert all(len(v) == prompts.MAX_TOKENS for v in baseline.values())
    # Outputs depend on the prompt (a model emitting a constant would make the
    # equality tests below meaningless).
    assert len({tuple(v) for v in baseline.values()}) > len(baseline) // 2


# --------------------------------------------------------------------------- acceptance 1 + 2
def test_greedy_matches_single_engine_and_kv_is_remote(pair, baseline, vocab_size):
    pair.ensure_prefill()
    client = prompts.client(pair.proxy.url)
    mismatches, not_remote, seen = [], [], []
    loads0, holds0 = _outcomes(pair.decode, "load", "ok"), _outcomes(pair.prefill, "hold", "ok")
    failed0 = _outcomes(pair.decode, "load") - loads0
    for p in prompts.correctness_prompts(vocab_size, _seed(pair)):
        ext0, loc0 = _prompt_tokens(pair.decode)
        pre_ext0, pre_loc0 = _prompt_tokens(pair.prefill)
        got = prompts.complete(client, p)
        ext1, loc1 = _prompt_tokens(pair.decode)
        pre_ext1, pre_loc1 = _prompt_tokens(pair.prefill)
        want = baseline[tuple(p)]
        row = dict(len=len(p), remote=ext1 - ext0, local=loc1 - loc0, prefill_local=pre_loc1 - pre_loc0)
        seen.append(row)
        if got != want:
            mismatches.append((len(p), got, want))
        # A prompt shorter than one KV block has no full block to move: the connector
        # documents that the decode engine computes it (docs/vllm/USAGE.md). Every longer
        # prompt must come from the prefill engine.
        if len(p) >= BLOCK_SIZE and row["remote"] <= 0:
            not_remote.append(row)
    print(f"\n[e2e] {pair.backend}-{pair.mode} prompt tokens per request on decode: {seen}")
    assert not mismatches, f"disaggregated output differs from single engine: {mismatches}"
    # Acceptance 2: the decode engine loaded the prompt KV from the prefill engine.
    assert not not_remote, f"decode engine recomputed instead of loading remote KV: {not_remote}"
    for row in seen:
        # The prefill engine computed every prompt; on the decode engine vLLM's
        # accounting is local + external == prompt (no local cache hits: fresh
        # prompts), and for every prompt of a block or more most of it was remote.
        assert row["prefill_local"] == row["len"], row
        assert row["local"] + row["remote"] == row["len"], row
        if row["len"] >= BLOCK_SIZE:
            assert row["local"] < BLOCK_SIZE, row
    # Issue 17: the connector's series on /metrics count exactly these loads and holds.
    n_remote = sum(1 for row in seen if row["len"] >= BLOCK_SIZE)
    loads = wait_for_count("decode loads ok", lambda: _outcomes(pair.decode, "load", "ok"), loads0 + n_remote)
    holds = wait_for_count("prefill holds ok", lambda: _outcomes(pair.prefill, "hold", "ok"), holds0 + n_remote)
    assert (loads - loads0, holds - holds0) == (n_remote, n_remote)
    assert _outcomes(pair.decode, "load") - loads - failed0 == 0  # no failed load
    assert pair.decode.metric("vllm:kvtransport_remote_kv_wait_seconds_count", backend=pair.backend,
                              mode=pair.mode) >= n_remote


def test_streaming_through_proxy(pair, baseline, vocab_size):
    """The proxy passes the decode engine's SSE stream through unchanged."""
    pair.ensure_prefill()
    p = prompts.after_kill_prompts(vocab_size, _seed(pair))[1]
    client = prompts.client(pair.proxy.url)
    text_plain = client.completions.create(model="tiny", prompt=p, max_tokens=prompts.MAX_TOKENS,
                                           **prompts.GREEDY).choices[0].text
    chunks = client.completions.create(model="tiny", prompt=p, max_tokens=prompts.MAX_TOKENS,
                                       stream=True, **prompts.GREEDY)
    ids, text = [], ""
    for ch in chunks:
        if ch.choices:
            text += ch.choices[0].text
            ids += ch.choices[0].model_extra.get("token_ids") or []
    assert text == text_plain
    assert ids == baseline[tuple(p)]  # vLLM puts token_ids in each chunk (return_token_ids)


def test_first_token_handover_matches_single_engine(pair, baseline, vocab_size, log_dir):
    """``disagg_proxy.py --first-token handover``: the first token comes from the prefill's
    answer, the decode engine continues from prompt + first token with the prompt's KV
    loaded remotely. Greedy tokens equal one engine's, streamed and not; every prompt of a
    block or more is loaded (external prompt tokens on the decode engine); nothing is left
    in use."""
    pair.ensure_prefill()
    proxy = proxy_process(f"handover-proxy-{pair.backend}-{pair.mode}", log_dir, pair.prefill.url, pair.decode.url,
                          prefill_timeout_s=60, decode_timeout_s=120, extra_args=["--first-token", "handover"])
    try:
        harness_start([proxy])
        client = prompts.client(proxy.url)
        mismatches, not_remote = [], []
        *one_by_one, streamed = prompts.handover_prompts(vocab_size, _seed(pair))
        for p in one_by_one:
            ext0, _ = _prompt_tokens(pair.decode)
            got = prompts.complete(client, p)
            remote = _prompt_tokens(pair.decode)[0] - ext0
            if got != baseline[tuple(p)]:
                mismatches.append((len(p), got, baseline[tuple(p)]))
            if len(p) >= BLOCK_SIZE and remote <= 0:
                not_remote.append((len(p), remote))
        assert not mismatches, f"handed-over output differs from single engine: {mismatches}"
        assert not not_remote, f"the decode engine recomputed the prompt instead of loading it: {not_remote}"
        events = list(client.completions.create(model="tiny", prompt=streamed, max_tokens=prompts.MAX_TOKENS,
                                                stream=True, **prompts.GREEDY))
        ids = [t for ev in events if ev.choices for t in ev.choices[0].model_extra.get("token_ids") or []]
        assert ids == baseline[tuple(streamed)]
        assert events[0].choices[0].model_extra.get("token_ids") == ids[:1]  # the first event: the first token
        wait_idle(pair.decode)
        wait_idle(pair.prefill)
    finally:
        proxy.stop()


# --------------------------------------------------------------------------- acceptance 3
def test_32_concurrent_requests_match_and_free_everything(pair, baseline, vocab_size):
    pair.ensure_prefill()
    ps = prompts.concurrent_prompts(vocab_size, _seed(pair))
    assert len(ps) == 32
    ext0, _ = _prompt_tokens(pair.decode)

    async def run():
        c = prompts.async_client(pair.proxy.url)
        try:
            return await asyncio.gather(*(prompts.acomplete(c, p) for p in ps),
                                        return_exceptions=True)
        finally:
            await c.close()

    results = asyncio.run(asyncio.wait_for(run(), timeout=300))
    errors = [(len(p), repr(r)) for p, r in zip(ps, results) if isinstance(r, BaseException)]
    if errors:  # the engines are the module's: their state, without the stacks (which end them)
        print(f"[e2e] state when {len(errors)} requests had failed:\n"
              + harness.stall_report([pair.decode, pair.prefill], stacks=False))
    assert not errors, f"requests failed (engine state printed): {errors}"
    wrong = [len(p) for p, r in zip(ps, results) if prompts.completion_ids(r) != baseline[tuple(p)]]
    assert not wrong, f"{len(wrong)} of 32 concurrent outputs differ (prompt lengths {wrong})"
    ext1, _ = _prompt_tokens(pair.decode)
    assert ext1 - ext0 > 0.5 * sum(len(p) for p in ps), (ext0, ext1)
    # No request stranded in WAITING_FOR_REMOTE_KVS; every block back in the pool.
    # (The consumer exports the per-stage gauge; without it this check could not fail.)
    assert any(k.startswith("vllm:num_requests_kv_fetch_by_stage{") for k in pair.decode.metrics())
    wait_idle(pair.decode)
    wait_idle(pair.prefill)


# --------------------------------------------------------------------------- acceptance 4
def _prefill_hop(prefill: VllmServer, p: list[int]) -> dict:
    """What the proxy's first hop does, done by hand: prefill one token, keep the KV."""
    r = httpx.post(prefill.url + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": p, "max_tokens": 1, "temperature": 0.0,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}})
    r.raise_for_status()
    kv = r.json().get("kv_transfer_params")
    assert kv, f"prefill engine returned no kv_transfer_params: {r.json()}"
    return kv


async def _decode_with(decode: VllmServer, p: list[int], kv: dict) -> tuple[float, object]:
    """One request straight to the decode engine; (monotonic end time, response or error)."""
    c = prompts.async_client(decode.url, timeout=TRANSFER_TIMEOUT_S * 4 + 60)
    try:
        resp = await c.completions.create(
            model="tiny", prompt=p, max_tokens=prompts.MAX_TOKENS, temperature=0.0,
            extra_body={"ignore_eos": True, "return_token_ids": True, "kv_transfer_params": kv})
        return time.monotonic(), resp
    except openai.APIError as e:
        return time.monotonic(), e
    finally:
        await c.close()


async def _via_proxy(proxy: VllmServer, p: list[int]) -> tuple[float, object]:
    """One request through the proxy; (monotonic end time, response or error)."""
    c = prompts.async_client(proxy.url, timeout=TRANSFER_TIMEOUT_S * 4 + 60)
    try:
        resp = await prompts.acomplete(c, p)
        return time.monotonic(), resp
    except openai.APIError as e:
        return time.monotonic(), e
    finally:
        await c.close()


def _requests_seen(server: VllmServer) -> float:
    """Requests the engine holds now (running, waiting, loading KV) plus those it finished:
    grows from 0 as soon as the engine has taken a request, whether or not it is done."""
    m = server.metrics()

    def total(name: str) -> float:
        return sum(v for k, v in m.items() if k == name or k.startswith(name + "{"))

    return (total("vllm:num_requests_running") + total("vllm:num_requests_waiting")
            + total("vllm:request_success_total"))


async def _until(what: str, cond, tasks: list[asyncio.Task], limit_s: float = 120.0) -> None:
    """Wait for an ordering fact: ``cond()`` holds (polled in a thread) or every task in
    ``tasks`` has already ended (then whatever was to happen meanwhile has happened).
    ``limit_s`` is a safety stop, not a threshold the test measures."""
    deadline = time.monotonic() + limit_s
    while not (all(t.done() for t in tasks) or await asyncio.to_thread(cond)):
        assert time.monotonic() < deadline, f"never happened: {what}"
        await asyncio.sleep(0.01)  # poll interval; the condition is what synchronises


def _check_ended(pair, p, ended_at, r, lease_end, baseline, *, recomputed: bool = False) -> str:
    """One request that was in flight when the prefill engine died (or, ``recomputed``,
    sent after it died): ended before the lease could have, with the right answer or an
    error allowed by the policy."""
    # Ordering fact, not a timing threshold: the transfer deadline (TRANSFER_TIMEOUT_S)
    # ended it, not the lease (LEASE_S, far longer): it ended before the lease could have.
    assert ended_at < lease_end, f"request of {len(p)} tokens ended only after the lease ({LEASE_S}s) would have"
    if isinstance(r, BaseException):
        # Failed per policy (or, through the proxy, caught in the prefill hop: 502).
        status = getattr(r, "status_code", None)
        if pair.policy == "recompute":
            assert status == 502 and not recomputed, f"recompute policy: only the prefill hop may fail, got {r!r}"
        return f"{type(r).__name__}({status})"
    fr = r.choices[0].finish_reason
    if recomputed and pair.policy == "recompute":
        # Its KV was on the dead engine: it was recomputed, and must equal the reference.
        assert fr in ("length", "stop"), (len(p), fr)
        assert prompts.completion_ids(r) == baseline[tuple(p)], f"recomputed output of {len(p)} tokens differs"
        return f"recomputed:{fr}"
    if recomputed:
        # "fail" policy: its KV was on the dead engine, so it cannot have been served.
        assert fr not in ("length", "stop"), f"fail policy: request of {len(p)} tokens served without its KV"
    if pair.policy == "recompute" or fr in ("length", "stop"):
        # Loaded before the kill, or recomputed: must be the right answer.
        assert prompts.completion_ids(r) == baseline[tuple(p)], (len(p), fr)
    return f"ok:{fr}"


def test_prefill_killed_mid_run(pair, baseline, vocab_size):
    """Acceptance 4: in-flight requests end by the transfer deadline (before the lease);
    requests whose KV died with the engine are recomputed to the reference answer or
    failed, per policy; the decode engine keeps serving."""
    pair.ensure_prefill()
    wait_idle(pair.decode)  # so that what the decode engine holds below is this test's
    seed = _seed(pair)
    ps = prompts.kill_prompts(vocab_size, seed)
    proxied = prompts.kill_proxy_prompts(vocab_size, seed)
    # The proxy's first hop, done by hand: these requests' KV sits on the prefill engine.
    kvs = [_prefill_hop(pair.prefill, p) for p in ps]
    seen0 = _requests_seen(pair.decode)

    async def run():
        # In flight when the prefill engine dies: half the decode requests with KV
        # handles, and a burst through the proxy (some in the prefill hop, some in the
        # decode hop). The other half of the handles arrive after it is dead.
        half = len(ps) // 2
        burst = [asyncio.create_task(_via_proxy(pair.proxy, p)) for p in proxied]
        await _until("a proxied request reached the decode hop",
                     lambda: _requests_seen(pair.decode) > seen0, burst)
        seen1 = _requests_seen(pair.decode)
        first = [asyncio.create_task(_decode_with(pair.decode, p, kv))
                 for p, kv in zip(ps[:half], kvs[:half])]
        await _until("the decode engine took another request after the direct ones were sent",
                     lambda: _requests_seen(pair.decode) > seen1, first)
        pair.prefill.kill()  # returns once the whole process group is dead
        killed_at = time.monotonic()
        later = [asyncio.create_task(_decode_with(pair.decode, p, kv))
                 for p, kv in zip(ps[half:], kvs[half:])]
        return killed_at, await asyncio.gather(*first), await asyncio.gather(*later), await asyncio.gather(*burst)

    failed0 = _outcomes(pair.decode, "load") - _outcomes(pair.decode, "load", "ok")
    killed_at, first, later, via = asyncio.run(asyncio.wait_for(run(), timeout=TRANSFER_TIMEOUT_S * 4 + 120))
    assert not pair.prefill.alive
    lease_end = killed_at + LEASE_S
    half = len(ps) // 2
    report = {"direct": [], "recomputed_or_failed": [], "proxy": []}
    for p, (end, r) in zip(ps[:half], first):
        report["direct"].append((len(p), _check_ended(pair, p, end, r, lease_end, baseline)))
    for p, (end, r) in zip(ps[half:], later):
        report["recomputed_or_failed"].append(
            (len(p), _check_ended(pair, p, end, r, lease_end, baseline, recomputed=True)))
    for p, (end, r) in zip(proxied, via):
        report["proxy"].append((len(p), _check_ended(pair, p, end, r, lease_end, baseline)))
    print(f"\n[e2e] {pair.backend}-{pair.mode} after prefill kill ({pair.policy}): {report}")
    # Issue 17: the loads whose KV died with the engine show on /metrics under their cause.
    wait_for_count("decode failed loads", lambda: _outcomes(pair.decode, "load") - _outcomes(pair.decode, "load", "ok"),
                   failed0 + len(ps) - half)
    causes = {c: _outcomes(pair.decode, "load", c) for c in ("peer_gone", "timeout", "transport_failure",
                                                            "handshake_refused", "lease_expired")}
    print(f"[e2e] decode failure causes after the kill: {causes}")

    # The proxy reports the dead prefill engine clearly.
    r = httpx.post(pair.proxy.url + "/v1/completions", timeout=60,
                   json={"model": "tiny", "prompt": ps[0], "max_tokens": 2})
    assert r.status_code == 502, r.text
    assert "prefill" in r.json()["error"]["message"]

    # Bring the prefill engine back (same ports) while checking the decode engine:
    # it keeps serving, and nothing is left waiting or holding blocks.
    pair.begin_prefill_restart()
    assert pair.decode.alive
    c = prompts.client(pair.decode.url)
    for p in prompts.after_kill_prompts(vocab_size, seed):
        assert prompts.complete(c, p) == baseline[tuple(p)]
    wait_idle(pair.decode, timeout_s=TRANSFER_TIMEOUT_S + 30)


def test_prefill_restarted_pair_serves_again(pair, baseline, vocab_size):
    """A prefill engine restarted on the same address is used again by the decode engine."""
    pair.ensure_prefill()
    p = prompts.restart_prompts(vocab_size, _seed(pair))[0]
    causes = [c.value for c in Cause]

    def snapshot() -> dict[str, float]:
        ext, loc = _prompt_tokens(pair.decode)
        out = {"external_tokens": ext, "local_tokens": loc,
               "prefix_cache_hits": pair.decode.metric("vllm:prefix_cache_hits_total")}
        out.update({f"load_{c}": _outcomes(pair.decode, "load", c) for c in causes})
        return out

    before = snapshot()
    got = prompts.complete(prompts.client(pair.proxy.url), p)
    after = snapshot()
    assert got == baseline[tuple(p)]
    # On failure, say what the decode engine did instead (recomputed after a failed load,
    # found the prompt in its own prefix cache, or was never asked to load).
    delta = {k: after[k] - before[k] for k in after if after[k] != before[k]}
    assert after["external_tokens"] > before["external_tokens"], (
        f"decode engine did not load remote KV from the restarted prefill engine; what changed: {delta}")
    wait_idle(pair.decode)
    wait_idle(pair.prefill)


# --------------------------------------------------------------------------- router flow
def _router_proxy(pair, log_dir) -> VllmServer:
    """examples/disagg_proxy.py with ``--flow router`` in front of this pair: both hops at once,
    one compound request id naming both engines' side channels."""
    pre_sc, dec_sc = side_channel_port(pair.prefill), side_channel_port(pair.decode)
    return proxy_process(f"router-proxy-{pair.backend}-{pair.mode}", log_dir, pair.prefill.url, pair.decode.url,
                         prefill_timeout_s=60, decode_timeout_s=120,
                         extra_args=["--flow", "router", "--prefill-side-channel", f"127.0.0.1:{pre_sc}",
                                     "--decode-side-channel", f"127.0.0.1:{dec_sc}"])


def test_router_flow_parallel_dispatch(pair, baseline, vocab_size, log_dir):
    """The router flow (prefill and decode hops sent at once, MoRIIO compound request id) on
    real engines through ``disagg_proxy.py --flow router``.

    WRITE: the decode engine sends its block ids before the prefill has finished; the prefill
    engine queues them and pushes the KV when done. Greedy tokens equal the single engine's
    (below a block, one block, across blocks), sequentially and 8 at once; every prompt of a
    block or more is loaded (external prompt tokens, one ok load and one ok hold each); the
    short ones are computed by the decode engine and their holds released; both engines idle
    with every block free afterwards.

    READ cannot run this flow (the decode engine needs the prefill's block ids): the decode
    engine refuses the params (load ``params_refused``, recomputed per the READ pair's policy,
    right tokens), the prefill engine's hold is released, and the proxy, once a prefill answer
    says READ mode, refuses further requests with 502 naming WRITE mode."""
    pair.ensure_prefill()
    wait_idle(pair.decode)
    wait_idle(pair.prefill)
    proxy = _router_proxy(pair, log_dir)
    try:
        harness_start([proxy])
        if pair.mode == "write":
            _router_flow_write(pair, proxy, baseline, vocab_size)
        else:
            _router_flow_read_refused(pair, proxy, baseline, vocab_size)
        wait_idle(pair.decode)
        wait_idle(pair.prefill)
    finally:
        proxy.stop()


def _router_flow_write(pair, proxy, baseline, vocab_size) -> None:
    seed = _seed(pair)
    client = prompts.client(proxy.url)
    loads0, holds0 = _outcomes(pair.decode, "load", "ok"), _outcomes(pair.prefill, "hold", "ok")
    released0 = _outcomes(pair.prefill, "hold", "released")
    failed0 = _outcomes(pair.decode, "load") - loads0
    seen, mismatches = [], []
    for p in prompts.router_prompts(vocab_size, seed):
        ext0, loc0 = _prompt_tokens(pair.decode)
        _, pre_loc0 = _prompt_tokens(pair.prefill)
        got = prompts.complete(client, p)
        ext1, loc1 = _prompt_tokens(pair.decode)
        _, pre_loc1 = _prompt_tokens(pair.prefill)
        row = dict(len=len(p), remote=ext1 - ext0, local=loc1 - loc0, prefill_local=pre_loc1 - pre_loc0)
        seen.append(row)
        if got != baseline[tuple(p)]:
            mismatches.append((len(p), got, baseline[tuple(p)]))
    print(f"\n[e2e] {pair.backend}-write router flow, prompt tokens per request on decode: {seen}")
    assert not mismatches, f"router flow output differs from the single engine: {mismatches}"
    for row in seen:
        assert row["local"] + row["remote"] == row["len"], row
        if row["len"] >= BLOCK_SIZE:  # loaded from the prefill engine, which computed it
            assert row["remote"] > 0 and row["local"] < BLOCK_SIZE, row
            assert row["prefill_local"] == row["len"], row
        else:  # nothing to load: the decode engine computes it
            assert row["remote"] == 0, row

    ps = prompts.router_concurrent_prompts(vocab_size, seed)
    ext0, _ = _prompt_tokens(pair.decode)

    async def run():
        c = prompts.async_client(proxy.url)
        try:
            return await asyncio.gather(*(prompts.acomplete(c, p) for p in ps), return_exceptions=True)
        finally:
            await c.close()

    results = asyncio.run(asyncio.wait_for(run(), timeout=300))
    errors = [(len(p), repr(r)) for p, r in zip(ps, results) if isinstance(r, BaseException)]
    if errors:
        print(f"[e2e] state when {len(errors)} router-flow requests had failed:\n"
              + harness.stall_report([pair.decode, pair.prefill], stacks=False))
    assert not errors, f"router flow requests failed (engine state printed): {errors}"
    wrong = [len(p) for p, r in zip(ps, results) if prompts.completion_ids(r) != baseline[tuple(p)]]
    assert not wrong, f"{len(wrong)} of {len(ps)} concurrent router-flow outputs differ (lengths {wrong})"
    ext1, _ = _prompt_tokens(pair.decode)
    long_ = [p for p in ps if len(p) >= BLOCK_SIZE]
    assert ext1 - ext0 >= sum(len(p) - BLOCK_SIZE for p in long_), (ext0, ext1)

    # one ok load and one ok hold per prompt of a block or more; the short ones' holds are
    # released (their consumer had nothing to load, often before the prefill finished)
    every = prompts.router_prompts(vocab_size, seed) + ps
    n_remote = sum(1 for p in every if len(p) >= BLOCK_SIZE)
    n_short = len(every) - n_remote
    loads = wait_for_count("decode loads ok", lambda: _outcomes(pair.decode, "load", "ok"), loads0 + n_remote)
    holds = wait_for_count("prefill holds ok", lambda: _outcomes(pair.prefill, "hold", "ok"), holds0 + n_remote)
    released = wait_for_count("prefill holds released", lambda: _outcomes(pair.prefill, "hold", "released"),
                              released0 + n_short)
    assert (loads - loads0, holds - holds0, released - released0) == (n_remote, n_remote, n_short)
    assert _outcomes(pair.decode, "load") - loads - failed0 == 0  # no failed load


def _router_flow_read_refused(pair, proxy, baseline, vocab_size) -> None:
    assert pair.policy == "recompute"  # POLICY_BY_MODE: the refused load is recomputed
    seed = _seed(pair)
    refused0 = _outcomes(pair.decode, "load", "params_refused")
    released0 = _outcomes(pair.prefill, "hold", "released")

    def ask(p: list[int]) -> httpx.Response:
        return httpx.post(proxy.url + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": p, "max_tokens": prompts.MAX_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True})

    def assert_refusal(r: httpx.Response, status: int) -> None:
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert err["type"] == "router_flow_needs_write_mode" and "READ mode" in err["message"], err

    # Both engines get the first request. The decode engine refuses the params (no block ids)
    # and recomputes; the proxy passes that answer through (right tokens) or -- when the
    # prefill's answer, saying READ mode, came first -- refuses it. Whichever came first, the
    # proxy learns the mode from the prefill's answer: its /health says so (503), and from
    # then on it refuses every request without contacting either engine.
    p = prompts.router_prompts(vocab_size, seed)[3]  # several blocks
    r = ask(p)
    if r.status_code == 200:
        assert r.json()["choices"][0]["token_ids"] == baseline[tuple(p)]  # recomputed
    else:
        assert_refusal(r, 502)
    deadline = time.monotonic() + 90  # the prefill hop's timeout is 60 s
    while (health := httpx.get(proxy.url + "/health", timeout=30)).status_code == 200:
        assert time.monotonic() < deadline, "the proxy never learned the prefill engine runs READ mode"
        time.sleep(0.2)
    assert_refusal(health, 503)

    wait_idle(pair.decode)
    wait_idle(pair.prefill)
    before = _prompt_tokens(pair.decode), _prompt_tokens(pair.prefill)
    r = ask(prompts.router_prompts(vocab_size, seed)[2])
    assert r.status_code != 200, "the proxy passed a router-flow request to a READ pair"
    assert_refusal(r, 502)
    assert (_prompt_tokens(pair.decode), _prompt_tokens(pair.prefill)) == before  # neither engine asked

    # The one request the engines got is a released hold on the prefill engine and a refused
    # load on the decode engine (the prompt fills several blocks).
    wait_for_count("decode loads refused", lambda: _outcomes(pair.decode, "load", "params_refused"),
                   refused0 + 1)
    wait_for_count("prefill holds released", lambda: _outcomes(pair.prefill, "hold", "released"),
                   released0 + 1)
