"""One consumer rank's load of one request, and its pieces (one per producer TP rank).

With equal TP sizes a load has one piece: all heads, from the producer rank of our rank.
With different TP sizes (:mod:`.tp_mapping`) it has one piece per producer rank holding
some of our heads; each piece has its own transfer (READ), its own "written" (WRITE), and
its own confirmation / cancel exchange, matched by the exchange's ``cid``. The load's
state (:class:`RecvState`) is one for all pieces: it moves on when every piece has, and
fails as a whole when any piece fails (docs/LIFECYCLE.md, per-piece rules).
"""

from __future__ import annotations

import enum
import secrets
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import kvtransport as kvt

from .load_stats import Cause, LoadClock
from .messages import RecvJob
from .tp_mapping import Piece

__all__ = ["RecvState", "PieceLoad", "Recv", "WANTS", "READ_END_GRACE_S"]


class RecvState(enum.Enum):
    CONNECT = "connect"  # hand-shaking with the producer ranks
    READ = "read"  # READs posted
    CONFIRM = "confirm"  # bytes read; asking each producer rank "done with key?"
    WRITE_WAIT = "write_wait"  # asked the producer ranks to write; waiting for every "written"
    CANCEL = "cancel"  # gave up after asking for a write: waiting for every producer rank's ack
    FINISHED = "finished"  # reported to vLLM (done_recving); blocks may be reused


#: states in which the consumer still wants the key: its lease is renewed
WANTS = (RecvState.CONNECT, RecvState.READ, RecvState.CONFIRM, RecvState.WRITE_WAIT)
#: how long after a read ended the engine thread leaves its confirmation to a running read
#: confirmer (which takes it within microseconds); past it the engine thread confirms
READ_END_GRACE_S = 0.05


@dataclass
class PieceLoad:
    """The part of a load that one producer rank serves."""

    piece: Piece
    port: int  # that producer rank's side-channel port
    readers: int  # consumer ranks the producer rank waits for before freeing the blocks
    transfer: Any = None  # READ
    instance: str = ""  # READ: producer agent instance the bytes were read from
    answer: str = ""  # the producer rank's last verdict ("ok", "acked", ...)
    written: bool | None = None  # WRITE: this producer rank's "written" verdict
    #: when this producer rank last answered about the key (monotonic; 0: never): a rank
    #: that answers is reachable, so its silence, not the deadline, starts "considered gone"
    heard: float = 0.0
    #: WRITE: the producer process the write request reached (None: sent while the
    #: hand-shake was not complete, so the receiving process is unknown)
    writers: list = field(default_factory=list)
    #: cids of this piece's recent messages: a reply to any of them shows the producer rank
    #: is reachable (``heard``), though only the latest one's verdict is acted on. Why: we
    #: resend every 50 ms, and a loaded producer answering each message 60 ms later would
    #: otherwise never count as heard, and be "considered gone" with its write in flight
    recent_cids: deque = field(default_factory=lambda: deque(maxlen=256))

    @property
    def cid(self) -> int:
        """The last confirmation / write request / cancel sent for this piece (0: none)."""
        return self.recent_cids[-1] if self.recent_cids else 0

    def sent(self, cid: int) -> None:
        """Record the cid of a message just sent about this piece."""
        self.recent_cids.append(cid)


@dataclass
class Recv:
    job: RecvJob
    deadline: float
    started: float
    state: RecvState = RecvState.CONNECT
    #: names this load in its confirmations (``Done.load``)
    token: str = field(default_factory=lambda: secrets.token_hex(8))
    pieces: list[PieceLoad] = field(default_factory=list)
    #: producer ranks nobody reads (replicas read elsewhere) we tell to free at once:
    #: port -> readers (1); sent once, at the first CONNECT step
    releases: dict[int, int] = field(default_factory=dict)
    released_unread: bool = False
    last_sent: float = 0.0
    error: str = ""
    aborted: bool = False  # vLLM finished the request (abort) while loading
    peer_aborted: bool = False
    write_requested: bool = False
    post_failed: bool = False  # READ: a piece's post was refused after another was posted
    clock: LoadClock | None = None  # moments of this load, for its phase timings
    cause: Cause = Cause.OK  # why it failed (the first cause named wins)

    def fail(self, cause: Cause, error: str, first: bool = False) -> None:
        """Name why this load fails; ``first``: keep an earlier reason if there is one."""
        if first and self.error:
            return
        self.cause, self.error = cause, error

    def reads_done_at(self) -> float | None:
        """READ: when the last posted read was seen to end (monotonic), if every one ended DONE
        (the loads a confirmation is due for); None otherwise."""
        ts = [pc.transfer for pc in self.pieces if pc.transfer is not None]
        if not ts or any(t.last_status.state is not kvt.State.DONE for t in ts):
            return None
        return max(t.finished_at for t in ts)

    def piece_by_cid(self, cid: int) -> PieceLoad | None:
        """The piece one of whose recent messages had this cid (its latest, or a late one)."""
        return next((pc for pc in self.pieces if cid in pc.recent_cids), None)

    @property
    def transfer(self) -> Any:
        """READ: the first piece's transfer (the only one with equal TP sizes)."""
        return self.pieces[0].transfer if self.pieces else None

    @property
    def written(self) -> bool | None:
        """WRITE: True once every piece was written, False if any write failed, else None."""
        verdicts = [pc.written for pc in self.pieces]
        if any(v is False for v in verdicts):
            return False
        return True if verdicts and all(verdicts) else None

    @property
    def silent_since(self) -> float:
        """WRITE cancel: since when every producer rank that has not acknowledged it is
        silent -- its last answer about the key, or the load's deadline if later."""
        return max([self.deadline] + [pc.heard for pc in self.pieces if pc.answer != "acked"])

    @property
    def writers(self) -> list:
        return [w for pc in self.pieces for w in pc.writers]

    def writers_gone(self, peer_alive: Callable[[Any], bool | None]) -> bool:
        """WRITE: every producer process still unacknowledged that may write to us has exited."""
        open_ = [w for pc in self.pieces if pc.answer != "acked" for w in pc.writers]
        return bool(open_) and all(w is not None and peer_alive(w) is False for w in open_)
