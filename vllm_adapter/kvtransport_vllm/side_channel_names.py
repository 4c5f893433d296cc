"""Whom a side-channel request is for: the names of a worker's endpoint.

A sealed request names the worker it addresses (:func:`endpoint_name`: the advertised
host and the port, which is the worker's DP and TP rank); a server opens only requests
sealed for one of its own names (:class:`OwnNames`), so a request captured on its way to
one worker and replayed to another is refused. Which names are its own depends on where
the request came from: a peer on this host may name a loopback-listening worker by any
loopback address (:class:`NamesSeenFrom`).
"""

from __future__ import annotations

import functools
import ipaddress

import zmq

__all__ = ["OwnNames", "NamesSeenFrom", "endpoint_name"]


def _norm_host(host: str) -> str:
    """One spelling per address: no brackets, lower case, IP addresses in canonical form."""
    h = host.strip().lower()
    if h.startswith("[") and h.endswith("]"):
        h = h[1:-1]
    try:
        return str(ipaddress.ip_address(h))
    except ValueError:
        return h.rstrip(".")


def endpoint_name(host: str, port: int) -> str:
    """The name a sealed request gives the worker it is for: ``host:port`` (``[v6]:port``)
    of its side channel. The port is the worker's rank (DP rank d, TP rank r listen on
    base + d * TP + r) and the host, as peers are told it (``side_channel_host``, carried
    as ``remote_host`` or a Hello's reply address), tells engines apart."""
    h = _norm_host(host)
    return f"[{h}]:{port}" if ":" in h else f"{h}:{port}"


@functools.lru_cache(maxsize=256)  # asked per request: a worker sees few distinct names
def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


_WILDCARDS = ("", "*", "0.0.0.0", "::")


class OwnNames:
    """The destination names a worker's server opens requests for (a ``Container`` for
    :meth:`Authenticator.open`).

    Always its advertised endpoint (and its bind address, when that is one address).
    From a peer on this host (the connection comes from a loopback address), when the
    server listens on loopback (on every interface, or on a loopback address), also any
    loopback address with its port: same-host peers may name it 127.0.0.1 or localhost
    whatever it advertises. A peer on another host can name it only as advertised, so a
    request sealed for a worker elsewhere that listens on the same port is refused."""

    def __init__(self, host: str, port: int, bind_host: str | None, *, local_peer: bool) -> None:
        self.port = port
        self.advertised = endpoint_name(host, port)
        names = {self.advertised}
        wildcard = bind_host is not None and bind_host.strip("[]") in _WILDCARDS
        if bind_host is not None and not wildcard:
            names.add(endpoint_name(bind_host, port))
        self._exact = frozenset(names)
        self._any_loopback = local_peer and (wildcard or _is_loopback(_norm_host(bind_host or host)))

    def __contains__(self, name: object) -> bool:
        if name in self._exact:
            return True
        if not self._any_loopback or not isinstance(name, str):
            return False
        host, _, port = name.rpartition(":")
        if port != str(self.port):
            return False
        return _is_loopback(host[1:-1] if host.startswith("[") and host.endswith("]") else host)

    def __str__(self) -> str:
        if self._any_loopback:
            return f"{self.advertised} (or, from this host, a loopback address with port {self.port})"
        return self.advertised


class NamesSeenFrom:
    """A worker's :class:`OwnNames` as seen from the connection one request came on. The
    peer's address is read only for a name that is not the advertised one (reading it
    costs more than the rest of the check)."""

    __slots__ = ("_remote", "_local", "_frame")

    def __init__(self, remote: OwnNames, local: OwnNames, frame: zmq.Frame) -> None:
        self._remote, self._local, self._frame = remote, local, frame

    def _view(self) -> OwnNames:
        return self._local if _from_loopback(self._frame) else self._remote

    def __contains__(self, name: object) -> bool:
        return name in self._remote or name in self._view()

    def __str__(self) -> str:
        return str(self._view())


def _from_loopback(frame: zmq.Frame) -> bool:
    """Whether ``frame`` came over a connection from a loopback address (this host)."""
    try:
        peer = frame.get("Peer-Address")
    except (zmq.ZMQError, KeyError, ValueError):  # not TCP, or a libzmq without the property
        return False
    return isinstance(peer, str) and _is_loopback_peer(peer)


@functools.lru_cache(maxsize=256)
def _is_loopback_peer(address: str) -> bool:
    return _is_loopback(_norm_host(address))
