"""Deterministic prompt sets and an OpenAI-client helper for the end-to-end tests.

Prompts are token-id lists (the completions API accepts them), so their lengths
are exact: shorter than a KV block, exactly one block, one past it, many blocks.
Each set uses its own seed, so no two sets share a prefix and a decode engine's
local prefix cache never hides a remote load.
"""

from __future__ import annotations

import random
import zlib

import httpx
import openai

from .harness import BLOCK_SIZE

MAX_TOKENS = 12

#: Acceptance 1: lengths around and across block boundaries.
CORRECTNESS_LENGTHS = [5, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, 2 * BLOCK_SIZE,
                       7 * BLOCK_SIZE + 3, 20 * BLOCK_SIZE]
N_CONCURRENT = 32
N_KILL = 6


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]  # 0..2 are <unk>, <s>, </s>


def correctness_prompts(vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(1000 + seed)
    return [_ids(rng, n, vocab) for n in CORRECTNESS_LENGTHS]


def concurrent_prompts(vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(2000 + seed)
    lengths = [rng.randint(1, 12 * BLOCK_SIZE) for _ in range(N_CONCURRENT - 4)]
    lengths += [BLOCK_SIZE, 2 * BLOCK_SIZE, 3, 10 * BLOCK_SIZE]
    return [_ids(rng, n, vocab) for n in lengths]


def kill_prompts(vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(3000 + seed)
    return [_ids(rng, BLOCK_SIZE * (2 + i), vocab) for i in range(N_KILL)]


def kill_proxy_prompts(vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(3500 + seed)
    return [_ids(rng, rng.randint(BLOCK_SIZE, 8 * BLOCK_SIZE), vocab) for _ in range(8)]


def after_kill_prompts(vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(4000 + seed)
    return [_ids(rng, n, vocab) for n in (7, 3 * BLOCK_SIZE)]


def restart_prompts(vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(5000 + seed)
    return [_ids(rng, n, vocab) for n in (2 * BLOCK_SIZE + 5,)]


#: Router flow (both hops at once): below a block, a block, across blocks, many blocks.
ROUTER_LENGTHS = [5, BLOCK_SIZE, BLOCK_SIZE + 1, 3 * BLOCK_SIZE, 7 * BLOCK_SIZE + 3]
N_ROUTER_CONCURRENT = 8


def router_prompts(vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(6000 + seed)
    return [_ids(rng, n, vocab) for n in ROUTER_LENGTHS]


def router_concurrent_prompts(vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(6500 + seed)
    lengths = [rng.randint(BLOCK_SIZE, 8 * BLOCK_SIZE) for _ in range(N_ROUTER_CONCURRENT - 1)] + [9]
    return [_ids(rng, n, vocab) for n in lengths]


def handover_prompts(vocab: int, seed: int) -> list[list[int]]:
    """First-token hand-over: below a block, a block, one past it, many blocks; the last
    one streamed."""
    rng = random.Random(7000 + seed)
    return [_ids(rng, n, vocab) for n in (5, BLOCK_SIZE, BLOCK_SIZE + 1, 7 * BLOCK_SIZE + 3, 3 * BLOCK_SIZE)]


def pair_seed(backend: str, mode: str) -> int:
    """Each pair (backend, mode) gets its own prompts, so a prompt a test sends was never
    seen by that pair's engines before (their prefix caches cannot hide a remote load)."""
    return zlib.crc32(f"{backend}-{mode}".encode()) % 100_000


def all_prompts(vocab: int, seeds: list[int]) -> list[tuple[list[int], int]]:
    """Every (prompt, max_tokens) any test asks, so the baseline engine answers them all once."""
    out = []
    for seed in seeds:
        for fn in (correctness_prompts, concurrent_prompts, kill_prompts, kill_proxy_prompts,
                   after_kill_prompts, restart_prompts, router_prompts, router_concurrent_prompts, handover_prompts):
            out += [(p, MAX_TOKENS) for p in fn(vocab, seed)]
    return out


#: Connection limits of every test client. vLLM's servers close a connection idle for
#: ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE`` (5 s); httpx and openai keep idle ones for 5 s too, so a
#: request sent on one just as the server closes it fails with "Server disconnected without
#: sending a response" (seen in CI between two hops more than 5 s apart). Clients here drop
#: idle connections after 1 s instead.
LIMITS = httpx.Limits(max_connections=1000, max_keepalive_connections=100, keepalive_expiry=1.0)


def client(base_url: str, timeout: float = 60.0) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", timeout=timeout, max_retries=0,
                         http_client=openai.DefaultHttpxClient(limits=LIMITS))


def async_client(base_url: str, timeout: float = 90.0) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", timeout=timeout,
                              max_retries=0, http_client=openai.DefaultAsyncHttpxClient(limits=LIMITS))


GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True, "return_token_ids": True})


def completion_ids(resp) -> list[int]:
    ids = resp.choices[0].model_extra.get("token_ids")
    assert ids is not None, "server did not return token_ids (needs return_token_ids)"
    return list(ids)


def complete(c: openai.OpenAI, prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    resp = c.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, **GREEDY)
    return completion_ids(resp)


async def acomplete(c: openai.AsyncOpenAI, prompt: list[int], max_tokens: int = MAX_TOKENS):
    return await c.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, **GREEDY)
