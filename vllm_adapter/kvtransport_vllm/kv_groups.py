"""KV cache groups of hybrid models: which blocks of which group are moved.

vLLM's hybrid KV cache manager gives each kind of attention layer its own KV cache group
with its own block ids: full-attention layers keep a block for every block of the prompt;
sliding-window layers need only the blocks that hold the last ``window`` tokens and vLLM
replaces the others by its null block (id 0). The connector therefore carries block ids
per group, pairs the producer's and the consumer's blocks group by group at the same
token positions, moves only the in-window tail of a sliding-window group, and never
moves a null block.

On the wire and in the worker metadata the ids of all groups travel as one flat list plus
``group_sizes`` (how many ids belong to each group, in group order). A model with one
group has ``group_sizes == []`` and is handled exactly as before.

Only the groups vLLM marks transferable are moved (``KVCacheConfig.transfer_group_ids``
where the attribute exists; every group otherwise): a group vLLM rebuilds from another one
after a connector load (``enable_kv_transfer=False``) is neither registered nor paired, and
:class:`GroupInfo` keeps each moved group's index in vLLM's group order so the per-group
block ids vLLM hands over can be selected (:func:`select`).

A Mamba / SSM state group (:mod:`.ssm_state`) holds one state block per request instead
of one block per block of tokens: its blocks are paired in order, never by position, and
never sliced by a local prefix hit (``GroupInfo.state``).

Other group kinds that are not per-token KV blocks (chunked local attention, cross
attention, ...) cannot be moved as blocks correctly and are refused at start
(:func:`check_group_kinds`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from . import ssm_state

NULL_BLOCK = 0  # vLLM's BlockPool reserves block 0 as the null block

__all__ = ["NULL_BLOCK", "GroupInfo", "group_infos", "check_group_kinds", "transfer_group_ids", "select",
           "flatten", "split", "pair_by_position", "clip_windows", "align_tails"]


@dataclass(frozen=True)
class GroupInfo:
    """One KV cache group as the connector sees it."""

    layers: tuple[str, ...]
    #: blocks a sliding-window group needs at the end of a sequence (0: every block)
    window_blocks: int = 0
    #: the group's index in vLLM's ``kv_cache_groups`` (its block ids' index in what vLLM
    #: hands the connector)
    index: int = 0
    #: a Mamba / SSM state group: one state block per request, not blocks of tokens
    state: bool = False


def _kind_name(spec: Any) -> str:
    return type(spec).__name__


def transfer_group_ids(kv_cache_config: Any) -> tuple[int, ...]:
    """The indexes of the groups to move: vLLM's ``transfer_group_ids`` where the config has
    it (groups with ``enable_kv_transfer``), else every group."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    ids = getattr(kv_cache_config, "transfer_group_ids", None)
    return tuple(int(i) for i in ids) if ids is not None else tuple(range(len(groups)))


def _transfer_groups(kv_cache_config: Any) -> list[tuple[int, Any]]:
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    return [(i, groups[i]) for i in transfer_group_ids(kv_cache_config)]


def select(per_group: Sequence[Sequence[int]], groups: Sequence[GroupInfo]) -> list[list[int]]:
    """The block ids of the moved groups out of vLLM's ids of every group (no group info:
    all of them)."""
    if not groups:
        return [list(ids) for ids in per_group]
    return [list(per_group[g.index]) for g in groups]


