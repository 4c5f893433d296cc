"""Shared-secret authentication for side-channel messages.

Agent metadata carries everything a peer needs to read or write our memory (addresses
and, for RDMA backends, remote keys). Whoever can reach a side-channel port must not
get it without proving they belong to the cluster. Every message is sealed as::

    b"KVTA1" | timestamp (8, big-endian ms) | nonce (16) | HMAC-SHA256 (32) | body

over ``context | timestamp | nonce | body`` where ``context`` names the channel and the
direction (so a reply cannot be replayed as a request, nor a message of one channel on
another). The receiver refuses a bad MAC, a timestamp outside the allowed skew, and a
nonce it has already seen inside that window (replay). Bodies are authenticated, not
encrypted: run the side channel on a trusted network or inside a tunnel if metadata
itself must stay confidential.

Configuration is one environment variable or option: ``KVTRANSPORT_SECRET`` (or
``KVTRANSPORT_SECRET_FILE``). Authentication is on by default; with no secret
:func:`load_secret` raises, unless it is explicitly disabled with
``KVTRANSPORT_AUTH=off`` (or ``secret="off"``).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import struct
import threading
import time
from collections import OrderedDict

from .errors import KVTransportError

__all__ = ["AuthError", "AuthConfigError", "Authenticator", "load_secret", "AUTH_OFF"]

MAGIC = b"KVTA1"
_HEADER = struct.Struct(">5sQ16s32s")
HEADER_BYTES = _HEADER.size
AUTH_OFF = "off"


class AuthError(KVTransportError):
    """A message failed authentication (bad MAC, stale, replayed, or not sealed)."""


class AuthConfigError(KVTransportError, ValueError):
    """Authentication is on but no secret is configured."""


def load_secret(value: str | bytes | None = None) -> bytes | None:
    """The cluster secret from ``value``, else ``KVTRANSPORT_SECRET`` /
    ``KVTRANSPORT_SECRET_FILE``. Returns None only when auth is explicitly off."""
    if value is None:
        if os.environ.get("KVTRANSPORT_AUTH", "").lower() == AUTH_OFF:
            return None
        value = os.environ.get("KVTRANSPORT_SECRET")
        path = os.environ.get("KVTRANSPORT_SECRET_FILE")
        if value is None and path:
            with open(path, "rb") as f:
                value = f.read().strip()
    if value is None:
        raise AuthConfigError(
            "side-channel authentication is on but no cluster secret is set: set "
            "KVTRANSPORT_SECRET (same value on every engine), or KVTRANSPORT_SECRET_FILE, or "
            "disable it explicitly with KVTRANSPORT_AUTH=off on a trusted network"
        )
    if isinstance(value, str):
        if value.lower() == AUTH_OFF:
            return None
        value = value.encode()
    if len(value) < 16:
        raise AuthConfigError("the cluster secret must be at least 16 bytes long")
    return bytes(value)


class Authenticator:
    """Seals and opens messages of one channel with the cluster secret.

    ``max_skew_s`` bounds the clocks' disagreement and the replay window; nonces seen
    within it are remembered (at most ``max_nonces``); a nonce is forgotten only once its
    message is older than the window, when a replay would be refused as stale anyway.
    """

    def __init__(self, secret: bytes, channel: str, max_skew_s: float = 30.0, max_nonces: int = 65536):
        if not secret:
            raise AuthConfigError("empty secret")
        self._key = hashlib.sha256(b"kvtransport-auth-v1|" + secret).digest()
        self.channel = channel.encode()
        self.max_skew_ms = int(max_skew_s * 1000)
        self._seen: OrderedDict[bytes, int] = OrderedDict()
        self._max_nonces = max_nonces
        self._lock = threading.Lock()

    def _mac(self, direction: bytes, ts: int, nonce: bytes, body: bytes) -> bytes:
        h = hmac.new(self._key, digestmod=hashlib.sha256)
        h.update(self.channel + b"|" + direction + b"|")
        h.update(struct.pack(">Q", ts))
        h.update(nonce)
        h.update(body)
        return h.digest()

    def seal(self, body: bytes, direction: str = "req") -> bytes:
        ts = int(time.time() * 1000)
        nonce = secrets.token_bytes(16)
        return _HEADER.pack(MAGIC, ts, nonce, self._mac(direction.encode(), ts, nonce, body)) + body

    def open(self, frame: bytes, direction: str = "req") -> bytes:
        """Return the body of an authentic, fresh, first-seen message, else raise AuthError."""
        if len(frame) < HEADER_BYTES:
            raise AuthError("message too short to carry an authentication header")
        magic, ts, nonce, mac = _HEADER.unpack_from(frame)
        if magic != MAGIC:
            raise AuthError("message is not sealed with kvtransport authentication (bad magic)")
        body = bytes(frame[HEADER_BYTES:])
        if not hmac.compare_digest(mac, self._mac(direction.encode(), ts, nonce, body)):
            raise AuthError("bad MAC: the peer does not hold the cluster secret")
        now = int(time.time() * 1000)
        if abs(now - ts) > self.max_skew_ms:
            raise AuthError(f"stale message ({(now - ts) / 1000:.1f}s off); check clocks or replay")
        with self._lock:
            if nonce in self._seen:
                raise AuthError("replayed message (nonce already seen)")
            # Forget nonces whose messages left the window: a replay of them is stale anyway.
            while self._seen and now - next(iter(self._seen.values())) > self.max_skew_ms:
                self._seen.popitem(last=False)
            if len(self._seen) >= self._max_nonces:
                raise AuthError("too many messages inside the replay window; slow down")
            self._seen[nonce] = ts
            return body
