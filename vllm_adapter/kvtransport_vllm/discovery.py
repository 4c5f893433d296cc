"""Announce this engine to a router's service discovery, the way vLLM's MoRIIOConnector does.

vLLM's production router (``vllm-router``, PyPI) in PD mode with ``--kv-connector moriio``
learns its engines only from registrations sent to ``--vllm-discovery-address``; it will not
start without one. It then dispatches the prefill and the decode hop of a request at once,
each with the same MoRIIO compound request id built from the registered side-channel
addresses: the router flow our WRITE mode serves (docs/vllm/ROUTERS.md). So that users can
put KVTransportConnector behind that router unchanged, an engine registers with the same
``kv_connector_extra_config`` keys MoRIIO reads:

* ``proxy_ip`` -- the router's discovery host (empty or absent: no registration);
* ``proxy_ping_port`` -- its discovery port;
* ``http_port`` -- this engine's OpenAI server port, which the router sends requests to.

The protocol (facts from vLLM's MoRIIO heartbeat and vllm-router's behaviour): a ZeroMQ
DEALER socket connected to ``tcp://proxy_ip:proxy_ping_port`` sends, every few seconds, one
msgpack map: ``type`` ("P" prefill / "D" decode), ``http_address`` ("host:port"),
``zmq_address`` ("host:H,handshake:P,notify:P"), ``dp_size``, ``tp_size`` and
``transfer_mode`` ("READ" / "WRITE"; the router refuses engines of mixed modes). The router
copies ``zmq_address`` into the compound request id; here both ports are the side-channel
port, which serves what MoRIIO splits over two ports.

The messages are **not sealed**: the router speaks its own plaintext protocol. They carry
only addresses, the role, the parallel sizes and the mode -- no KV data and no secret. The
side channel the addresses point to stays sealed as always.

Registration is best effort: the heartbeat runs on its own thread with its own ZeroMQ
context, never blocks (a send the socket cannot queue is dropped and retried next beat), logs
failures and never stops the engine. The worker of tensor-parallel rank 0 starts it once its
side channel listens, and stops it on shutdown (as MoRIIO registers from rank 0 of its
worker group).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from .config import ConnectorConfigError

__all__ = ["DISCOVERY_KEYS", "DiscoveryTarget", "parse_discovery", "registration", "DiscoveryHeartbeat",
           "start_discovery"]

log = logging.getLogger(__name__)

#: The kv_connector_extra_config keys of a registration (MoRIIOConnector's names).
DISCOVERY_KEYS: dict[str, str] = {
    "proxy_ip": "host of a router's service discovery (vllm-router --vllm-discovery-address) this engine "
    "registers with; empty or absent: no registration",
    "proxy_ping_port": "port of that service discovery address (with proxy_ip)",
    "http_port": "this engine's OpenAI server port, announced to the router (with proxy_ip)",
}

#: Seconds between two registrations (MoRIIO's interval): a router that restarts, or starts
#: after the engine, learns of the engine within this time.
HEARTBEAT_INTERVAL_S = 3.0


@dataclass(frozen=True)
class DiscoveryTarget:
    """Where to register and what HTTP port to announce."""

    proxy_ip: str
    proxy_ping_port: int
    http_port: int

    @property
    def endpoint(self) -> str:
        """The ZeroMQ endpoint of the router's discovery listener."""
        host = f"[{self.proxy_ip}]" if ":" in self.proxy_ip else self.proxy_ip
        return f"tcp://{host}:{self.proxy_ping_port}"


def _port(extra: Mapping[str, Any], key: str) -> int:
    raw = extra.get(key)
    try:
        port = int(raw)  # type: ignore[arg-type]
        if port != float(raw):  # type: ignore[arg-type]  # 8000.5 is no port
            raise ValueError
    except (TypeError, ValueError, OverflowError):
        port = -1
    if not 0 < port < 65536:
        raise ConnectorConfigError(f"KVTransportConnector: {key} must be a TCP port (1-65535), got {raw!r}")
    return port


