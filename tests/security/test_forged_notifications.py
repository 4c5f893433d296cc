"""Forged, wrongly keyed and replayed notifications are refused, counted, never delivered.

A notification tells an engine that KV blocks have landed; a forged one makes it use
blocks nobody wrote. Each test puts a *tap* between a real sender and a real receiver:
the sender is given the receiver's metadata with the notification address pointing at a
socket of the test, which captures every genuine frame and forwards it on one PUSH socket
to the receiver's real endpoint. On that same socket the test, playing a local process
that found the endpoint, sends (a) unsealed notifications (the wire format accepted before
notifications were authenticated), (b) one sealed with a key of its own, (c) a replay of a
captured genuine completion frame, (d) a frame sealed with the right key a minute ago (a
capture replayed after the replay window); then it forwards a genuine frame the sender made after
all of them, the sentinel. One socket keeps its order, so when the sentinel has been
delivered every forged frame was processed before it: it is delivered, they are not, and
each is counted as a refusal. The controls show the forged frames are well formed: a
receiver without the authentication check, or one holding the forger's key, delivers them.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zmq

import kvtransport as kvt
from kvtransport import metadata as md
from kvtransport.auth import Authenticator
from kvtransport.notify import CHANNEL, NotificationReceiver, new_notification_key

CTX = zmq.Context.instance()


def _forged_frames() -> dict[str, list]:
    """(a) unsealed, (b) sealed with the forger's own key. Each claims sender 'sender'."""
    body = msgspec.msgpack.encode((1, "n", "sender", b"forged: blocks 0-15 ready"))
    return {
        "unsealed_legacy": [b"sender", b"forged: blocks 0-15 ready"],  # old loopback wire format
        "unsealed_body": [body],  # the right body, no seal
        "wrong_key": [Authenticator(new_notification_key(), CHANNEL).seal(body)],
    }


class Tap:
    """A PULL socket posing as the receiver (captures genuine frames) and one PUSH socket to
    the receiver's real endpoint (forwards genuine frames and sends forged ones)."""

    def __init__(self, real_addr: str, bind: str):
        self.pull = CTX.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        if bind.startswith("tcp://"):
            self.addr = f"{bind}:{self.pull.bind_to_random_port(bind)}"
        else:
            self.pull.bind(bind)
            self.addr = bind
        self.push = CTX.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 1000)
        self.push.connect(real_addr)

    def capture(self, timeout_ms: int = 10_000) -> bytes:
        assert self.pull.poll(timeout_ms), "the sender sent nothing to the tap"
        frames = self.pull.recv_multipart()
        assert len(frames) == 1
        return frames[0]

    def send(self, frames: list) -> None:
        self.push.send_multipart(frames)

    def close(self) -> None:
        self.pull.close(0)
        self.push.close(0)


def _drain_until(get, payload: bytes, timeout_s: float = 10.0) -> list[tuple[str, bytes]]:
    """Everything delivered until ``payload`` is (bounded by a generous deadline)."""
    import time

    out: list[tuple[str, bytes]] = []
    end = time.monotonic() + timeout_s
    while not any(p == payload for _, p in out) and time.monotonic() < end:
        out += get()
        time.sleep(0.002)
    return out


def _stale_frame(key: bytes, monkeypatch) -> bytes:
    """What a frame captured 60 s ago looks like (sealed with the right key, then; a nonce
    never seen): a replay from outside the replay window, refused as stale."""
    import time

    import kvtransport.auth as auth_mod

    body = msgspec.msgpack.encode((1, "n", "sender", b"captured a minute ago"))
    with monkeypatch.context() as m:
        now = time.time()
        m.setattr(auth_mod.time, "time", lambda: now - 60)
        return Authenticator(key, CHANNEL).seal(body)


def _run_forgery(tap: Tap, captured: bytes, stale: bytes, make_sentinel) -> None:
    for frames in _forged_frames().values():  # (a) and (b)
        tap.send(frames)
    tap.send([captured])  # (c) replay of a genuine completion, already delivered once
    tap.send([stale])  # (d) replay from outside the window
    make_sentinel()
    tap.send([tap.capture()])  # the sentinel: genuine, after every forged frame on this socket


# ----------------------------------------------------------------------------- loopback
def _loopback_meta_via(meta: bytes, notify_addr: str) -> bytes:
    m = md.decode_metadata(meta)
    fields = list(msgspec.msgpack.decode(m.blob))
    fields[3] = notify_addr
    return md.encode_metadata(msgspec.structs.replace(m, blob=msgspec.msgpack.encode(fields)))


def test_forged_notifications_refused_loopback(monkeypatch):
    with kvt.open("loopback", name="receiver") as r, kvt.open("loopback", name="sender") as s:
        src = np.arange(4096, dtype=np.uint8)
        r.register(src)
        dst = np.zeros(4096, np.uint8)
        rd = s.register(dst)
        tmp = tempfile.mkdtemp(prefix="kvt-tap-")
        tap = Tap(r.describe()["notify_addr"], f"ipc://{os.path.join(tmp, 'tap.sock')}")
        try:
            peer = s.connect(_loopback_meta_via(r.metadata(), tap.addr))
            # A genuine completion: the sender read the receiver's blocks and notified it.
            assert s.read(peer, rd.whole(), peer.regions[0].whole(), notify=b"req-1 read").wait(10).ok
            assert np.array_equal(dst, src)
            captured = tap.capture()
            tap.send([captured])  # forwarded: the genuine frame is accepted once
            stale = _stale_frame(msgspec.msgpack.decode(md.decode_metadata(r.metadata()).blob)[4], monkeypatch)
            _run_forgery(tap, captured, stale, lambda: s.send_notification(peer, b"sentinel"))
            got = _drain_until(lambda: [(n.peer, n.payload) for n in r.notifications()], b"sentinel")
            assert got == [("sender", b"req-1 read"), ("sender", b"sentinel")]
            # 2 unsealed + 1 wrong key + 1 replay + 1 stale, all processed before the sentinel.
            assert r.describe()["notification_refusals"] == 5
        finally:
            tap.close()
            os.unlink(os.path.join(tmp, "tap.sock"))
            os.rmdir(tmp)


