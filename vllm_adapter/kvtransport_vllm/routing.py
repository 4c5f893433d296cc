"""Where is the peer? Parse it from ``kv_transfer_params`` or a MoRIIO router request id.

Two proxy styles exist. vLLM's NIXL examples pass the producer's address back to the
proxy in ``kv_transfer_params`` (``remote_host`` / ``remote_port``), which the proxy
forwards to the decode engine. The MoRIIO router instead embeds both engines' side
channel addresses in the request id it sends to both::

    <anything>___prefill_addr_host:IP,handshake:P,notify:P___decode_addr_host:IP,handshake:P,notify:P_<32 hex>[-<seq>-<hex>]

vLLM may wrap that id (``cmpl-<id>-<seq>-<hex>``), hence the optional suffix. The 32-hex
uuid is the same on both engines, so it serves as the transfer key both sides agree on.
Pure functions, no vLLM import: unit-tested on their own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

__all__ = ["Endpoint", "RouterRequestId", "parse_router_request_id", "parse_moriio_address", "peer_from_params",
           "producer_key", "transfer_key"]

_ROUTER_RE = re.compile(
    r"___prefill_addr_(?P<prefill>.+?)___decode_addr_(?P<decode>.+)_(?P<uuid>[0-9a-f]{32})(?:-[^_]*)?$"
)


@dataclass(frozen=True)
class Endpoint:
    """A peer's side channel: host and the base port (TP rank r uses port + r)."""

    host: str
    port: int
    notify_port: int | None = None

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class RouterRequestId:
    prefill: Endpoint
    decode: Endpoint
    uuid: str


def parse_moriio_address(text: str) -> Endpoint:
    """Parse ``host:IP,handshake:PORT,notify:PORT`` (each pair split on its first colon,
    so IPv6 hosts such as ``host:::1`` work). Raises ValueError naming the bad text."""
    parts: dict[str, str] = {}
    for item in text.split(","):
        key, sep, val = item.partition(":")
        if not sep:
            raise ValueError(f"malformed MoRIIO address {text!r}: item {item!r} has no ':'")
        parts[key.strip()] = val.strip()
    try:
        host = parts["host"]
        port = int(parts["handshake"])
        notify = int(parts["notify"]) if "notify" in parts else None
    except (KeyError, ValueError):
        raise ValueError(
            f"malformed MoRIIO address {text!r}: expected 'host:IP,handshake:PORT,notify:PORT'"
        ) from None
    if not host or not 0 < port < 65536:
        raise ValueError(f"malformed MoRIIO address {text!r}: empty host or port out of range")
    return Endpoint(host, port, notify)


def parse_router_request_id(request_id: str) -> RouterRequestId | None:
    """Return both engines' endpoints and the shared uuid, or None when ``request_id``
    is not a router compound id. A compound id with a malformed address raises ValueError."""
    m = _ROUTER_RE.search(request_id)
    if m is None:
        return None
    return RouterRequestId(
        prefill=parse_moriio_address(m.group("prefill")),
        decode=parse_moriio_address(m.group("decode")),
        uuid=m.group("uuid"),
    )


def peer_from_params(params: dict[str, Any] | None, request_id: str, want: str) -> Endpoint | None:
    """The peer's endpoint for ``want`` = "prefill" (consumer asks) or "decode" (producer asks).

    ``kv_transfer_params`` win (``remote_host`` + ``remote_port``); the router id is the
    fallback so users of the MoRIIO router need no proxy change.
    """
    params = params or {}
    host, port = params.get("remote_host"), params.get("remote_port")
    if host and port and want == "prefill":
        return Endpoint(str(host), int(port))
    rid = parse_router_request_id(request_id)
    if rid is None:
        return None
    return rid.prefill if want == "prefill" else rid.decode


def producer_key(engine_id: str, request_id: str) -> str:
    """The key a producer holds a finished prefill under: the router uuid when its request
    id is a MoRIIO router compound id, else ``<engine id>:<request id>``. A compound id
    with a malformed address counts as a plain id here."""
    try:
        router = parse_router_request_id(request_id)
    except ValueError:
        router = None
    return router.uuid if router else f"{engine_id}:{request_id}"


def transfer_key(params: dict[str, Any] | None, request_id: str) -> str | None:
    """The key both engines use for one transfer, seen from the consumer: the router uuid
    of ``request_id`` when it is a MoRIIO compound id (the producer keyed its hold on the same
    id's uuid; vllm-router's moriio mode also sends both engines a ``transfer_id`` of its own,
    which no producer of ours holds under), else ``transfer_id`` from the params, else
    :func:`producer_key` of NixlConnector's ``remote_engine_id`` and ``remote_request_id``
    (the producer's own derivation, so routers that drop ``transfer_id`` still agree with
    it), else None."""
    params = params or {}
    rid = parse_router_request_id(request_id)
    if rid is not None:
        return rid.uuid
    if params.get("transfer_id"):
        return str(params["transfer_id"])
    engine, remote_rid = params.get("remote_engine_id"), params.get("remote_request_id")
    if engine and remote_rid:
        return producer_key(str(engine), str(remote_rid))
    return None
