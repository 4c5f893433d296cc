"""Shared-secret sealing of side-channel messages: confidential and authenticated.

Agent metadata carries everything a peer needs to read or write our memory (addresses
and, for RDMA backends, remote keys). Whoever can reach a side-channel port, or merely
watch its traffic, must not get it without holding the cluster secret. So every
message is sealed with an AEAD (AES-256-GCM from ``cryptography``; see docs/SECURITY.md
for why this and not ZMQ CURVE)::

    b"KVTA3" | timestamp (8, big-endian ms) | nonce (16) | reply_to (16)
             | dest length (2) | dest (UTF-8) | ciphertext | tag (16)

* the body is encrypted under a key used for this one message only:
  ``HKDF-Expand(master, "...message key" | nonce)``, where ``master`` is
  ``HKDF(cluster secret)``. A fresh key per message (from a random 128-bit nonce) means
  the AEAD nonce is never reused however many messages the cluster sends in its
  lifetime, with no counter to keep across forks or restarts;
* the associated data is the header (magic and version, timestamp, nonce, reply_to,
  dest) plus the channel name and the direction, so a message of one channel cannot
  pass on another, nor a reply as a request, nor can any header byte be changed;
* ``dest`` names the receiver the message is for (the side channel puts the worker's
  endpoint there; empty: a channel whose key already names its receiver). The receiver
  says which names are its own (``open(..., to=...)``): an authentic message sealed for
  another receiver is refused with :class:`MisdirectedError`, which names both, so a
  message captured on its way to one worker is refused by every other one;
* ``reply_to`` binds a reply to the nonce of the request it answers (all zero for a
  request or an unbound message): a reply sealed for request N is refused as the
  answer to request M, even by another process that never saw N's reply.

The receiver refuses a bad tag, a message for another receiver, a timestamp outside the
allowed skew, and a nonce it has already seen inside that window (replay). A frame of an
earlier format (``KVTA1``: HMAC only, body in the clear; ``KVTA2``: no destination) is
refused with :class:`AuthVersionError` naming the fix.

Configuration is one environment variable or option: ``KVTRANSPORT_SECRET`` (or
``KVTRANSPORT_SECRET_FILE``). Authentication is on by default; with no secret
:func:`load_secret` raises, unless it is explicitly disabled with
``KVTRANSPORT_AUTH=off`` (or ``secret="off"``).
"""

from __future__ import annotations

import os
import secrets
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Container

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF, HKDFExpand

from .errors import KVTransportError

__all__ = ["AuthError", "AuthVersionError", "StaleMessageError", "MisdirectedError", "AuthConfigError",
           "Authenticator", "load_secret", "AUTH_OFF", "MAGIC", "HEADER_BYTES", "TAG_BYTES", "OVERHEAD_BYTES"]

#: b"KVTA" and the framing version (one ASCII digit)
MAGIC = b"KVTA3"
_FAMILY = MAGIC[:4]
_HEADER = struct.Struct(">5sQ16s16sH")
#: bytes of the header before ``dest`` (a frame's header is this plus its dest's length)
HEADER_BYTES = _HEADER.size
TAG_BYTES = 16
#: bytes a sealed frame adds to its body, besides its dest
OVERHEAD_BYTES = HEADER_BYTES + TAG_BYTES
MAX_DEST_BYTES = 1024
NONCE_BYTES = 16
_UNBOUND = bytes(NONCE_BYTES)
_AEAD_NONCE = bytes(12)  # each key seals one message only, so a constant AEAD nonce is safe
_MASTER_INFO = b"kvtransport side channel v2: master key"
_MESSAGE_INFO = b"kvtransport side channel v2: message key|"
AUTH_OFF = "off"


class AuthError(KVTransportError):
    """A message failed authentication (bad tag, stale, replayed, misbound, or not sealed)."""


class AuthVersionError(AuthError):
    """The message is sealed with another version of the kvtransport framing."""


class StaleMessageError(AuthError):
    """An authentic message outside the time window: clocks apart, a replay, or a message
    that waited in a queue while its receiver was down."""


class MisdirectedError(AuthError):
    """An authentic message sealed for another receiver: captured on its way to another
    worker and replayed here, or sent by a peer that names this worker otherwise than
    the worker names itself."""


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


def _parse_header(frame: bytes) -> tuple[int, bytes, bytes, bytes, int]:
    """(timestamp, nonce, reply_to, dest, header length) of a frame of this framing
    version, else AuthError."""
    if len(frame) < OVERHEAD_BYTES:
        if frame[:4] == _FAMILY and frame[:5] != MAGIC:
            _refuse_version(frame)
        raise AuthError("message too short to carry an authentication header")
    magic, ts, nonce, reply_to, n = _HEADER.unpack_from(frame)
    if magic != MAGIC:
        if magic[:4] == _FAMILY:
            _refuse_version(frame)
        raise AuthError("message is not sealed with kvtransport authentication (bad magic)")
    end = HEADER_BYTES + n
    if len(frame) < end + TAG_BYTES:
        raise AuthError("message too short for the destination its header declares")
    return ts, nonce, reply_to, bytes(frame[HEADER_BYTES:end]), end


