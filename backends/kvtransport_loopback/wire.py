"""What a loopback agent exports and the control message a peer sends to be let in.

The agent blob is the core's envelope (:mod:`kvtransport.blob`: the exporting process's
pid, start time, boot id and pid namespace, which is how loopback reaches and watches the
peer, and the format version) around where and with which key to send the peer
notifications. The ``attach``
control message ("let me copy from / into you") carries the sender's process identity
(:func:`kvtransport.blob.pack_identity`).
"""

from __future__ import annotations

from kvtransport.blob import AgentBlob, BlobCodec

__all__ = ["ATTACH", "CODEC", "LoopbackBlob"]

#: Control message kind: "let me attach" (payload: the sender's packed process identity).
ATTACH = "attach"


class LoopbackBlob(AgentBlob, frozen=True):
    #: ``ipc://`` path of the agent's notification receiver.
    notify_addr: str
    #: Key of that receiver: senders seal their notifications with it.
    notify_key: bytes = b""


#: Version 1: ``[pid, start_time, boot_id, notify_addr, notify_key, pid_ns, v]``, the layout
#: loopback blobs had before the envelope (which is why the envelope puts the identity first).
CODEC = BlobCodec("loopback", 1, LoopbackBlob)
