"""Engines with different block sizes: blocks paired by token position.

Why: each engine picks its own ``--block-size`` (a prefill engine tuned for long prompts,
a decode engine for many short sequences; the attention backend may force one). Token
``t`` lies in block ``t // B`` at slot ``t % B`` of an engine with block size ``B``. When
one block size divides the other, the tokens both engines hold split into runs of
``m = min(B_local, B_remote)`` tokens that lie inside one block on each side, so every
run is one byte range per head on each side (or per token range, when a token holds all
its heads):

* heads-outer blocks (HND, vLLM's ``LBHNC``: ``[heads, block_size, ...]`` inside a block):
  head ``h`` of a run starts at ``h * B * bytes_per_token_and_head + slot * ...``;
* tokens-outer blocks (NHD, and MLA's one latent per token): a run of tokens is one range
  with every head in it; only whole blocks' heads (equal TP sizes, checked at the
  hand-shake by :mod:`.compat`).

Both sides list their ranges in the same order (layer, part, run, head), so the core
pairs them one to one and merges what is contiguous on both sides. Everything is numpy
over runs x heads x parts x layers: no Python loop per block.

Only attention backends known to keep each token as one row of a block take part
(:data:`TOKEN_ROW_BACKENDS`: vLLM's GPU backends, whose caches follow vLLM's layout of
``[blocks, heads, tokens, K|V]`` up to the order of the dimensions, or FlashAttention's
separate K and V of ``[blocks, tokens, heads, head_size]``). vLLM's CPU backend is not one:
it packs a block's keys in an order of its own per instruction set, which changes with the
block size (measured: a key written to slot ``s`` of a 32-token block is not at row ``s``).
A backend outside the list, or not known, is refused rather than guessed.

Refused (the hand-shake or the load says which and why): block sizes of which neither
divides the other, attention backends not in the list, vLLM's cross-layer layout, models
with several KV cache groups (hybrid: sliding window, Mamba state), and layouts that do not
say where heads lie.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

import kvtransport as kvt

from .kv_layout import HEADS_OUTER, TOKENS_OUTER

if TYPE_CHECKING:  # .messages imports vLLM; this module must import without it (compat, tests)
    from .messages import LayoutInfo, RecvJob
    from .tp_mapping import Piece

#: vLLM attention backends (``get_name()``) whose blocks keep each token's K and V as rows
TOKEN_ROW_BACKENDS = frozenset({
    "FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION", "ROCM_ATTN", "ROCM_AITER_FA",
    "ROCM_AITER_UNIFIED_ATTN", "TRITON_MLA", "FLASHMLA", "FLASH_ATTN_MLA", "FLASHINFER_MLA", "CUTLASS_MLA",
    "ROCM_AITER_MLA"})

__all__ = ["BlockSizeError", "TokenRuns", "TOKEN_ROW_BACKENDS", "attention_backends", "backends_problem",
           "groups_refusal", "sizes_problem", "pair_by_token", "run_segments", "paired_segments",
           "read_segments"]


class BlockSizeError(ValueError):
    """Blocks of these sizes or layouts cannot be paired by token position."""


def attention_backends(vllm_config: Any, layer_names: Iterable[str]) -> list[str]:
    """The names of the attention backends vLLM chose for these layers (its forward
    context, filled once the model is built); [] where none is known (a worker without a
    model, e.g. a tool)."""
    context = getattr(getattr(vllm_config, "compilation_config", None), "static_forward_context", None) or {}
    names = set()
    for name in layer_names:
        backend = getattr(context.get(name), "attn_backend", None)
        if backend is not None and hasattr(backend, "get_name"):
            names.add(str(backend.get_name()))
    return sorted(names)


def backends_problem(backends: Sequence[str]) -> str:
    """Why blocks of these attention backends cannot be paired by token ("" when they can)."""
    if not backends:
        return "its attention backend is not known"
    other = [b for b in backends if b not in TOKEN_ROW_BACKENDS]
    if other:
        return (f"its attention backend {', '.join(other)} does not keep each token as a row of a block (vLLM's CPU "
                "backend packs keys per instruction set)")
    return ""


def groups_refusal(producer_block_size: int, consumer_block_size: int) -> str:
    """Why a model with several KV cache groups is not moved between these block sizes: its
    groups pair blocks group by group at equal positions (kv_groups.py), not by token."""
    return (f"block sizes {producer_block_size} (producer) and {consumer_block_size} (consumer): a model with "
            "several KV cache groups (sliding window, Mamba state) is moved between engines of the same "
            "--block-size only")


def sizes_problem(ours: int, theirs: int) -> str:
    """Why blocks of ``ours`` and ``theirs`` tokens cannot be paired ("" when they can)."""
    if ours <= 0 or theirs <= 0:
        return f"block sizes {ours} and {theirs} must be positive"
    if ours % theirs and theirs % ours:
        return (f"block sizes {ours} and {theirs}: neither divides the other, so a run of tokens would span "
                "two blocks on one side; start the engines with --block-size values that divide one another "
                "(e.g. 32 and 64, or equal)")
    return ""


@dataclass(frozen=True)
class TokenRuns:
    """Runs of ``tokens`` tokens held by both engines: run ``i`` lies in local block
    ``local_ids[i]`` from slot ``local_slot[i]`` and in remote block ``remote_ids[i]``
    from slot ``remote_slot[i]``."""

    local_ids: np.ndarray
    local_slot: np.ndarray
    remote_ids: np.ndarray
    remote_slot: np.ndarray
    tokens: int


def pair_by_token(local_ids: Sequence[int], local_block_size: int, local_first_token: int,
                  remote_ids: Sequence[int], remote_block_size: int, remote_first_token: int) -> TokenRuns:
    """The runs of tokens both block lists hold. ``local_ids[0]`` starts at token
    ``local_first_token`` (a multiple of ``local_block_size``), ``remote_ids[0]`` at
    ``remote_first_token``; the runs cover the tokens both lists cover."""
    why = sizes_problem(local_block_size, remote_block_size)
    if why:
        raise BlockSizeError(why)
    if local_first_token % local_block_size or remote_first_token % remote_block_size or min(
            local_first_token, remote_first_token) < 0:
        raise BlockSizeError(f"first tokens {local_first_token} / {remote_first_token} are not at the start of a "
                             f"block of {local_block_size} / {remote_block_size} tokens")
    m = min(local_block_size, remote_block_size)
    start = max(local_first_token, remote_first_token)
    end = min(local_first_token + len(local_ids) * local_block_size,
              remote_first_token + len(remote_ids) * remote_block_size)
    t = np.arange(start, max(start, end), m, dtype=np.int64)
    lpos, rpos = t - local_first_token, t - remote_first_token
    return TokenRuns(np.asarray(local_ids, np.int64)[lpos // local_block_size], lpos % local_block_size,
                     np.asarray(remote_ids, np.int64)[rpos // remote_block_size], rpos % remote_block_size, m)


def run_segments(layouts: Sequence[kvt.BlockLayout], block_ids: np.ndarray, slots: np.ndarray, run_tokens: int,
                 block_size: int, kv_heads: int, attn_layout: str, first_head: int = 0, num_heads: int = 0
                 ) -> kvt.Segments:
    """One side's byte ranges of the runs (``block_ids`` and ``slots`` of :class:`TokenRuns`)
    in every layer and part of ``layouts`` (whole blocks, not head slices), restricted to
    heads ``[first_head, first_head + num_heads)`` (``num_heads`` 0: all), in the order
    layer, part, run, head: the same on both sides of a transfer."""
    num = num_heads or kv_heads
    if kv_heads <= 0 or not 0 <= first_head < first_head + num <= kv_heads:
        raise BlockSizeError(f"head range [{first_head}, {first_head + num}) outside the {kv_heads} KV heads "
                             "of a block")
    by_token = kv_heads == 1 or attn_layout == TOKENS_OUTER
    if not by_token and attn_layout != HEADS_OUTER:
        raise BlockSizeError(f"a KV layout of {attn_layout or 'unknown'} kind cannot be paired across block sizes "
                             "(tokens must lie in one range per head or per block)")
    if by_token and num != kv_heads:
        raise BlockSizeError("a tokens-outer KV layout cannot move part of its heads (different TP sizes)")
    ids = np.asarray(block_ids, np.int64)
    slot = np.asarray(slots, np.int64)
    out = []
    for lay in layouts:
        if ids.size and (ids.min() < 0 or ids.max() >= lay.num_blocks):
            raise BlockSizeError(f"block ids must lie in [0, {lay.num_blocks}); got {int(ids.min())}..{int(ids.max())}")
        if lay.block_bytes % (kv_heads * block_size):
            raise BlockSizeError(f"a block of {lay.block_bytes} bytes does not split into {kv_heads} heads of "
                                 f"{block_size} tokens")
        per_token = lay.block_bytes // block_size  # bytes of one token, every head
        bases = np.array([b for _, b in lay.parts], np.int64)
        regions = np.array([r.id for r, _ in lay.parts], np.int64)
        start = bases[:, None] + ids[None, :] * lay.block_stride  # [part, run]
        if by_token:
            off = start + slot[None, :] * per_token
            length = run_tokens * per_token
        else:
            per_head = per_token // kv_heads  # bytes of one token of one head
            heads = np.arange(first_head, first_head + num, dtype=np.int64)
            off = (start[:, :, None] + heads[None, None, :] * (block_size * per_head)
                   + slot[None, :, None] * per_head)  # [part, run, head]
            length = run_tokens * per_head
        off = off.reshape(len(bases), -1)
        out.append(kvt.Segments(np.repeat(regions, off.shape[1]), off.reshape(-1).astype(np.uint64), length))
    return kvt.Segments.concat(out)


def paired_segments(local_layouts: Sequence[kvt.BlockLayout], local: LayoutInfo, local_ids: Sequence[int],
                    local_first_token: int, remote_layouts: Sequence[kvt.BlockLayout], remote: LayoutInfo,
                    remote_ids: Sequence[int], remote_first_token: int, local_head: int = 0, remote_head: int = 0,
                    num_heads: int = 0) -> tuple[kvt.Segments, kvt.Segments]:
    """Both sides' byte ranges for the tokens both block lists hold (``num_heads`` heads
    from ``local_head`` / ``remote_head``; 0: whole blocks), described by each side's
    hand-shake :class:`~.messages.LayoutInfo`."""
    runs = pair_by_token(local_ids, local.block_size, local_first_token, remote_ids, remote.block_size,
                         remote_first_token)
    return (run_segments(local_layouts, runs.local_ids, runs.local_slot, runs.tokens, local.block_size,
                         local.kv_heads, local.attn_layout, local_head, num_heads),
            run_segments(remote_layouts, runs.remote_ids, runs.remote_slot, runs.tokens, remote.block_size,
                         remote.kv_heads, remote.attn_layout, remote_head, num_heads))


def read_segments(job: RecvJob, piece: Piece, local_layouts: Sequence[kvt.BlockLayout], local: LayoutInfo,
                  remote_layouts: Sequence[kvt.BlockLayout], remote: LayoutInfo) -> tuple[kvt.Segments, kvt.Segments]:
    """A READ of ``piece`` between engines of different block sizes. The scheduler chose
    the producer's blocks for the block size kv_transfer_params named (``remote_block_ids``
    from the one holding token ``first_token``); the hand-shake must agree, or they would
    be the wrong blocks."""
    theirs, ours = remote.block_size, local.block_size
    if job.remote_block_size != theirs:
        said = (f"kv_transfer_params said {job.remote_block_size}" if job.remote_block_size != ours else
                "kv_transfer_params did not say it (remote_block_size), so the load was planned for equal "
                "block sizes")
        raise BlockSizeError(f"the producer's block size is {theirs}, this engine's {ours}, and {said}; forward "
                             "remote_block_size through the router, or start both engines with the same --block-size")
    if job.group_sizes:
        raise BlockSizeError(groups_refusal(theirs, ours))
    return paired_segments(local_layouts, local, job.local_block_ids, job.first_token, remote_layouts, remote,
                           job.remote_block_ids, job.first_token // theirs * theirs, piece.local_head,
                           piece.remote_head, piece.num_heads)
