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

from .config import ConnectorConfig
from .messages import HoldJob, KVTransportMetadata, PeerNotice, RecvJob
from .routing import parse_router_request_id, peer_from_params, transfer_key

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

__all__ = ["KVTransportScheduler"]


class KVTransportScheduler:
    def __init__(self, cfg: ConnectorConfig, block_size: int, tp_size: int = 1) -> None:
        self.cfg = cfg
        self.block_size = block_size
        self.tp_size = tp_size
        self._meta = KVTransportMetadata()
        #: consumer requests whose load was handed to the worker (req_id -> key)
        self.loading: dict[str, str] = {}
        #: producer requests whose blocks are held for a consumer (req_id -> key)
        self.held: dict[str, str] = {}
        #: consumer requests promised a remote load but not yet allocated (queued for
        #: blocks): req_id -> (key, host, port). Their producer leases are renewed from
        #: here, because no worker knows of them yet (lifecycle 2.5: "queued").
        self.queued: dict[str, tuple[str, str, int]] = {}
        self._last_queued_renew = 0.0

    # -- consumer -------------------------------------------------------------------
    def _remote_load(self, request: Request) -> tuple[dict[str, Any], Any, str] | None:
        """(params, endpoint, key) when ``request`` has remote KV to load, else None."""
        if not self.cfg.is_consumer:
            return None
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return None
        try:
            peer = peer_from_params(params, request.request_id, "prefill")
            key = transfer_key(params, request.request_id)
        except ValueError as exc:
            log.warning("request %s: unusable producer address (%s); computing locally", request.request_id, exc)
            return None
        if peer is None or key is None:
            log.warning(
                "request %s asks for remote prefill but names no producer (kv_transfer_params need "
                "remote_host/remote_port/transfer_id, or a MoRIIO router request id); computing locally",
                request.request_id,
            )
            return None
        if self.cfg.mode == "read" and not params.get("remote_block_ids"):
            return None
        return params, peer, key

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """``(n, True)`` when n > 0 tokens will be loaded asynchronously; else ``(0, False)``.

        Idempotent (vLLM may ask several times, e.g. every step while the request waits
        for free blocks): the only bookkeeping is noting the request as queued, so that
        its producer lease is renewed until it is allocated. n covers the whole prompt
        beyond the local hit, like NIXL: after the load vLLM itself rewinds one token so
        the decode engine computes the last prompt token and samples from it. A prompt
        shorter than one block, or fully cached locally, loads nothing.
        """
        found = self._remote_load(request)
        if found is None:
            return 0, False
        params, peer, key = found
        num_prompt = request.num_prompt_tokens
        if num_prompt < self.block_size:
            return 0, False
        remote_tokens = int(params.get("remote_num_tokens") or num_prompt)
        n = min(remote_tokens, num_prompt) - num_computed_tokens
        if n <= 0:
            return 0, False
        self.queued[request.request_id] = (key, peer.host, peer.port)
        return n, True

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self.queued.pop(request.request_id, None)  # from now on the worker renews (or releases)
        found = self._remote_load(request)
        if found is None:
            return
        params, peer, key = found
        # Exactly one transfer per request: later allocations for it are local.
        params["do_remote_prefill"] = False
        if num_external_tokens <= 0:
            # Nothing to load (full local hit / short prompt): free the producer now.
            self._meta.notices.append(PeerNotice(key, peer.host, peer.port, "release"))
            return
        all_ids = list(blocks.get_block_ids()[0])
        unhashed = [b.block_id for b in blocks.blocks[0] if b.block_hash is None and not b.is_null]
        n_local_cached = len(all_ids) - len(unhashed)
        local = unhashed
        remote: list[int] = []
        if self.cfg.mode == "read":
            remote = list(params["remote_block_ids"])[n_local_cached : n_local_cached + len(local)]
            local = local[: len(remote)]
        self.loading[request.request_id] = key
        self._meta.recv.append(
            RecvJob(
                req_id=request.request_id,
                key=key,
                mode=self.cfg.mode,
                local_block_ids=local,
                remote_block_ids=remote,
                host=peer.host,
                port=peer.port,
                remote_engine_id=str(params.get("remote_engine_id", "")),
            )
        )

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
        for key, host, port in self.queued.values():
            self._meta.notices.append(PeerNotice(key, host, port, "renew"))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        rid = request.request_id
        params = request.kv_transfer_params
        self.loading.pop(rid, None)
        self.queued.pop(rid, None)
        if not params:
            return False, None

        if self.cfg.is_consumer and params.get("do_remote_prefill"):
            # Finished (aborted) before any block was allocated: the producer still
            # holds its blocks for us, tell it to free them now (R5).
            params["do_remote_prefill"] = False
            try:
                peer = peer_from_params(params, rid, "prefill")
                key = transfer_key(params, rid)
            except ValueError:
                peer = key = None
            if peer is not None and key is not None:
                self._meta.notices.append(PeerNotice(key, peer.host, peer.port, "release"))
            return False, None

        if not (self.cfg.is_producer and params.get("do_remote_decode")):
            return False, None

        router = None
        try:
            router = parse_router_request_id(rid)
        except ValueError:
            pass
        key = router.uuid if router else f"{self.cfg.engine_id}:{rid}"
        ok = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
        if not ok or not block_ids:
            # Aborted / failed prefill: free now; a consumer that already waits for this
            # key (router flow) is told so it stops waiting (R5).
            if router is not None:
                self._meta.notices.append(PeerNotice(key, router.decode.host, router.decode.port, "aborted"))
            return False, None

        self.held[rid] = key
        self._meta.hold.append(HoldJob(req_id=rid, key=key, block_ids=list(block_ids)))
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.cfg.engine_id,
            "remote_request_id": rid,
            "remote_host": self.cfg.side_channel_host,
            "remote_port": self.cfg.side_channel_port,
            "remote_block_ids": list(block_ids),
            "remote_num_tokens": int(request.num_computed_tokens),
            "transfer_id": key,
            "lease_expires_at": time.time() + self.cfg.lease_s,
            "kvtransport_mode": self.cfg.mode,
            "tp_size": self.tp_size,
        }

    def update_connector_output(self, connector_output: Any) -> None:
        for rid in connector_output.finished_sending or ():
            self.held.pop(rid, None)
        for rid in connector_output.finished_recving or ():
            self.loading.pop(rid, None)
