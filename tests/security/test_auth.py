"""Side-channel sealing (kvtransport.auth): only holders of the cluster secret can read
or produce a message; tampering, replay, stale messages, cross-channel reuse, replies
bound to another request and frames of the old (KVTA1, HMAC-only) format are refused."""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
import time

import pytest

from kvtransport.auth import (
    HEADER_BYTES, MAGIC, OVERHEAD_BYTES, AuthConfigError, AuthError, Authenticator, AuthVersionError,
    StaleMessageError, load_secret,
)

SECRET = b"s3cret-cluster-key-0123456789"


def test_round_trip():
    a, b = Authenticator(SECRET, "hs"), Authenticator(SECRET, "hs")
    assert b.open(a.seal(b"metadata please")) == b"metadata please"
    assert len(a.seal(b"x" * 100)) == 100 + OVERHEAD_BYTES


def test_body_is_not_on_the_wire():
    """Confidentiality at the frame level: no 8-byte window of the body appears in the
    frame, and the same body sealed twice gives unrelated ciphertexts. Control: the body
    is findable by the same search when it is present (the search can fail)."""
    body = os.urandom(4096)
    a = Authenticator(SECRET, "hs")
    f1, f2 = a.seal(body), a.seal(body)
    windows = {body[i:i + 8] for i in range(0, len(body) - 8)}
    assert not any(w in f1 or w in f2 for w in windows)
    assert f1[HEADER_BYTES:] != f2[HEADER_BYTES:]
    assert any(w in (f1 + body) for w in windows)  # control


@pytest.mark.parametrize("mutate", [
    lambda f: f[:-1] + bytes([f[-1] ^ 1]),                        # tag tampered
    lambda f: f[:-20] + bytes([f[-20] ^ 1]) + f[-19:],            # ciphertext tampered
    lambda f: f[:20] + bytes([f[20] ^ 1]) + f[21:],               # nonce tampered
    lambda f: f[:30] + bytes([f[30] ^ 1]) + f[31:],               # reply_to tampered
    lambda f: f[:5] + b"\x00" * 8 + f[13:],                       # timestamp rewritten
    lambda f: b"XXXXX" + f[5:],                                   # foreign magic
    lambda f: f[:30],                                             # truncated
    lambda f: f + b"\x00",                                        # extended
    lambda f: b"",
])
def test_tampered_messages_refused(mutate):
    a, b = Authenticator(SECRET, "hs"), Authenticator(SECRET, "hs")
    with pytest.raises(AuthError):
        b.open(mutate(a.seal(b"hello, some body long enough to tamper with")))


def test_wrong_secret_refused():
    with pytest.raises(AuthError, match="cluster secret"):
        Authenticator(SECRET, "hs").open(Authenticator(b"another-secret-0123456", "hs").seal(b"x"))


def test_replay_refused():
    a, b = Authenticator(SECRET, "hs"), Authenticator(SECRET, "hs")
    frame = a.seal(b"once")
    assert b.open(frame) == b"once"
    with pytest.raises(AuthError, match="replayed"):
        b.open(frame)


def test_reply_cannot_pass_as_request_nor_cross_channel():
    a = Authenticator(SECRET, "hs")
    with pytest.raises(AuthError):
        Authenticator(SECRET, "hs").open(a.seal(b"x", direction="rep"), direction="req")
    with pytest.raises(AuthError):
        Authenticator(SECRET, "other").open(a.seal(b"x"))


def test_stale_message_refused(monkeypatch):
    a, b = Authenticator(SECRET, "hs", max_skew_s=1), Authenticator(SECRET, "hs", max_skew_s=1)
    frame = a.seal(b"old")
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 5)
    with pytest.raises(StaleMessageError, match="stale"):  # an AuthError, told apart for its hint
        b.open(frame)