def _refuse_version(frame: bytes) -> None:
    theirs = frame[:5].decode("ascii", "replace")
    why = {"KVTA1": " (KVTA1 authenticated but did not encrypt: it sent memory keys in the clear)",
           "KVTA2": " (KVTA2 did not name the destination: a message captured on its way to one worker was "
                    "accepted by another)"}.get(theirs, "")
    raise AuthVersionError(
        f"the peer seals side-channel messages with framing {theirs}{why}; this engine requires "
        f"{MAGIC.decode()} (encrypted, authenticated, bound to its destination): run the same kvtransport "
        "version on every "
        "engine of the cluster"
    )


class Authenticator:
    """Seals and opens messages of one channel with the cluster secret.

    ``max_skew_s`` bounds the clocks' disagreement and the replay window; nonces seen
    within it are remembered (at most ``max_nonces``); a nonce is forgotten only once its
    message is older than the window, when a replay would be refused as stale anyway.
    One instance may be shared by threads (the replay memory is locked).
    """

    def __init__(self, secret: bytes, channel: str, max_skew_s: float = 30.0, max_nonces: int = 65536):
        if not secret:
            raise AuthConfigError("empty secret")
        self._master = HKDF(algorithm=hashes.SHA256(), length=32, salt=b"kvtransport-auth",
                            info=_MASTER_INFO).derive(bytes(secret))
        self.channel = channel.encode()
        self.max_skew_ms = int(max_skew_s * 1000)
        self._seen: OrderedDict[bytes, int] = OrderedDict()
        self._max_nonces = max_nonces
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ header peeks
    @staticmethod
    def nonce_of(frame: bytes) -> bytes:
        """The nonce of a sealed frame (read from its header, not authenticated): what a
        reply to it is bound to with ``seal(..., request_nonce=...)``."""
        return _parse_header(frame)[1]

    @staticmethod
    def dest_of(frame: bytes) -> str:
        """The destination a sealed frame names (read from its header, not authenticated:
        :meth:`open` checks it): what a reply to it names again."""
        return _parse_header(frame)[3].decode("utf-8", "replace")

    @staticmethod
    def reply_to(frame: bytes) -> bytes | None:
        """The request nonce a sealed reply claims to answer (read from its header, not
        authenticated: :meth:`open` with ``request_nonce`` checks it); None when the frame
        is not a bound reply of this framing."""
        try:
            r = _parse_header(frame)[2]
        except AuthError:
            return None
        return None if r == _UNBOUND else r

    # ------------------------------------------------------------------ seal / open
    def _aead(self, nonce: bytes) -> AESGCM:
        return AESGCM(HKDFExpand(algorithm=hashes.SHA256(), length=32, info=_MESSAGE_INFO + nonce)
                      .derive(self._master))

    def _ad(self, header: bytes, direction: str) -> bytes:
        return header + b"|" + self.channel + b"|" + direction.encode()

    def seal(self, body: bytes, direction: str = "req", *, to: str = "", request_nonce: bytes | None = None) -> bytes:
        """The sealed frame of ``body`` for the receiver named ``to`` (see :meth:`open`). A
        reply passes the nonce of the request it answers (:meth:`nonce_of` of that
        request's frame) as ``request_nonce``, and names what its request named."""
        if request_nonce is not None and (len(request_nonce) != NONCE_BYTES or request_nonce == _UNBOUND):
            raise ValueError(f"request_nonce must be the {NONCE_BYTES}-byte nonce of a sealed request")
        dest = to.encode()
        if len(dest) > MAX_DEST_BYTES:
            raise ValueError(f"a destination name is at most {MAX_DEST_BYTES} bytes of UTF-8, got {len(dest)}")
        nonce = secrets.token_bytes(NONCE_BYTES)
        header = _HEADER.pack(MAGIC, int(time.time() * 1000), nonce, request_nonce or _UNBOUND, len(dest)) + dest
        return header + self._aead(nonce).encrypt(_AEAD_NONCE, body, self._ad(header, direction))

    def open(self, frame: bytes, direction: str = "req", *, to: str | Container[str] = "",
             request_nonce: bytes | None = None) -> bytes:
        """Return the body of an authentic, fresh, first-seen message for us, else raise AuthError.

        ``to`` is the receiver's name (the message's dest must equal it), or a container
        of the names it answers to (``dest in to``): an authentic message for any other
        name raises :class:`MisdirectedError`. With ``request_nonce``, the message must
        also be a reply bound to that request."""
        ts, nonce, reply_to, dest, end = _parse_header(frame)
        if request_nonce is not None and reply_to != request_nonce:
            raise AuthError("reply bound to another request (or to none): replayed or misdirected reply")
        header = bytes(frame[:end])
        try:
            body = self._aead(nonce).decrypt(_AEAD_NONCE, bytes(frame[end:]), self._ad(header, direction))
        except InvalidTag:
            raise AuthError("bad authentication tag: the peer does not hold the cluster secret, or the "
                            "message was altered on the way") from None
        # After the tag: the dest named here is authentic, so the refusal may quote it.
        name = dest.decode("utf-8", "replace")
        if not (name == to if isinstance(to, str) else name in to):
            raise MisdirectedError(f"message sealed for {name or '(no destination)'}, not for "
                                   f"{(to or '(no destination)') if isinstance(to, str) else to}")
        now = int(time.time() * 1000)
        if abs(now - ts) > self.max_skew_ms:
            raise StaleMessageError(f"stale message ({(now - ts) / 1000:.1f}s off): the hosts' clocks disagree, "
                                    "it was replayed, or it waited in a queue while its receiver was down "
                                    "(then harmless)")
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
