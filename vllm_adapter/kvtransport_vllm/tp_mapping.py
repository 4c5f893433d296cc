"""Which prefill (producer) TP rank holds which KV heads a decode (consumer) TP rank needs.

Pure arithmetic, no vLLM and no I/O, so it can be checked exhaustively.

vLLM splits the ``H`` KV heads of a layer over ``tp`` ranks in order: with ``H >= tp``
rank ``r`` holds heads ``[r*H/tp, (r+1)*H/tp)``; with ``H < tp`` (replicated heads, and
MLA's single latent "head") each head is held by ``tp/H`` consecutive ranks and rank
``r`` holds head ``r // (tp/H)`` (``QKVParallelLinear``'s replica rule). Either way ``H``
and ``tp`` must divide one another.

For a consumer rank ``c`` the heads it holds are split into :class:`Piece` s: runs of
consecutive heads that one producer rank holds, with where they start in each side's
cache. When several producer ranks hold a head (replicated), the consumer ranks that
need it take them in turn (``i``-th reader of a head reads from the ``i mod n``-th
holder), so reads spread over the producer ranks; MLA is the case ``H = 1``.

A producer rank nobody reads from (its heads are replicas fetched elsewhere) still holds
the request's blocks: :func:`releaser` names the one consumer rank that tells it to free
them at once, and :func:`readers` how many consumer ranks a producer rank must hear
from (confirm or release) before it frees them.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TPMappingError", "Piece", "heads_of", "holders", "consumer_pieces", "readers", "releaser",
           "producer_ranks_of", "check_mapping"]


class TPMappingError(ValueError):
    """The KV heads cannot be split over these TP sizes (or a rank is out of range)."""


@dataclass(frozen=True)
class Piece:
    """Heads ``[local_head, local_head + num_heads)`` of a consumer rank's cache come from
    heads ``[remote_head, remote_head + num_heads)`` of producer rank ``producer_rank``'s
    cache (offsets count heads inside each rank's own cache)."""

    producer_rank: int
    local_head: int
    remote_head: int
    num_heads: int


def check_mapping(total_heads: int, tp: int, what: str = "TP") -> None:
    """Refuse a head count that ``tp`` ranks cannot share evenly, naming both and the fix."""
    if total_heads < 1 or tp < 1:
        raise TPMappingError(f"{what} size {tp} and {total_heads} KV heads: both must be >= 1")
    if total_heads % tp and tp % total_heads:
        raise TPMappingError(
            f"{what} size {tp} does not split {total_heads} KV heads evenly (neither divides the other); "
            f"use a tensor-parallel size that divides {total_heads} or is a multiple of it")


def _check_rank(tp: int, rank: int) -> None:
    if not 0 <= rank < tp:
        raise TPMappingError(f"rank {rank} out of range for TP size {tp}")


def heads_of(total_heads: int, tp: int, rank: int) -> range:
    """The global KV heads TP rank ``rank`` of ``tp`` holds."""
    check_mapping(total_heads, tp)
    _check_rank(tp, rank)
    if total_heads >= tp:
        per = total_heads // tp
        return range(rank * per, (rank + 1) * per)
    head = rank // (tp // total_heads)
    return range(head, head + 1)


def holders(total_heads: int, tp: int, head: int) -> range:
    """The TP ranks of ``tp`` that hold global head ``head`` (several when replicated)."""
    check_mapping(total_heads, tp)
    if not 0 <= head < total_heads:
        raise TPMappingError(f"head {head} out of range for {total_heads} KV heads")
    if total_heads >= tp:
        r = head // (total_heads // tp)
        return range(r, r + 1)
    rep = tp // total_heads
    return range(head * rep, (head + 1) * rep)


def consumer_pieces(total_heads: int, p: int, d: int, c: int) -> list[Piece]:
    """What consumer rank ``c`` (of TP ``d``) loads from a producer of TP ``p``, in head order."""
    check_mapping(total_heads, p, "prefill TP")
    check_mapping(total_heads, d, "decode TP")
    mine = heads_of(total_heads, d, c)
    pieces: list[Piece] = []
    for h in mine:
        cands = holders(total_heads, p, h)
        i = list(holders(total_heads, d, h)).index(c)  # c is the i-th consumer rank needing h
        q = cands[i % len(cands)]
        local, remote = h - mine.start, h - heads_of(total_heads, p, q).start
        last = pieces[-1] if pieces else None
        if (last is not None and last.producer_rank == q and last.local_head + last.num_heads == local
                and last.remote_head + last.num_heads == remote):
            pieces[-1] = Piece(q, last.local_head, last.remote_head, last.num_heads + 1)
        else:
            pieces.append(Piece(q, local, remote, 1))
    return pieces


def readers(total_heads: int, p: int, d: int, q: int) -> list[int]:
    """The consumer ranks that read from producer rank ``q`` (possibly none)."""
    _check_rank(p, q)
    return [c for c in range(d) if any(pc.producer_rank == q for pc in consumer_pieces(total_heads, p, d, c))]


def releaser(total_heads: int, p: int, d: int, q: int) -> int | None:
    """The consumer rank that frees producer rank ``q`` at once because nobody reads from
    it (``q mod d``: spread over consumer ranks); None when some consumer rank reads it."""
    if readers(total_heads, p, d, q):
        return None
    return q % d


def producer_ranks_of(total_heads: int, p: int, d: int, c: int) -> dict[int, int]:
    """Every producer rank consumer rank ``c`` must speak to about a request, with the
    number of consumer ranks that producer rank waits for (``readers``, or 1 for a rank
    ``c`` only releases): the ranks of ``c``'s pieces, then those ``c`` releases."""
    out = {pc.producer_rank: len(readers(total_heads, p, d, pc.producer_rank))
           for pc in consumer_pieces(total_heads, p, d, c)}
    for q in range(p):
        if q not in out and releaser(total_heads, p, d, q) == c:
            out[q] = 1
    return out
