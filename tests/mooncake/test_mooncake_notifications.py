"""Notifications over Mooncake are authenticated: Mooncake's notify RPC itself carries only a
self-declared name, so a message not sealed with the receiving agent's key -- a forged one
from a raw Mooncake engine that knows the agent's session and a registered address, or one
sealed with another key -- is refused and counted, never delivered; a genuine notification
sent after them (the sentinel) arrives, alone."""

from __future__ import annotations

import time

import numpy as np
import pytest

import kvtransport as kvt
from kvtransport.testing.required import skip_unless_usable


def test_forged_and_foreign_notifications_are_refused_genuine_ones_arrive():
    skip_unless_usable("mooncake")
    from kvtransport_mooncake import notify, probe, wire

    me = probe.load_engine_module()
    victim = kvt.open("mooncake", name="mc-victim-n")
    friend = kvt.open("mooncake", name="mc-friend-n")
    attacker = me.TransferEngine()
    try:
        assert probe.initialize(attacker, "127.0.0.1", "tcp", "") == 0
        scratch = np.zeros(64, np.uint8)
        assert attacker.register_memory(scratch.ctypes.data, scratch.nbytes) == 0
        exp = wire.decode("victim", victim._backend.export(), "tcp")  # worst case: it knows our blob
        forged = [
            "kvt1:" + "aGVsbG8=",  # well-formed tag, unsealed payload
            "plain text claiming to be a notification",
            notify.seal(notify.authenticator(b"k" * 32), "mc-friend-n", b"sealed with the wrong key"),
        ]
        for msg in forged:
            rc = attacker.batch_transfer_sync(exp.session, [scratch.ctypes.data], [exp.scratch_addr], [1],
                                              me.TransferOpcode.Read, me.TransferNotify("mc-friend-n", msg))
            assert rc == 0  # Mooncake itself accepts and delivers them
        peer = friend.connect(victim.metadata())
        friend.send_notification(peer, b"sentinel")  # sent after every forgery
        got: list = []
        for _ in range(2000):
            got += [(n.peer, n.payload) for n in victim.notifications()]
            if got:
                break
            time.sleep(0.005)
        assert got == [("mc-friend-n", b"sentinel")]
        assert victim.describe()["notification_refusals"] == len(forged)
    finally:
        del attacker
        friend.close()
        victim.close()


def test_oversized_notification_refused_with_a_typed_error():
    skip_unless_usable("mooncake")
    from kvtransport import errors
    from kvtransport.notify import MAX_PAYLOAD_BYTES

    a, b = kvt.open("mooncake", name="mc-big-a"), kvt.open("mooncake", name="mc-big-b")
    try:
        peer = a.connect(b.metadata())
        with pytest.raises(errors.NotificationError, match="exceeds"):
            a.send_notification(peer, b"x" * (MAX_PAYLOAD_BYTES + 1))
    finally:
        a.close()
        b.close()
