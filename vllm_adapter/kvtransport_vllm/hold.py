"""One producer-side hold (:mod:`.producer`): a finished prefill's blocks kept for its
consumer under a lease, where its WRITE goes (:class:`Dest`), how far that write has got
(:class:`HoldState`), and which consumer ranks are done with it.

The state changes and the invariant they keep (a hold whose write may be in flight is
never ended nor acknowledged) are the producer's; this module is the record it changes.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Dest", "HoldState", "Hold"]


@dataclass(frozen=True)
class Dest:
    """Where a WRITE goes: a consumer rank's blocks (and, across TP sizes, which of our
    heads land at which of its heads; ``num_heads`` 0: whole blocks)."""

    engine: str
    block_ids: list[int]
    host: str
    port: int
    rank: int = -1
    src_head: int = 0
    dst_head: int = 0
    num_heads: int = 0
    readers: int = 1  # consumer ranks the hold serves (several when their TP is larger)
    group_sizes: list[int] = field(default_factory=list)  # hybrid: ids per KV cache group
    load: str = ""  # the consumer's load these blocks belong to (WriteReq.load)
    first_token: int = 0  # the token block_ids[0] starts at (WriteReq.first_token)


class HoldState(enum.Enum):
    HELD = "held"  # blocks kept for the consumer; no write (READ mode: always)
    POSTING = "posting"  # WRITE: the engine thread is inside agent.write, lock released
    POSTED = "posted"  # WRITE: the write is in flight (or failed, not yet quiesced: T3)
    NOTIFY = "notify"  # WRITE: the write has ended; "written" sent until the consumer acks


@dataclass
class Hold:
    req_id: str
    key: str
    block_ids: list[int]
    expiry: float
    dest: Dest | None = None
    state: HoldState = HoldState.HELD
    write: Any = None
    write_ok: bool = False
    write_reason: str = ""
    notify_cid: int = 0
    #: every "written" sent for the current destination: a reply to any of them is its
    #: consumer's word (resent every 50 ms, so under load the reply to the latest one may
    #: never come first; with several destinations the next write waits for that word)
    notify_cids: set[int] = field(default_factory=set)
    last_sent: float = 0.0
    posted_at: float = 0.0  # WRITE: when the write was posted (its transfer time)
    #: when the hold began (monotonic): the prefill's KV is complete; WRITE's time after the
    #: prefill runs from here to the write's end (``write_after_prefill_s``)
    held_at: float = 0.0
    #: consumer ranks this hold waits for (several read from us when their TP is larger)
    readers: int = 1
    #: consumer rank -> how it finished with us ("done", "released"); ended when all have
    finished: dict[int, str] = field(default_factory=dict)
    #: WRITE: further consumer ranks' destinations, written one after another
    queue: list[Dest] = field(default_factory=list)
    #: READ: the loads (``Done.load``) we answered "ok" while holding the blocks
    confirmed_by: set[str] = field(default_factory=set)
    group_sizes: list[int] = field(default_factory=list)  # hybrid: ids per KV cache group

    def finish_reader(self, rank: int, how: str, readers: int) -> bool:
        """Consumer ``rank`` is done with us; True when every expected reader is."""
        self.readers = max(self.readers, readers)
        self.finished.setdefault(rank, how)
        self.queue = [d for d in self.queue if d.rank != rank]
        return len(self.finished) >= self.readers

    @property
    def write_in_flight(self) -> bool:
        """A write may still land in the consumer's blocks (and reads ours)."""
        return self.state in (HoldState.POSTING, HoldState.POSTED)