def check_group_kinds(kv_cache_config: Any) -> list[str]:
    """Refusals for groups whose spec cannot be moved as per-token KV blocks ("" list: ok)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    try:
        from vllm.v1.kv_cache_interface import MLAAttentionSpec
    except ImportError:  # pragma: no cover - older vLLM
        MLAAttentionSpec = FullAttentionSpec  # noqa: N806
    movable = (FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec)
    errors = []
    for _, g in _transfer_groups(kv_cache_config):
        spec = g.kv_cache_spec
        layers = f"{', '.join(g.layer_names[:4])}{', ...' if len(g.layer_names) > 4 else ''}"
        if ssm_state.is_state_spec(spec):
            errors += ssm_state.refusals(spec, layers)
        elif type(spec) not in movable:
            errors.append(f"{_kind_name(spec)} (layers {layers})")
    return errors


def group_infos(kv_cache_config: Any) -> list[GroupInfo]:
    """The groups of ``kv_cache_config`` to move, in vLLM's group order (empty: no config)."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    out = []
    for index, g in _transfer_groups(kv_cache_config):
        spec = g.kv_cache_spec
        window = 0
        if isinstance(spec, SlidingWindowSpec) and spec.sliding_window:
            # the window's tokens span at most ceil(window / block) + 1 blocks
            window = -(-int(spec.sliding_window) // int(spec.block_size)) + 1
        out.append(GroupInfo(tuple(g.layer_names), window, index, ssm_state.is_state_spec(spec)))
    return out


def flatten(per_group: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """(flat ids, group sizes); one group: (its ids, [])."""
    if len(per_group) <= 1:
        return (list(per_group[0]) if per_group else []), []
    flat: list[int] = []
    for ids in per_group:
        flat += [int(b) for b in ids]
    return flat, [len(ids) for ids in per_group]


def split(flat: Sequence[int], sizes: Sequence[int]) -> list[list[int]]:
    """Inverse of :func:`flatten` (``sizes == []``: one group)."""
    if not sizes:
        return [list(flat)]
    if sum(sizes) != len(flat):
        raise ValueError(f"group sizes {list(sizes)} do not add up to {len(flat)} block ids")
    out, at = [], 0
    for n in sizes:
        out.append(list(flat[at:at + n]))
        at += n
    return out


def _drop_null_pairs(a: list[int], b: list[int]) -> tuple[list[int], list[int]]:
    keep = [i for i in range(len(a)) if a[i] != NULL_BLOCK and b[i] != NULL_BLOCK]
    if len(keep) == len(a):
        return a, b
    return [a[i] for i in keep], [b[i] for i in keep]


def _window_tail(ids: Sequence[int], g: int, groups: Sequence[GroupInfo]) -> list[int]:
    """Group ``g``'s blocks that can be moved: a sliding-window group's in-window tail, else all."""
    w = groups[g].window_blocks if g < len(groups) else 0
    return list(ids[-w:]) if w else list(ids)


def pair_by_position(local: Sequence[Sequence[int]], remote: Sequence[Sequence[int]], first: int,
                     groups: Sequence[GroupInfo]) -> tuple[list[list[int]], list[list[int]]]:
    """READ: for every group, the (local, remote) blocks at the same positions from block
    ``first`` (the first block not cached locally) to the end of the shorter list, the
    tail of a sliding-window group only, pairs with a null block on either side dropped."""
    out_l, out_r = [], []
    for g, (lo, re) in enumerate(zip(local, remote)):
        if g < len(groups) and groups[g].state:  # one state block per request: in order
            n = min(len(lo), len(re))
            lo, re = _drop_null_pairs(list(lo[:n]), list(re[:n]))
            out_l.append(lo)
            out_r.append(re)
            continue
        lo, re = list(lo[first:]), list(re[first:])
        n = min(len(lo), len(re))
        lo, re = _drop_null_pairs(_window_tail(lo[:n], g, groups), _window_tail(re[:n], g, groups))
        out_l.append(lo)
        out_r.append(re)
    return out_l, out_r


def clip_windows(per_group: Sequence[Sequence[int]], groups: Sequence[GroupInfo], first: int = 0) -> list[list[int]]:
    """WRITE, consumer side: the blocks to be written from block ``first`` (the first not
    cached locally), a sliding-window group's tail only, a state group's state block(s)."""
    return [[b for b in ids if b != NULL_BLOCK] if g < len(groups) and groups[g].state
            else _window_tail(ids[first:], g, groups) for g, ids in enumerate(per_group)]


def align_tails(src: Sequence[Sequence[int]], dst: Sequence[Sequence[int]]) -> tuple[list[list[int]], list[list[int]]] | str:
    """WRITE, producer side: pair each group's destination blocks with the producer's
    blocks at the same positions (both lists end at the prompt's last block), dropping
    pairs with a null block; a message instead when they cannot be paired."""
    if len(src) != len(dst):
        return f"consumer sent block ids for {len(dst)} KV cache groups, producer has {len(src)}"
    out_s, out_d = [], []
    for g, (s, d) in enumerate(zip(src, dst)):
        if len(d) > len(s):
            return f"consumer asked for {len(d)} blocks of group {g}, producer has {len(s)}"
        s2, d2 = _drop_null_pairs(list(s[len(s) - len(d):]), list(d))
        out_s.append(s2)
        out_d.append(d2)
    return out_s, out_d