def test_reply_is_bound_to_its_request():
    """A reply sealed for request N opens only as the answer to N. The receiver is a fresh
    authenticator (another process: its replay memory never saw the reply), so only the
    binding can refuse it."""
    client, server = Authenticator(SECRET, "hs"), Authenticator(SECRET, "hs")
    req_n, req_m = client.seal(b"request N"), client.seal(b"request M")
    n, m = Authenticator.nonce_of(req_n), Authenticator.nonce_of(req_m)
    assert server.open(req_n) == b"request N" and server.open(req_m) == b"request M"
    reply_n = server.seal(b"answer to N", "rep", request_nonce=n)
    assert Authenticator.reply_to(reply_n) == n
    with pytest.raises(AuthError, match="another request"):
        Authenticator(SECRET, "hs").open(reply_n, "rep", request_nonce=m)
    unbound = server.seal(b"answer to nobody", "rep")
    assert Authenticator.reply_to(unbound) is None
    with pytest.raises(AuthError, match="another request"):
        Authenticator(SECRET, "hs").open(unbound, "rep", request_nonce=n)
    # a forger rewriting reply_to to M breaks the tag (reply_to is associated data)
    forged = reply_n[:29] + m + reply_n[45:]
    with pytest.raises(AuthError, match="tag"):
        Authenticator(SECRET, "hs").open(forged, "rep", request_nonce=m)
    # the genuine pairing opens
    assert client.open(reply_n, "rep", request_nonce=n) == b"answer to N"
    with pytest.raises(ValueError, match="nonce of a sealed request"):
        server.seal(b"x", "rep", request_nonce=b"short")


def _kvta1_frame(secret: bytes, channel: str, body: bytes, direction: str = "req") -> bytes:
    """A frame exactly as the previous release sealed it (HMAC-SHA256, body in the clear)."""
    key = hashlib.sha256(b"kvtransport-auth-v1|" + secret).digest()
    ts, nonce = int(time.time() * 1000), os.urandom(16)
    h = hmac.new(key, digestmod=hashlib.sha256)
    h.update(channel.encode() + b"|" + direction.encode() + b"|")
    h.update(struct.pack(">Q", ts))
    h.update(nonce)
    h.update(body)
    return struct.pack(">5sQ16s32s", b"KVTA1", ts, nonce, h.digest()) + body


def test_old_format_peer_refused_with_a_clear_message():
    old = _kvta1_frame(SECRET, "hs", b"hello from an old engine")
    assert b"hello from an old engine" in old  # why it is refused: the old format is readable
    with pytest.raises(AuthVersionError, match="KVTA1.*same kvtransport version") as ei:
        Authenticator(SECRET, "hs").open(old)
    assert MAGIC.decode() in str(ei.value) and isinstance(ei.value, AuthError)
    with pytest.raises(AuthVersionError, match="KVTA1"):  # even truncated to a few bytes
        Authenticator(SECRET, "hs").open(old[:12])
    with pytest.raises(AuthError, match="not sealed"):
        Authenticator(SECRET, "hs").open(b"\x00" * 80)


def test_secret_configuration(monkeypatch, tmp_path):
    monkeypatch.delenv("KVTRANSPORT_SECRET", raising=False)
    monkeypatch.delenv("KVTRANSPORT_SECRET_FILE", raising=False)
    monkeypatch.delenv("KVTRANSPORT_AUTH", raising=False)
    with pytest.raises(AuthConfigError, match="KVTRANSPORT_SECRET"):
        load_secret()  # on by default: no secret is an error, never silently open
    monkeypatch.setenv("KVTRANSPORT_AUTH", "off")
    assert load_secret() is None  # explicitly disabled
    monkeypatch.delenv("KVTRANSPORT_AUTH")
    monkeypatch.setenv("KVTRANSPORT_SECRET", "short")
    with pytest.raises(AuthConfigError, match="16 bytes"):
        load_secret()
    monkeypatch.setenv("KVTRANSPORT_SECRET", SECRET.decode())
    assert load_secret() == SECRET
    monkeypatch.delenv("KVTRANSPORT_SECRET")
    p = tmp_path / "secret"
    p.write_bytes(SECRET + b"\n")
    monkeypatch.setenv("KVTRANSPORT_SECRET_FILE", str(p))
    assert load_secret() == SECRET
    assert load_secret("off") is None
