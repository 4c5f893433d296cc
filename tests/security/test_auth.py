"""Side-channel authentication (kvtransport.auth): only holders of the cluster secret
get through; tampering, replay, stale messages and cross-channel reuse are refused."""

from __future__ import annotations

import time

import pytest

from kvtransport.auth import AuthConfigError, AuthError, Authenticator, load_secret

SECRET = b"s3cret-cluster-key-0123456789"


def test_round_trip():
    a, b = Authenticator(SECRET, "hs"), Authenticator(SECRET, "hs")
    assert b.open(a.seal(b"metadata please")) == b"metadata please"


@pytest.mark.parametrize("mutate", [
    lambda f: f[:-1] + bytes([f[-1] ^ 1]),        # body tampered
    lambda f: f[:20] + bytes([f[20] ^ 1]) + f[21:],  # nonce tampered
    lambda f: f[:5] + b"\x00" * 8 + f[13:],        # timestamp rewritten
    lambda f: b"KVTA2" + f[5:],                     # foreign magic
    lambda f: f[:30],                               # truncated
    lambda f: b"",
])
def test_tampered_messages_refused(mutate):
    a, b = Authenticator(SECRET, "hs"), Authenticator(SECRET, "hs")
    with pytest.raises(AuthError):
        b.open(mutate(a.seal(b"hello")))


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
    with pytest.raises(AuthError, match="stale"):
        b.open(frame)


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
