"""Mamba2 state across TP sizes: which bytes of a producer rank's state page a consumer rank needs.

Pure arithmetic on :class:`StateGeometry` (no vLLM, no I/O), so it can be checked exhaustively.

vLLM's Mamba2 layer shards its per-request state over TP ranks by Mamba head:

* the SSM state ``(heads, head_dim, state)``: heads outermost, rank ``r`` of ``tp`` holds the
  global heads ``[r*H/tp, (r+1)*H/tp)``;
* the conv state: the rank's channels of the convolution input, ``[x | B | C]``: ``x`` is the
  rank's heads times ``head_dim`` channels, ``B`` and ``C`` the rank's groups times ``state``
  channels each. vLLM requires ``n_groups`` to be 1 or a multiple of ``tp``; with 1 group and
  ``tp > 1`` every rank holds that group (replicated). Either way a rank holds exactly the
  groups of its heads. vLLM stores it as ``(width, channels)`` (its default) or
  ``(channels, width)``; ``width`` is the conv kernel minus one.

A consumer rank's Mamba heads come in pieces from the producer ranks holding them: the
same producer ranks, in the same proportions, as its attention heads when no attention
head is replicated (:func:`resplit_problem` refuses the other case), so the attention
pieces of :mod:`.tp_mapping` are converted (:func:`mamba_heads`). A piece brings the x
channels and SSM state of its heads, and each group whose first head (on the consumer rank)
it holds, so every group is taken exactly once.

Each piece is a list of byte ranges inside one state page, the same on both sides in
number, order and length (:func:`state_ranges`); the worker turns each into a block layout
of its own (:func:`cut_layouts`), so segments stay vectorised over blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import msgspec

import kvtransport as kvt

__all__ = ["StateGeometry", "MAMBA2", "resplit_problem", "mamba_heads", "state_ranges", "state_cuts", "cut_layouts"]

#: the state kind whose TP split this module knows (vLLM's MambaAttentionBackendEnum name, lower case)
MAMBA2 = "mamba2"


class StateGeometry(msgspec.Struct, frozen=True):
    """One rank's Mamba state inside its page (every state layer of the model alike),
    advertised in the hand-shake. ``kind`` other than :data:`MAMBA2`: only ``kind`` is
    known and the state moves between engines of the same TP size only."""

    kind: str
    heads: int = 0  # Mamba heads on this rank
    total_heads: int = 0
    head_dim: int = 0
    groups: int = 0  # B/C groups on this rank (a replicated group counts on each rank)
    state_size: int = 0
    conv_width: int = 0
    conv_dim_first: bool = False  # (channels, width) instead of vLLM's default (width, channels)
    conv_offset: int = 0  # bytes from the page's start
    conv_item: int = 0  # bytes per element
    ssm_offset: int = 0
    ssm_item: int = 0
    conv_dtype: str = ""  # e.g. "torch.bfloat16": equal sizes are not equal types
    ssm_dtype: str = ""

    @property
    def x_channels(self) -> int:
        return self.heads * self.head_dim

    @property
    def conv_channels(self) -> int:
        return self.x_channels + 2 * self.groups * self.state_size


def resplit_problem(ours: StateGeometry | None, peer: StateGeometry | None, tp: tuple[int, int],
                    kv_heads: tuple[int, int]) -> str:
    """Why the state cannot move between ranks of TP sizes ``tp`` (ours, peer) holding
    ``kv_heads`` attention heads each ("" when it can)."""
    if ours is None and peer is None:
        return ""
    if ours is None or peer is None:
        return ("one side did not describe its Mamba / SSM state (another model, or a kvtransport before state "
                "re-splitting); serve the same model with the same kvtransport version on both engines, or use "
                "equal TP sizes")
    kinds = {ours.kind, peer.kind}
    if kinds != {MAMBA2}:
        other = ", ".join(sorted(kinds - {MAMBA2}))
        return (f"the {other} state of this model is moved between engines of the same TP size only (its split "
                "over TP ranks is known for Mamba2 layers only); use equal TP sizes")
    for name in ("total_heads", "head_dim", "state_size", "conv_width", "conv_dim_first", "conv_item", "ssm_item",
                 "conv_dtype", "ssm_dtype"):
        a, b = getattr(ours, name), getattr(peer, name)
        if a != b:
            return f"Mamba state {name}: {a!r} vs {b!r}; serve the same model with the same dtypes on both engines"
    if min(kv_heads) < 1 or any(h * t != kv_heads[0] * tp[0] for h, t in zip(kv_heads, tp)):
        return (f"the attention heads are replicated over the TP ranks ({kv_heads[0]} per rank at TP {tp[0]}, "
                f"{kv_heads[1]} at TP {tp[1]}), so the ranks that send a consumer rank its attention heads do "
                "not hold all of its Mamba heads; use TP sizes up to the model's KV head count, or equal TP sizes")
    for g, t in ((ours, tp[0]), (peer, tp[1])):
        if g.heads * t != g.total_heads or g.groups < 1 or g.heads % g.groups:
            return f"Mamba state of {g.heads} heads and {g.groups} groups per rank at TP {t}: not vLLM's split"
    return ""


def mamba_heads(first: int, num: int, kv_heads: int, geom: StateGeometry) -> tuple[int, int]:
    """Attention heads ``[first, first + num)`` of a rank's ``kv_heads`` as that rank's Mamba
    heads: the same share of the rank (exact, :func:`resplit_problem` having passed)."""
    lo, hi = first * geom.heads, (first + num) * geom.heads
    if lo % kv_heads or hi % kv_heads:
        raise ValueError(f"attention heads [{first}, {first + num}) of {kv_heads} are not a whole number of the "
                         f"rank's {geom.heads} Mamba heads")
    return lo // kv_heads, (hi - lo) // kv_heads


def _spans(g: StateGeometry, first: int, num: int, groups: Sequence[int]) -> list[tuple[int, int]]:
    """(first channel, channels) of the conv state this side moves: the heads' x channels,
    then each group's B channels, then its C channels."""
    s = g.state_size
    return ([(first * g.head_dim, num * g.head_dim)] + [(g.x_channels + j * s, s) for j in groups]
            + [(g.x_channels + (g.groups + j) * s, s) for j in groups])


