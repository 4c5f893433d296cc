"""What a consumer needs from ``kv_transfer_params``, parsed once, refused with a reason.

Routers do not all forward what our producer returned. vLLM's toy proxy and llm-d's
routing sidecar forward the prefill's ``kv_transfer_params`` verbatim; others rebuild
them from the keys NixlConnector documents (``do_remote_prefill``, ``remote_engine_id``,
``remote_request_id``, ``remote_host``, ``remote_port``, ``remote_block_ids``,
``remote_num_tokens``, ``tp_size``) and drop the rest, including our ``transfer_id``.
Both must load the remote KV. The transfer key is therefore derived, in this order, from

1. a MoRIIO router request id on the consumer's own request (its 32-hex uuid: the producer
   keyed its hold on the same id, and vllm-router's moriio mode sends both engines a
   ``transfer_id`` of its own that no producer of ours holds under);
2. ``transfer_id`` (our producer's own key, when forwarded);
3. ``remote_engine_id`` + ``remote_request_id``, through :func:`~.routing.producer_key`,
   the very function the producer keys its hold with (so the two can never disagree).

Params that ask for a remote prefill but lack what the load needs raise
:class:`KVTransferParamsError` naming the missing keys; the scheduler turns that into a
failed load (logged, then recompute or fail per ``load_failure_policy``), never into a
silent local prefill. Pure functions, no vLLM import.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .routing import Endpoint, peer_from_params, producer_key, transfer_key

__all__ = ["KVTransferParamsError", "RemoteSource", "producer_key", "parse_remote_source", "NIXL_KEYS"]

#: The kv_transfer_params keys NixlConnector documents and routers forward (vLLM 0.32).
NIXL_KEYS = ("do_remote_prefill", "do_remote_decode", "remote_engine_id", "remote_request_id", "remote_host",
             "remote_port", "remote_block_ids", "remote_num_tokens", "tp_size")


class KVTransferParamsError(ValueError):
    """``kv_transfer_params`` ask for a remote prefill but cannot be loaded from.

    ``missing`` names the absent keys (empty when a key is present but malformed)."""

    def __init__(self, request_id: str, problem: str, missing: tuple[str, ...] = (),
                 peer: Endpoint | None = None, key: str | None = None) -> None:
        self.request_id = request_id
        self.missing = missing
        #: the producer and key when they could be read: it is told to free its hold
        self.peer, self.key = peer, key
        fix = ("; the router must forward the producer's kv_transfer_params to the decode engine (at least "
               "do_remote_prefill, remote_host, remote_port, remote_engine_id, remote_request_id and, in READ "
               "mode, remote_block_ids; see docs/vllm/ROUTERS.md)")
        super().__init__(f"request {request_id}: kv_transfer_params cannot be loaded from: {problem}{fix}")


@dataclass(frozen=True)
class RemoteSource:
    """Where and what a consumer loads: the producer's side channel and the transfer key."""

    peer: Endpoint
    key: str
    remote_engine_id: str
    remote_block_ids: list[int]
    remote_num_tokens: int | None
    remote_tp: int = 0  # the producer's TP size (0: not forwarded)
    #: the producer's block ids per KV cache group (one list for a model with one group)
    remote_block_groups: list[list[int]] = field(default_factory=list)
    #: the producer's block size (0: not forwarded, assume ours; block_sizes.py)
    remote_block_size: int = 0


