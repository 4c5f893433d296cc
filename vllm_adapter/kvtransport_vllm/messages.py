"""Wire messages of the side channel (msgspec, versioned) and the scheduler -> worker metadata.

Side-channel messages are tagged msgspec structs, one request and one reply per
exchange, matched by ``cid``. Every message carries the protocol version; on the wire it
is sealed with the cluster secret (:mod:`kvtransport.auth`, see :mod:`.side_channel`).
Decoding is strict: unknown tags, unknown fields and wrong types are refused, and the
version is read first so a peer of another version gets a message naming the mismatch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from .ssm_tp import StateGeometry

#: 2: heterogeneous TP (issue 14): LayoutInfo names the model and head geometry, and
#: Done / Release / Cancel / WriteReq / Written name TP ranks and head ranges. A version-1
#: peer is refused with a message naming both versions, not as a malformed message.
PROTOCOL_VERSION = 2

__all__ = [
    "PROTOCOL_VERSION",
    "LayoutInfo",
    "Msg",
    "Hello",
    "Welcome",
    "Done",
    "Renew",
    "Release",
    "WriteReq",
    "Cancel",
    "Written",
    "Aborted",
    "Reply",
    "Error",
    "Probe",
    "ProbeInfo",
    "ProbeWrite",
    "ProbeStatus",
    "ProbeResult",
    "DOCTOR_AGENT_PREFIX",
    "encode",
    "decode",
    "peek_version",
    "RecvJob",
    "HoldJob",
    "PeerNotice",
    "KVTransportMetadata",
]


class LayoutInfo(msgspec.Struct, frozen=True):
    """What both sides must agree on before bytes move."""

    block_size: int
    dtype: str
    num_layers: int
    block_bytes: int  # bytes of one block in one part of one layer
    parts_per_layer: int
    tp_size: int
    #: per layer: [(region id, base offset), ...] and the block stride (this agent's ids)
    part_regions: list[list[tuple[int, int]]] = []
    block_stride: list[int] = []
    #: identity and geometry compared at the hand-shake (docs/vllm/USAGE.md, Compatibility
    #: check); "" / 0: not known (a worker built without a model config, e.g. by tools)
    model: str = ""  # the served model name (what a router sends to both engines)
    model_dtype: str = ""  # the model's dtype (``dtype`` above is the KV cache's)
    total_kv_heads: int = 0
    kv_heads: int = 0  # KV heads this rank holds
    head_size: int = 0
    attn_layout: str = ""  # where heads lie inside a block (kv_layout.HEADS_OUTER, ...)
    #: vLLM's attention backends of these layers (block_sizes.TOKEN_ROW_BACKENDS; []: not known)
    attn_backends: list[str] = []
    #: hybrid models: where the Mamba / SSM state lies in its page on this rank (ssm_tp.py)
    state: StateGeometry | None = None
    #: KV cache groups moved (several: a hybrid model, paired group by group; kv_groups.py)
    kv_groups: int = 1

    def mismatch(self, other: LayoutInfo) -> str:
        """Human-readable differences that make a transfer impossible ("" if none)."""
        diffs = []
        for name in ("block_size", "dtype", "num_layers", "block_bytes", "parts_per_layer", "tp_size"):
            a, b = getattr(self, name), getattr(other, name)
            if a != b:
                diffs.append(f"{name}: local {a!r} vs peer {b!r}")
        return "; ".join(diffs)


class Msg(msgspec.Struct, tag_field="t", kw_only=True, forbid_unknown_fields=True):
    v: int = PROTOCOL_VERSION
    cid: int = 0


class Hello(Msg, tag="hello"):
    engine_id: str
    tp_rank: int
    agent_md: bytes
    layout: LayoutInfo
    reply_host: str
    reply_port: int


class Welcome(Msg, tag="welcome"):
    engine_id: str
    agent_md: bytes
    layout: LayoutInfo


class Done(Msg, tag="done"):
    """Consumer: "done reading these keys" (READ mode, read-then-confirm).

    ``instance`` is the producer agent instance the consumer read from: a producer
    restarted at the same address (new memory) answers "stale" instead of "ok", so bytes
    read from its previous incarnation are never accepted."""

    keys: list[str]
    instance: str = ""
    #: our TP rank, and how many consumer ranks read from this producer rank: it frees
    #: the blocks once all of them confirmed or released (rank -1: the one reader)
    rank: int = -1
    readers: int = 1
    #: the load this confirmation is for (random per load). After the key ended, a repeated
    #: Done is answered "ok" only for a load that confirmed it while the blocks were held
    #: (its first answer was lost), never for another load of the same key (a router
    #: retry or hedge), which read blocks that may already hold another request's KV
    load: str = ""


class Renew(Msg, tag="renew"):
    keys: list[str]


class Release(Msg, tag="release"):
    """Consumer will not read these keys (aborted, failed, nothing to load)."""

    keys: list[str]
    rank: int = -1  # as in Done
    readers: int = 1


class WriteReq(Msg, tag="write_req"):
    """Consumer (WRITE mode): "write key into my blocks"."""

    key: str
    block_ids: list[int]
    engine_id: str
    reply_host: str
    reply_port: int
    rank: int = -1  # as in Done
    readers: int = 1
    #: write the producer's heads [src_head, src_head + num_heads) into our heads from
    #: dst_head (heads counted in each rank's own cache); num_heads 0: whole blocks
    src_head: int = 0
    dst_head: int = 0
    num_heads: int = 0
    #: hybrid models: ids per KV cache group in ``block_ids`` ([]: one group)
    group_sizes: list[int] = []
    #: the consumer's load asking (random per load), echoed in ``Written.load``
    load: str = ""
    #: the token ``block_ids[0]`` starts at; used when the block sizes differ (block_sizes.py)
    first_token: int = 0


class Cancel(Msg, tag="cancel"):
    """Consumer (WRITE mode) gives up; producer acks once no more write can land."""

    keys: list[str]
    rank: int = -1  # as in Done
    readers: int = 1


class Written(Msg, tag="written"):
    """Producer -> consumer: the write for key ended (ok or not)."""

    key: str
    ok: bool
    reason: str = ""
    rank: int = 0  # the producer's TP rank (a consumer rank may get pieces from several)
    #: the load whose blocks were written (``WriteReq.load``): a late ``Written`` for an
    #: earlier load of the same key is not taken as this load's
    load: str = ""


class Aborted(Msg, tag="aborted"):
    """Either side -> peer: the request behind key was aborted here."""

    keys: list[str]


class Reply(Msg, tag="reply"):
    """Generic reply: per-key status ("ok", "expired", "pending", "acked", "unknown",
    "stale": read from another producer instance, "hello": hand-shake with me first,
    "aborted": the producer aborted the request behind the key)."""

    status: dict[str, str] = {}


class Error(Msg, tag="error"):
    code: str
    message: str


# --------------------------------------------------------------------------------------
# `kvtransport doctor` (issue 17, point 5): requests only the doctor sends. They never
# change a hold or a load; the one that moves bytes makes the engine READ its own KV cache
# and WRITE it into the doctor's scratch memory, never the other way round.

#: every doctor agent's name starts so; an engine connects no other name for a probe, so
#: a probe can never replace (and so fail the transfers of) one of its real peers
DOCTOR_AGENT_PREFIX = "kvtransport-doctor-"


class Probe(Msg, tag="probe"):
    """Doctor -> engine: "describe yourself" (what a consumer's Hello would learn)."""

    doctor: str


class ProbeInfo(Msg, tag="probe_info"):
    """Engine -> doctor: its identity, settings and hand-shake data."""

    engine_id: str
    kv_role: str
    mode: str
    backend: str
    tp_rank: int
    agent_md: bytes
    layout: LayoutInfo


class ProbeWrite(Msg, tag="probe_write"):
    """Doctor -> engine: write your block ``block_id`` (every layer and part, in layout
    order) into my region ``region_id`` from ``offset``, with your agent."""

    agent_md: bytes
    block_id: int
    region_id: int
    offset: int


class ProbeStatus(Msg, tag="probe_status"):
    """Doctor -> engine: how did the write of my last ProbeWrite end?"""

    doctor: str


class ProbeResult(Msg, tag="probe_result"):
    """Engine -> doctor: ``state`` is "posted", "pending", "done", "failed", "refused"
    or "unknown" (no probe of that doctor); ``detail`` says why."""

    state: str
    detail: str = ""


AnyMsg = (Hello | Welcome | Done | Renew | Release | WriteReq | Cancel | Written | Aborted | Reply | Error
          | Probe | ProbeInfo | ProbeWrite | ProbeStatus | ProbeResult)
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(AnyMsg)


class _Version(msgspec.Struct):
    """Just the version of any message (other fields ignored), read before strict decoding."""

    v: int = -1


_VERSION_DECODER = msgspec.msgpack.Decoder(_Version)


def encode(msg: Msg) -> bytes:
    return _ENCODER.encode(msg)


def decode(data: bytes) -> Msg:
    return _DECODER.decode(data)


def peek_version(data: bytes) -> int | None:
    """The ``v`` field of a message body, or None when it is not a msgpack map."""
    try:
        return _VERSION_DECODER.decode(data).v
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


# --------------------------------------------------------------------------------------
# Scheduler -> worker metadata (pickled by vLLM between processes).


@dataclass
class RecvJob:
    """Consumer: load ``key`` into ``local_block_ids`` from the producer at host:port."""

    req_id: str
    key: str
    mode: str
    local_block_ids: list[int]
    remote_block_ids: list[int]
    host: str
    port: int
    remote_engine_id: str = ""
    #: the producer's TP size from kv_transfer_params (0: not forwarded, assume ours)
    remote_tp: int = 0
    #: non-empty: the params could not be loaded from (the typed refusal's text); the
    #: worker fails this load at once so vLLM applies its load failure policy
    refused: str = ""
    #: time.time() when the scheduler allocated the blocks (start of the load's timings)
    created_at: float = 0.0
    #: hybrid models: ids per KV cache group in the flat lists ([]: one group; kv_groups.py)
    group_sizes: list[int] = field(default_factory=list)
    #: the token ``local_block_ids[0]`` starts at (blocks cached locally before it), and
    #: the producer's block size the scheduler paired ``remote_block_ids`` for (0: ours);
    #: another block size than ours pairs them by token position (block_sizes.py)
    first_token: int = 0
    remote_block_size: int = 0


@dataclass
class HoldJob:
    """Producer: keep ``block_ids`` of ``req_id`` under a lease until the consumer is done."""

    req_id: str
    key: str
    block_ids: list[int]
    group_sizes: list[int] = field(default_factory=list)  # as in RecvJob


@dataclass
class PeerNotice:
    """Tell a peer about ``key`` without a transfer (release: won't read; aborted)."""

    key: str
    host: str
    port: int
    kind: str  # "release" | "aborted" | "renew"
    remote_tp: int = 0  # the producer's TP size (0: not known, assume ours)


@dataclass
class KVTransportMetadata(KVConnectorMetadata):
    recv: list[RecvJob] = field(default_factory=list)
    hold: list[HoldJob] = field(default_factory=list)
    notices: list[PeerNotice] = field(default_factory=list)