def _byte_ranges(g: StateGeometry, first: int, num: int, groups: Sequence[int]) -> list[tuple[int, int]]:
    """(offset in the page, bytes) of the conv channels (row by row, or channel-major) and the
    SSM state of heads ``[first, first + num)`` and ``groups``, in the order both sides use."""
    out: list[tuple[int, int]] = []
    spans = _spans(g, first, num, groups)
    if g.conv_dim_first:  # (channels, width): a channel run is one range
        out += [(g.conv_offset + c * g.conv_width * g.conv_item, n * g.conv_width * g.conv_item) for c, n in spans]
    else:  # (width, channels): a channel run is one range per row
        row = g.conv_channels * g.conv_item
        out += [(g.conv_offset + k * row + c * g.conv_item, n * g.conv_item)
                for k in range(g.conv_width) for c, n in spans]
    head = g.head_dim * g.state_size * g.ssm_item
    out.append((g.ssm_offset + first * head, num * head))
    return out


def state_ranges(consumer: StateGeometry, producer: StateGeometry, c_first: int, p_first: int,
                 num: int) -> list[tuple[int, int, int]]:
    """(consumer offset, producer offset, bytes) inside one state page for the piece that
    brings the consumer rank its Mamba heads ``[c_first, c_first + num)`` from the producer
    rank's heads ``[p_first, p_first + num)``."""
    c_per, p_per = consumer.heads // consumer.groups, producer.heads // producer.groups
    # the consumer's groups whose first head this piece brings, and where they are on the producer
    c_groups = [j for j in range(consumer.groups) if c_first <= j * c_per < c_first + num]
    p_groups = [(p_first + j * c_per - c_first) // p_per for j in c_groups]
    c = _byte_ranges(consumer, c_first, num, c_groups)
    p = _byte_ranges(producer, p_first, num, p_groups)
    if [n for _, n in c] != [n for _, n in p]:  # pragma: no cover - resplit_problem checked the geometry
        raise ValueError(f"Mamba state pieces differ in size: {c} vs {p}")
    return [(co, po, n) for (co, n), (po, _) in zip(c, p)]


class RankLayout(Protocol):
    """What :func:`state_cuts` reads of a side's :class:`~.messages.LayoutInfo` (which
    imports this module, so it is not imported here)."""

    @property
    def tp_size(self) -> int: ...

    @property
    def kv_heads(self) -> int: ...

    @property
    def state(self) -> StateGeometry | None: ...


def state_cuts(local: RankLayout | None, remote: RankLayout | None, local_first: int, remote_first: int, num: int,
               local_is_consumer: bool) -> tuple[list[tuple[int, int]], list[tuple[int, int]]] | None:
    """The (offset, bytes) cuts of a state page on the local and the remote side for the
    piece of attention heads ``[local_first, local_first + num)`` (local) and
    ``[remote_first, ...)`` (remote); None when the pages move whole (no state, equal TP)."""
    if local is None or remote is None or local.state is None or remote.state is None \
            or local.tp_size == remote.tp_size:
        return None
    cons, prod = (local, remote) if local_is_consumer else (remote, local)
    c_kv, p_kv = (local_first, remote_first) if local_is_consumer else (remote_first, local_first)
    c_first, n = mamba_heads(c_kv, num, cons.kv_heads, cons.state)
    p_first, _ = mamba_heads(p_kv, num, prod.kv_heads, prod.state)
    ranges = state_ranges(cons.state, prod.state, c_first, p_first, n)
    c_cuts, p_cuts = [(c, m) for c, _, m in ranges], [(p, m) for _, p, m in ranges]
    return (c_cuts, p_cuts) if local_is_consumer else (p_cuts, c_cuts)


def cut_layouts(layouts: Sequence[kvt.BlockLayout], sliced: Sequence[kvt.BlockLayout], layer_group: Sequence[int],
                state_layers: frozenset[int], cuts: Sequence[tuple[int, int]]) -> tuple[list[kvt.BlockLayout],
                                                                                       list[int]]:
    """The layers of one side for one piece: ``sliced`` (the attention layers' head slices)
    with each state layer of ``layouts`` replaced by one layout per ``(offset, bytes)`` cut of
    its page, and the KV cache group of each resulting layout."""
    out: list[kvt.BlockLayout] = []
    groups: list[int] = []
    for i, (whole, part) in enumerate(zip(layouts, sliced)):
        g = layer_group[i] if layer_group else 0
        if i not in state_layers:
            out.append(part)
            groups.append(g)
            continue
        for off, n in cuts:
            out.append(kvt.BlockLayout([(r, b + off) for r, b in whole.parts], n, whole.num_blocks,
                                       whole.block_stride))
            groups.append(g)
    return out, groups
