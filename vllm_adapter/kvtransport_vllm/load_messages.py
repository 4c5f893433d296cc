"""What a consumer rank says to the producer ranks about one load, piece by piece.

Every message names our TP rank and how many consumer ranks the producer rank waits for
(``readers``, from :mod:`.tp_mapping`), so a producer rank read by several consumer
ranks frees its blocks only when all of them confirmed or released. Confirmations, write
requests and cancels go on the hand-shaken connection of the piece's producer rank and
record their ``cid`` in the piece (its reply is matched to it); releases need no
hand-shake and go on the plain client to that rank's port.
"""

from __future__ import annotations

from collections.abc import Callable

from .context import WorkerContext
from .messages import Cancel, Done, Release, WriteReq
from .producer_peers import ProducerPeers
from .recv import Recv
from .side_channel import SideChannelClient
from .tp_mapping import Piece, TPMappingError, consumer_pieces, producer_ranks_of

__all__ = ["LoadMessages", "plan_ranks"]


def plan_ranks(ctx: WorkerContext, remote_tp: int) -> tuple[list[Piece], dict[int, int]]:
    """Our pieces of a load from a producer of TP ``remote_tp`` (0: ours) and every
    producer rank we must speak to about it, with the readers it waits for. Equal TP
    sizes: one piece of all heads from the producer rank of our rank. Raises
    :class:`TPMappingError` when the heads cannot be mapped."""
    d, c = max(1, ctx.tp_size), ctx.tp_rank
    p = remote_tp or d
    heads = ctx.layout.total_kv_heads if ctx.layout is not None else 0
    if p == d:
        n = ctx.layout.kv_heads if ctx.layout is not None else 0
        return [Piece(c, 0, 0, n)], {c: 1}
    if heads <= 0:
        raise TPMappingError(f"producer TP size {p} differs from ours ({d}) but our KV head count is not known")
    return consumer_pieces(heads, p, d, c), producer_ranks_of(heads, p, d, c)


class LoadMessages:
    """Sends a load's per-piece messages (engine thread)."""

    def __init__(self, ctx: WorkerContext, peers: ProducerPeers) -> None:
        self.ctx, self.peers = ctx, peers

    def release_unread(self, r: Recv) -> None:
        """Free the producer ranks nobody reads from (replicas read elsewhere), at once."""
        if r.released_unread or not r.releases:
            return
        r.released_unread = True
        for port, readers in r.releases.items():
            self.ctx.client_to(r.job.host, port).send(Release(keys=[r.job.key], rank=self.ctx.tp_rank,
                                                               readers=readers))

    def confirm(self, r: Recv, now: float, client_to: Callable[[str, int], SideChannelClient] | None = None) -> None:
        """"Done with key?" to every producer rank of ``r`` not yet ``ok``; on the hand-shaken
        connections unless ``client_to`` gives another thread's clients (the read confirmer's)."""
        for pc in r.pieces:
            if pc.answer != "ok":
                client = (client_to or self._handshaken)(r.job.host, pc.port)
                pc.sent(client.send(Done(keys=[r.job.key], instance=pc.instance, rank=self.ctx.tp_rank,
                                         readers=pc.readers, load=r.token)))
        r.last_sent = now

    def _handshaken(self, host: str, port: int) -> SideChannelClient:
        return self.peers.get(host, port).client

    def write_req(self, r: Recv, now: float) -> None:
        ours = self.ctx.layout.kv_heads if self.ctx.layout is not None else 0
        r.write_requested = True  # before it leaves: from now on only the producer frees us
        for pc in r.pieces:
            if pc.written is not None:
                continue
            p = self.peers.get(r.job.host, pc.port)
            writer = p.kvt_peer if p.state == "ready" else None
            if writer is not None and self.ctx.agent.peer_alive(writer) is False:
                # the process we hand-shook with has exited, so whoever answers at this
                # address now (a producer restarted under the same engine id) is unknown:
                # its exit says nothing about the process that receives this request
                writer = None
            if writer is None and pc.writers:
                # A resend could reach only a process other than the one asked (its restart,
                # or nobody): not sent, so no process we cannot watch gets our blocks (else
                # the load would wait out lease + deadline before reusing them). A new
                # hand-shake makes the connection ready again; the next resend goes then.
                continue
            if not any(w is writer for w in pc.writers):
                pc.writers.append(writer)
            piece = pc.piece
            whole = piece.num_heads in (0, ours) and (p.info is None or piece.num_heads in (0, p.info.kv_heads))
            pc.sent(p.client.send(WriteReq(
                key=r.job.key, block_ids=list(r.job.local_block_ids), group_sizes=list(r.job.group_sizes),
                engine_id=self.ctx.name,
                reply_host=self.ctx.cfg.side_channel_host, reply_port=self.ctx.port, rank=self.ctx.tp_rank,
                readers=pc.readers, src_head=0 if whole else piece.remote_head,
                dst_head=0 if whole else piece.local_head, num_heads=0 if whole else piece.num_heads,
                load=r.token, first_token=r.job.first_token)))
        r.last_sent = now

    def cancel(self, r: Recv, now: float) -> None:
        for pc in r.pieces:
            if pc.answer != "acked" and pc.writers:
                pc.sent(self.peers.get(r.job.host, pc.port).client.send(
                    Cancel(keys=[r.job.key], rank=self.ctx.tp_rank, readers=pc.readers)))
        r.last_sent = now

    def release(self, r: Recv) -> None:
        """READ: tell every producer rank of our pieces we will not read (any more)."""
        for pc in r.pieces:
            self.ctx.client_to(r.job.host, pc.port).send(
                Release(keys=[r.job.key], rank=self.ctx.tp_rank, readers=pc.readers))
        self.release_unread(r)