# ----------------------------------------------------------------------------- moriio (fake mori: glue only)
def test_forged_notifications_refused_moriio_glue_fake_mori(monkeypatch):
    from kvtransport.spi import Op, PollState
    from kvtransport_moriio.wire import decode_agent_blob, encode_agent_blob

    # The fake mori and its helpers live in the tests.moriio package; make the repository
    # root importable also when pytest was started as a bare `pytest` (it then puts only
    # this directory on sys.path).
    root = str(Path(__file__).resolve().parents[2])
    if root not in sys.path:
        sys.path.insert(0, root)
    from tests.moriio.conftest import Side
    from tests.moriio.fake_mori_io import make_fake_mori_io
    from tests.moriio.test_glue_fake_mori import make_req

    io = make_fake_mori_io()
    a, b = Side("sender", io, sizes=(4096,)), Side("receiver", io, sizes=(4096,), first_id=10)
    tap = Tap(b.be.describe()["notify_address"], "tcp://127.0.0.1")
    try:
        blob = decode_agent_blob(b.be.export(), "receiver")
        tapped = encode_agent_blob(msgspec.structs.replace(blob, notify_address=tap.addr))
        peer = a.be.connect("receiver", tapped, b.remote_view())
        h = a.be.post(make_req(Op.READ, 1, peer, "receiver", a, b, [1], [0], [10], [0], [4096], notify=b"req-1 read"))
        assert a.be.poll(h).state is PollState.DONE
        assert np.array_equal(a.bufs[0], b.bufs[0])
        captured = tap.capture()
        tap.send([captured])
        _run_forgery(tap, captured, _stale_frame(blob.notify_key, monkeypatch),
                     lambda: a.be.send_notification(peer, b"sentinel"))
        got = _drain_until(b.be.notifications, b"sentinel")
        assert got == [("sender", b"req-1 read"), ("sender", b"sentinel")]
        assert b.be.describe()["notification_refusals"] == 5
    finally:
        tap.close()
        a.be.close()
        b.be.close()


# ----------------------------------------------------------------------------- controls
@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_control_forged_bodies_are_delivered_once_they_pass_the_check(transport):
    """The same forged bodies reach the engine once they pass the check: the refusals above
    come from authentication, not from malformed test frames."""
    tmp = tempfile.mkdtemp(prefix="kvt-ctl-")
    endpoint = f"ipc://{os.path.join(tmp, 'ctl.sock')}" if transport == "ipc" else "tcp://127.0.0.1"
    forged = _forged_frames()
    # A receiver whose key the forger holds: the unsealed body, sealed with that key.
    plain_key = new_notification_key()
    plain = NotificationReceiver(CTX, endpoint, plain_key, name="forger-holds-key")
    unsealed_body_sealed = [Authenticator(plain_key, CHANNEL).seal(f) for f in forged["unsealed_body"]]
    # A receiver that holds the forger's key.
    forger_key = new_notification_key()
    keyed = NotificationReceiver(CTX, "tcp://127.0.0.1", forger_key, name="forger-key")
    wrong_key_frame = Authenticator(forger_key, CHANNEL).seal(msgspec.msgpack.encode((1, "n", "sender", b"forged")))
    try:
        with CTX.socket(zmq.PUSH) as push:
            push.connect(plain.address)
            push.send_multipart(unsealed_body_sealed)
            got = _drain_until(plain.drain, b"forged: blocks 0-15 ready")
        assert got == [("sender", b"forged: blocks 0-15 ready")] and plain.refusals == 0
        with CTX.socket(zmq.PUSH) as push:
            push.connect(keyed.address)
            push.send(wrong_key_frame)
            got = _drain_until(keyed.drain, b"forged")
        assert got == [("sender", b"forged")] and keyed.refusals == 0
    finally:
        plain.close()
        keyed.close()
        for p in (os.path.join(tmp, "ctl.sock"),):
            if os.path.exists(p):
                os.unlink(p)
        os.rmdir(tmp)


# ----------------------------------------------------------------------------- the transport itself
def test_receiver_without_control_handler_refuses_control_kinds_and_sender_refuses_oversize():
    from kvtransport.errors import NotificationError
    from kvtransport.notify import MAX_PAYLOAD_BYTES, NotificationSender

    key = new_notification_key()
    rx = NotificationReceiver(CTX, "tcp://127.0.0.1", key, name="no-control")
    tx = NotificationSender(CTX, rx.address, key, "sender")
    try:
        tx.send(b"let me attach", kind="attach")  # a kind this receiver has no handler for
        with pytest.raises(NotificationError, match="exceeds"):
            tx.send(b"x" * (MAX_PAYLOAD_BYTES + 1))
        tx.send(b"sentinel")
        assert _drain_until(rx.drain, b"sentinel") == [("sender", b"sentinel")]
        assert rx.refusals == 1 and "unknown notification kind 'attach'" in rx.last_refusal
    finally:
        tx.close(0)
        rx.close()


def test_a_receiver_dropped_without_close_stops_its_thread():
    import gc

    rx = NotificationReceiver(CTX, "tcp://127.0.0.1", new_notification_key(), name="dropped")
    thread = rx._thread
    del rx
    gc.collect()
    thread.join(10)
    assert not thread.is_alive()
