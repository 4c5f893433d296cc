"""Scheduler half of KVTransportConnector: pure bookkeeping, no transport, no sockets.

It decides *what* moves (which requests load how many tokens into which blocks, which
finished prefills keep their blocks) and hands the worker half a
:class:`~.messages.KVTransportMetadata` each step. Every remote load is announced to
vLLM as asynchronous (``(n, True)``) in READ and WRITE mode alike, so the request waits
in ``WAITING_FOR_REMOTE_KVS`` and is never scheduled before its KV is in place (R1) —
the opposite is what killed the MoRIIO READ engine (KeyError in ``req_id_to_index``).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from .block_sizes import groups_refusal
from .config import ConnectorConfig, rank_port
from . import ssm_state
from .kv_groups import GroupInfo, clip_windows, flatten, pair_by_position, select
from .messages import HoldJob, KVTransportMetadata, PeerNotice, RecvJob
from .params import KVTransferParamsError, RemoteSource, parse_remote_source
from .routing import parse_router_request_id, producer_key

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

__all__ = ["KVTransportScheduler"]


class KVTransportScheduler:
    def __init__(self, cfg: ConnectorConfig, block_size: int, tp_size: int = 1, dp_rank: int = 0,
                 groups: list[GroupInfo] | None = None) -> None:
        self.cfg = cfg
        #: KV cache groups moved (hybrid models: more than one; vLLM's non-transferable
        #: groups left out; kv_groups.py)
        self.groups = groups or []
        #: vLLM's index of the group whose blocks count a local prefix hit: the first moved
        #: full-attention group (a sliding-window group's null blocks are not cached ones)
        self._g0 = next((g.index for g in self.groups if not g.window_blocks and not g.state),
                        self.groups[0].index if self.groups else 0)
        #: a hybrid SSM model: the decode engine loads all but the last prompt token, the
        #: prefill engine computes only those (ssm_state.py)
        self._has_state = any(g.state for g in self.groups)
        self.block_size = block_size
        self.tp_size = tp_size
        #: the base port of this DP rank's workers, advertised as ``remote_port``: worker
        #: (DP d, TP r) listens on side_channel_port + d * tp_size + r, and a consumer adds
        #: its TP rank to what it is given, so it reaches the worker of this DP rank
        self.remote_port = rank_port(cfg.side_channel_port, dp_rank, tp_size)
        self._meta = KVTransportMetadata()
        #: consumer requests whose load was handed to the worker (req_id -> key)
        self.loading: dict[str, str] = {}
        #: producer requests whose blocks are held for a consumer (req_id -> key)
        self.held: dict[str, str] = {}
        #: consumer requests promised a remote load but not yet allocated (queued for
        #: blocks): req_id -> (key, host, port). Their producer leases are renewed from
        #: here, because no worker knows of them yet (lifecycle 2.5: "queued").
        self.queued: dict[str, tuple[str, str, int, int]] = {}
        self._last_queued_renew = 0.0

    # -- consumer -------------------------------------------------------------------
    def _remote_load(self, request: Request) -> RemoteSource | KVTransferParamsError | None:
        """The load ``request`` asks for; the typed refusal when its params cannot be loaded
        from (a failed load: vLLM applies the load failure policy); None when it asks for
        no remote prefill."""
        if not self.cfg.is_consumer:
            return None
        params = request.kv_transfer_params
        if not isinstance(params, dict) or not _flag(params, "do_remote_prefill"):
            return None  # not a dict: offline extra_args are not checked by vLLM
        try:
            return parse_remote_source(params, request.request_id, self.cfg.mode, self.tp_size)
        except KVTransferParamsError as exc:
            return exc

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """``(n, True)`` when n > 0 tokens will be loaded asynchronously; else ``(0, False)``.

        Idempotent (vLLM may ask several times, e.g. every step while the request waits
        for free blocks): the only bookkeeping is noting the request as queued, so that
        its producer lease is renewed until it is allocated. n covers the whole prompt
        beyond the local hit, like NIXL: after the load vLLM itself rewinds one token so
        the decode engine computes the last prompt token and samples from it. A prompt
        shorter than one block, or fully cached locally, loads nothing. Params that ask
        for a remote prefill but cannot be loaded from are announced like a load too: the
        worker fails it at once, so vLLM's load failure policy applies (recompute or fail)
        instead of a silent local prefill. Fewer loadable tokens than
        ``kv_recompute_threshold`` (beyond the local hit, as NixlConnector counts them)
        are not worth a transfer: the request is prefilled locally instead.
        """
        found = self._remote_load(request)
        if found is None:
            return 0, False
        num_prompt = request.num_prompt_tokens
        if num_prompt < self.block_size:
            return 0, False
        remote_tokens = found.remote_num_tokens if isinstance(found, RemoteSource) else None
        loadable = ssm_state.loadable_tokens(num_prompt) if self._has_state else num_prompt
        n = min(remote_tokens or loadable, loadable) - num_computed_tokens
        if n <= 0:
            return 0, False
        if isinstance(found, RemoteSource):
            if n < self.cfg.kv_recompute_threshold:
                self._compute_locally(request, found)
                return 0, False
            self.queued[request.request_id] = (found.key, found.peer.host, found.peer.port, found.remote_tp)
        return n, True

    def _compute_locally(self, request: Request, src: RemoteSource) -> None:
        """Too few tokens to be worth a remote load (``kv_recompute_threshold``): the
        request is an ordinary local prefill from now on, and the producer frees its hold
        now rather than at lease lapse. READ: it will never be read; WRITE: no write
        request will come. One "release" covers both (the producer ends a hold without a
        destination on it), sent once: the params stop asking for a remote prefill."""
        request.kv_transfer_params["do_remote_prefill"] = False
        self.queued.pop(request.request_id, None)
        self._meta.notices.append(PeerNotice(src.key, src.peer.host, src.peer.port, "release", src.remote_tp))

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self.queued.pop(request.request_id, None)  # from now on the worker renews (or releases)
        found = self._remote_load(request)
        if found is None:
            return
        # Exactly one transfer per request: later allocations for it are local.
        request.kv_transfer_params["do_remote_prefill"] = False
        src = found if isinstance(found, RemoteSource) else None
        peer, key = (src.peer, src.key) if src else (found.peer, found.key)  # type: ignore[union-attr]
        if num_external_tokens <= 0 or src is None:
            # Nothing to load (full local hit / short prompt), or nothing we can load
            # from: free the producer now if we know who and what.
            if peer is not None and key is not None:
                self._meta.notices.append(PeerNotice(key, peer.host, peer.port, "release",
                                                     src.remote_tp if src else 0))
            if src is None and num_external_tokens > 0:
                log.warning("kvtransport: %s: %s", type(found).__name__, found)
                unhashed = [b.block_id for b in blocks.blocks[self._g0] if b.block_hash is None and not b.is_null]
                self._fail_load(request, unhashed, str(found))
            return
        # Blocks cached locally (prefix hit) are counted in a full-attention group: a
        # sliding-window group's null blocks (out of its window) are not cached ones.
        g0 = self._g0
        all_ids = list(blocks.get_block_ids()[g0])
        unhashed = [b.block_id for b in blocks.blocks[g0] if b.block_hash is None and not b.is_null]
        n_local_cached = len(all_ids) - len(unhashed)
        local = unhashed
        remote: list[int] = []
        sizes: list[int] = []
        # blocks that will hold the loaded tokens (a local prefix hit is whole blocks)
        need = -(-(n_local_cached * self.block_size + num_external_tokens) // self.block_size) - n_local_cached
        remote_bs = src.remote_block_size or self.block_size
        if remote_bs != self.block_size and len(self.groups) > 1:
            self._fail_load(request, unhashed, groups_refusal(remote_bs, self.block_size), release=src)
            return
        if self.cfg.mode == "read" and remote_bs != self.block_size:
            # another block size: the producer's blocks holding our tokens, paired by token
            # position in the workers (block_sizes.py)
            first, end = n_local_cached * self.block_size, n_local_cached * self.block_size + num_external_tokens
            r0, r1 = first // remote_bs, -(-end // remote_bs)
            if len(src.remote_block_ids) < r1:
                self._fail_load(request, unhashed,
                                f"the producer sent {len(src.remote_block_ids)} block ids of {remote_bs} tokens for "
                                f"{end} tokens, which need {r1}: remote_block_ids must list every block of the "
                                "prefill", release=src)
                return
            local, remote = local[:need], src.remote_block_ids[r0:r1]
        elif self.cfg.mode == "read":
            state = {g for g, info in enumerate(self.groups) if info.state}
            short = [g for g, ids in enumerate(src.remote_block_groups)
                     if g not in state and len(ids) < n_local_cached + need]
            if short:
                # vLLM counts every announced token as loaded and may cache the blocks: a load
                # that cannot fill them all must fail (load failure policy), never run short
                self._fail_load(request, unhashed,
                                f"the producer sent {len(src.remote_block_groups[short[0]])} block ids (KV cache "
                                f"group {short[0]}) for {n_local_cached * self.block_size + num_external_tokens} "
                                f"tokens, which need {n_local_cached + need} blocks of {self.block_size}: "
                                "remote_block_ids must list every block of the prefill (with the prefill's "
                                "--block-size larger than ours, the router must forward remote_block_size)",
                                release=src)
                return
        if len(self.groups) > 1:
            # hybrid: every group's blocks from the first block not cached locally, paired
            # by position with the producer's (READ) or clipped to the window (WRITE)
            per_group = select(blocks.get_block_ids(), self.groups)
            if self.cfg.mode == "read" and len(src.remote_block_groups) != len(per_group):
                # never pair one group's ids with another's: fail the load (load failure policy)
                self._fail_load(request, unhashed,
                                f"the producer sent block ids for {len(src.remote_block_groups)} KV cache "
                                f"group(s), this engine has {len(per_group)}: both engines must serve the "
                                "same model with the same hybrid KV cache manager setting", release=src)
                return
            if self.cfg.mode == "read":
                lo, re = pair_by_position(per_group, src.remote_block_groups, n_local_cached, self.groups)
                local, sizes = flatten(lo)
                remote, _ = flatten(re)
            else:
                local, sizes = flatten(clip_windows(per_group, self.groups, n_local_cached))
        elif self.cfg.mode == "read" and remote_bs == self.block_size:
            remote = src.remote_block_ids[n_local_cached : n_local_cached + len(local)]
            local = local[: len(remote)]
        self.loading[request.request_id] = src.key
        self._meta.recv.append(
            RecvJob(
                req_id=request.request_id,
                key=src.key,
                mode=self.cfg.mode,
                local_block_ids=local,
                remote_block_ids=remote,
                host=src.peer.host,
                port=src.peer.port,
                remote_engine_id=src.remote_engine_id,
                remote_tp=src.remote_tp,
                created_at=time.time(),
                group_sizes=sizes,
                first_token=n_local_cached * self.block_size,
                remote_block_size=remote_bs,
            )
        )

    def _fail_load(self, request: Request, unhashed: list[int], reason: str,
                   release: RemoteSource | None = None) -> None:
        """A load the params ask for that cannot be done (right): the worker reports its blocks
        failed at once (vLLM's load failure policy); ``release``: its producer frees the hold."""
        if release is not None:
            self._meta.notices.append(PeerNotice(release.key, release.peer.host, release.peer.port, "release",
                                                 release.remote_tp))
        self._meta.recv.append(RecvJob(req_id=request.request_id, key="", mode=self.cfg.mode,
                                       local_block_ids=unhashed, remote_block_ids=[], host="", port=0,
                                       refused=reason, created_at=time.time()))

    # -- producer ---------------------------------------------------------------------
    def on_new_request(self, request: Request) -> None:
        """A hybrid SSM model's prefill for a decode engine computes all but the prompt's
        last token (ssm_state.py: the decode engine computes that one on the loaded state)."""
        params = request.kv_transfer_params
        if (self._has_state and self.cfg.is_producer and isinstance(params, dict)
                and _flag(params, "do_remote_decode")):
            ssm_state.truncate_prefill(request)

    # -- both -----------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: Any) -> KVTransportMetadata:
        self._renew_queued()
        meta, self._meta = self._meta, KVTransportMetadata()
        return meta

    def _renew_queued(self) -> None:
        """Renew the producer leases of queued consumer requests (a few times per lease)."""
        now = time.monotonic()
        if not self.queued or now - self._last_queued_renew < max(0.05, self.cfg.lease_s / 4):
            return
        self._last_queued_renew = now
        for key, host, port, remote_tp in self.queued.values():
            self._meta.notices.append(PeerNotice(key, host, port, "renew", remote_tp))

    def request_finished(self, request: Request, block_ids: list[int] | tuple[list[int], ...]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """``block_ids``: the request's blocks (one group) or a tuple of them per KV cache
        group (hybrid models, from ``request_finished_all_groups``)."""
        from vllm.v1.request import RequestStatus

        # vLLM's ids of every group: only the moved groups' are offered
        per_group = select(block_ids, self.groups) if isinstance(block_ids, tuple) else [list(block_ids)]
        flat, sizes = flatten(per_group)
        block_ids = flat

        rid = request.request_id
        params = request.kv_transfer_params
        self.loading.pop(rid, None)
        self.queued.pop(rid, None)
        if not params or not isinstance(params, dict):
            return False, None

        if self.cfg.is_consumer and _flag(params, "do_remote_prefill"):
            # Finished (aborted) before any block was allocated: the producer still
            # holds its blocks for us, tell it to free them now (R5).
            found = self._remote_load(request)
            params["do_remote_prefill"] = False
            peer = found.peer if found is not None else None
            key = found.key if found is not None else None
            if peer is not None and key is not None:
                remote_tp = found.remote_tp if isinstance(found, RemoteSource) else 0
                self._meta.notices.append(PeerNotice(key, peer.host, peer.port, "release", remote_tp))
            return False, None

        if not (self.cfg.is_producer and _flag(params, "do_remote_decode")):
            return False, None

        router = None
        try:
            router = parse_router_request_id(rid)
        except ValueError:
            pass
        key = producer_key(self.cfg.engine_id, rid)  # what a consumer derives (routing.transfer_key)
        ok = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
        if not ok or not block_ids:
            # Aborted / failed prefill: free now; a consumer that already waits for this
            # key (router flow) is told so it stops waiting (R5).
            if router is not None:
                self._meta.notices.append(PeerNotice(key, router.decode.host, router.decode.port, "aborted"))
            return False, None

        # Offer the prompt's blocks only: a prefill that also generated tokens (max_tokens > 1)
        # holds blocks past the prompt, and a WRITE pairs the consumer's blocks with the ends
        # of ours, so those would shift every written block (vLLM frees them with the rest).
        tokens = min(int(request.num_computed_tokens), int(request.num_prompt_tokens))
        n_blocks = -(-tokens // self.block_size)
        per_group = [ids[:n_blocks] for ids in per_group]
        block_ids, sizes = flatten(per_group)
        self.held[rid] = key
        self._meta.hold.append(HoldJob(req_id=rid, key=key, block_ids=list(block_ids), group_sizes=sizes))
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.cfg.engine_id,
            "remote_request_id": rid,
            "remote_host": self.cfg.side_channel_host,
            "remote_port": self.remote_port,
            # one group: a flat list (what NixlConnector-style routers expect); hybrid: per group
            "remote_block_ids": list(block_ids) if not sizes else per_group,
            "remote_num_tokens": tokens,
            "transfer_id": key,
            "lease_expires_at": time.time() + self.cfg.lease_s,
            "kvtransport_mode": self.cfg.mode,
            "tp_size": self.tp_size,
            "remote_block_size": self.block_size,
        }

    def update_connector_output(self, connector_output: Any) -> None:
        for rid in connector_output.finished_sending or ():
            self.held.pop(rid, None)
        for rid in connector_output.finished_recving or ():
            self.loading.pop(rid, None)


def _flag(params: dict[str, Any], key: str) -> bool:
    """A yes/no of kv_transfer_params; a router that sends text sends "true" / "false"."""
    value = params.get(key)
    if isinstance(value, str):
        return value.strip().lower() in ("true", "1", "yes")
    return bool(value)