def parse_remote_source(params: dict[str, Any], request_id: str, mode: str, tp_size: int = 1) -> RemoteSource:
    """The load described by ``params`` (which ask for a remote prefill), or
    :class:`KVTransferParamsError` naming what is missing or malformed."""
    try:
        peer = peer_from_params(params, request_id, "prefill")
        key = transfer_key(params, request_id)
    except Exception as exc:  # any malformed value: JSON gives dicts, Infinity, huge ints
        raise KVTransferParamsError(request_id, f"unusable producer address ({type(exc).__name__}: {exc})") from None
    if peer is not None:
        _check_endpoint(peer, request_id)
    if key is not None:
        _check_text(key, "transfer key (transfer_id or remote_engine_id:remote_request_id)", request_id)
    missing: list[str] = []
    if peer is None:
        missing += [k for k in ("remote_host", "remote_port") if not params.get(k)]
    if key is None:
        missing += [k for k in ("remote_engine_id", "remote_request_id") if not params.get(k)]
    blocks = params.get("remote_block_ids")
    if mode == "read" and not blocks:
        missing.append("remote_block_ids")
    if missing:
        raise KVTransferParamsError(request_id, f"missing {', '.join(missing)}", tuple(missing), peer, key)
    if peer is None or key is None:  # defensive: each None above names a missing key
        raise KVTransferParamsError(request_id, "no producer address or transfer key")
    try:
        if blocks is not None and not isinstance(blocks, (list, tuple)):
            raise TypeError("remote_block_ids is not a list")
        if blocks and isinstance(blocks[0], (list, tuple)):  # hybrid model: ids per KV cache group
            groups = [[_integer(b, 0, MAX_BLOCK_ID, "block id") for b in g] for g in blocks]
        else:
            groups = [[_integer(b, 0, MAX_BLOCK_ID, "block id") for b in (blocks or ())]]
        block_ids = groups[0]
        remote_tokens = params.get("remote_num_tokens")
        num_tokens = _integer(remote_tokens, 0, MAX_BLOCK_ID, "remote_num_tokens") if remote_tokens else None
        remote_tp = None if params.get("tp_size") is None else _integer(params["tp_size"], 1, MAX_TP, "tp_size")
        block_size = params.get("remote_block_size")
        remote_bs = 0 if block_size is None else _integer(block_size, 1, MAX_BLOCK_ID, "remote_block_size")
    except (TypeError, ValueError, OverflowError) as exc:
        raise KVTransferParamsError(
            request_id, f"remote_block_ids / remote_num_tokens / tp_size / remote_block_size: {exc}",
            peer=peer, key=key) from None
    # A tp_size other than ours is a heterogeneous-TP load (tp_mapping); whether the heads
    # map is checked by the workers, which know the head count, at the hand-shake.
    return RemoteSource(peer, key, str(params.get("remote_engine_id") or ""), block_ids, num_tokens,
                        remote_tp or 0, groups, remote_block_size=remote_bs)


#: Bounds on numbers a router forwards (JSON allows huge ints and Infinity): a block id or
#: token count beyond 2**31, or more producer TP ranks than a side channel opens sockets
#: for, is refused like any malformed value, before a worker acts on it.
MAX_BLOCK_ID = 2**31 - 1
MAX_TP = 256
_HOST_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.-_:[]%")


def _integer(value: Any, low: int, high: int, what: str) -> int:
    """``value`` as an int in [low, high]: a bool, a fraction, NaN or infinity is an error."""
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):  # NaN, inf, 2.5
        raise ValueError(f"{what} {value!r} is not an integer")
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} {value!r} is not an integer") from None
    if not low <= n <= high:
        raise ValueError(f"{what} {n} is outside [{low}, {high}]")
    return n


def _check_text(text: str, what: str, request_id: str) -> None:
    try:
        text.encode("utf-8")  # a lone surrogate cannot go on the wire
        ok = 0 < len(text) <= 1024 and "\x00" not in text
    except UnicodeEncodeError:
        ok = False
    if not ok:
        raise KVTransferParamsError(request_id, f"the {what} is not 1-1024 characters of UTF-8 text: {text[:64]!r}")


def _check_endpoint(peer: Endpoint, request_id: str) -> None:
    if not isinstance(peer.port, int) or not 0 < peer.port < 65536:
        raise KVTransferParamsError(request_id, f"remote_port {peer.port!r} is not a TCP port (1-65535)")
    host = peer.host
    if not 0 < len(host) <= 253 or not set(host) <= _HOST_CHARS:
        raise KVTransferParamsError(request_id, f"remote_host {host[:64]!r} is not a host name or IP address")