def parse_discovery(extra: Mapping[str, Any]) -> DiscoveryTarget | None:
    """The registration asked for by ``kv_connector_extra_config``, or None.

    None when ``proxy_ip`` is absent or empty (MoRIIO's meaning: no router to register with).
    With ``proxy_ip`` set, ``proxy_ping_port`` and ``http_port`` are required: a missing or
    malformed one raises ConnectorConfigError naming it, at start-up."""
    proxy_ip = extra.get("proxy_ip")
    if proxy_ip is None or (isinstance(proxy_ip, str) and not proxy_ip.strip()):
        return None
    if not isinstance(proxy_ip, str):
        raise ConnectorConfigError(f"KVTransportConnector: proxy_ip must be a host name or address, got {proxy_ip!r}")
    missing = [k for k in ("proxy_ping_port", "http_port") if extra.get(k) in (None, "")]
    if missing:
        raise ConnectorConfigError(
            f"KVTransportConnector: proxy_ip is set, so {missing} must be set too: proxy_ping_port is the port of the "
            "router's --vllm-discovery-address, http_port this engine's --port (docs/vllm/ROUTERS.md, vllm-router)")
    return DiscoveryTarget(proxy_ip.strip(), _port(extra, "proxy_ping_port"), _port(extra, "http_port"))


def registration(target: DiscoveryTarget, *, producer: bool, host: str, side_channel_port: int, mode: str,
                 tp_size: int) -> dict[str, Any]:
    """The map one heartbeat carries: this engine's role, addresses, sizes and mode.

    ``host`` and ``side_channel_port`` are what kv_transfer_params advertise (the side
    channel's base port for this engine), so a compound request id names the same listener
    a two-hop router would reach. One registration per engine: ``dp_size`` is 1."""
    addr = f"[{host}]" if ":" in host else host
    return {
        "type": "P" if producer else "D",
        "http_address": f"{addr}:{target.http_port}",
        "zmq_address": f"host:{host},handshake:{side_channel_port},notify:{side_channel_port}",
        "dp_size": 1,
        "tp_size": tp_size,
        "transfer_mode": mode.upper(),
    }


class DiscoveryHeartbeat:
    """Sends one registration to ``endpoint`` now and every ``interval_s`` until closed."""

    def __init__(self, endpoint: str, payload: Mapping[str, Any], interval_s: float = HEARTBEAT_INTERVAL_S) -> None:
        self.endpoint = endpoint
        self._message = msgspec.msgpack.encode(dict(payload))
        self._interval_s = interval_s
        self._stop = threading.Event()
        # A context of our own: zmq.Context.instance() is process-wide and vLLM's.
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 1)  # a router that is down gets the latest beat only
        try:
            self._sock.connect(endpoint)
        except zmq.ZMQError:
            self._sock.close()
            self._ctx.term()
            raise
        self._thread = threading.Thread(target=self._run, name="kvtransport-discovery", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        warned = False
        while True:
            try:
                self._sock.send(self._message, zmq.NOBLOCK)
                warned = False
            except zmq.Again:  # queue full: the router is not reachable (yet)
                if not warned:
                    log.warning("kvtransport discovery: router at %s not reachable yet; registering again every %g s",
                                self.endpoint, self._interval_s)
                    warned = True
            except zmq.ZMQError as exc:
                log.warning("kvtransport discovery: registration to %s failed (%s); retrying", self.endpoint, exc)
            if self._stop.wait(self._interval_s):
                break
        self._sock.close()

    def close(self) -> None:
        """Stop beating (the router drops the engine when beats stop) and free the socket."""
        self._stop.set()
        self._thread.join(timeout=5)
        if self._thread.is_alive():  # never hang a shutdown: leave the context to the process exit
            log.warning("kvtransport discovery: heartbeat thread did not stop within 5 s")
            return
        self._ctx.term()


def start_discovery(target: DiscoveryTarget | None, *, producer: bool, host: str, side_channel_port: int,
                    mode: str, tp_size: int, dp_rank: int = 0) -> DiscoveryHeartbeat | None:
    """Start registering (None when no target is configured). A failure to start is logged
    and returns None: the engine serves as before, only the router does not learn of it.

    Data parallel engines are refused (ConnectorConfigError): the compound request id names
    one side channel per engine, which cannot say which DP rank holds a prefill."""
    if target is None:
        return None
    if dp_rank != 0:
        raise ConnectorConfigError(
            "KVTransportConnector: proxy_ip (vllm-router service discovery) is not supported with data parallel "
            "size > 1: run one engine per data-parallel rank, each with its own --port and side_channel_port")
    payload = registration(target, producer=producer, host=host, side_channel_port=side_channel_port, mode=mode,
                           tp_size=tp_size)
    try:
        beat = DiscoveryHeartbeat(target.endpoint, payload)
    except (zmq.ZMQError, OSError) as exc:
        log.error("kvtransport discovery: cannot register with %s (%s); the router will not learn of this engine",
                  target.endpoint, exc)
        return None
    log.info("kvtransport discovery: registering with %s as %s", target.endpoint, payload)
    return beat
