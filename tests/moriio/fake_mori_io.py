"""A recording FAKE of the ``mori.io`` surface (amd-mori 1.2.4), for testing our glue only.

This is not mori and proves nothing about mori. It lets the moriio backend's glue
(descriptor translation, offset grouping, status and peer-failure mapping, metadata round
trip) run on a machine without ROCm or an RDMA NIC. Method names and parameter lists
follow the real ``mori/io/engine.py`` read from the wheel; test_mori_signature_drift.py
checks that against the wheel on every run, so the fake cannot quietly drift.

"Data movement" is a ``ctypes.memmove`` between the registered addresses of two fake
engines living in the same process, so byte checks in the glue tests are meaningful for
the glue (right offsets, right regions, right direction), not for RDMA.

Every fake instance is independent: :func:`make_fake_mori_io` returns a fresh namespace
with its own fabric (engine registry, call log, fault switches); nothing is global.
"""

from __future__ import annotations

import collections
import ctypes
import enum
import itertools
import os
import socket
import types
from dataclasses import dataclass, field
from typing import Any

import msgspec

IS_FAKE = True
FAKE_VERSION = "fake-mori-io (signatures of amd-mori 1.2.4)"


# --------------------------------------------------------------------------- enums
class BackendType(enum.IntEnum):
    Unknown = 0
    XGMI = 1
    RDMA = 2
    TCP = 3
    FABRIC = 4


class MemoryLocationType(enum.IntEnum):
    Unknown = 0
    CPU = 1
    GPU = 2


class StatusCode(enum.IntEnum):
    SUCCESS = 0
    INIT = 1
    IN_PROGRESS = 2
    ERR_BEGIN = 10
    ERR_INVALID_ARGS = 11
    ERR_NOT_FOUND = 12
    ERR_RDMA_OP = 13
    ERR_BAD_STATE = 14
    ERR_GPU_OP = 15


class PollCqMode(enum.IntEnum):
    POLLING = 0
    EVENT = 1


class PeerFailureReason(enum.IntEnum):
    UNKNOWN = 0
    PEER_UNREACHABLE = 1
    LOCAL_QP_ERROR = 2
    LOCAL_PORT_DOWN = 3
    LOCAL_DEVICE_FATAL = 4
    LOCAL_CQ_ERROR = 5


# --------------------------------------------------------------------------- configs
class IOEngineConfig:
    __slots__ = ("host", "port")

    def __init__(self, host: str = "", port: int = 0) -> None:
        self.host = host
        self.port = port


class RdmaBackendConfig:
    # __slots__ make a misspelt knob an AttributeError, as with pybind11's def_readwrite.
    __slots__ = (
        "qp_per_transfer", "post_batch_size", "num_worker_threads", "poll_cq_mode",
        "enable_notification", "notif_per_qp", "enable_transfer_chunking", "chunk_bytes",
        "max_chunks_per_transfer", "num_nics_per_transfer", "max_send_wr", "max_cqe_num", "max_msg_sge",
    )

    def __init__(
        self,
        qp_per_transfer: int = 1,
        post_batch_size: int = -1,
        num_worker_threads: int = -1,
        poll_cq_mode: PollCqMode = PollCqMode.POLLING,
        enable_notification: bool = True,
        notif_per_qp: int = 1024,
        enable_transfer_chunking: bool = False,
        chunk_bytes: int = 65536,
        max_chunks_per_transfer: int = 64,
        num_nics_per_transfer: int = 1,
    ) -> None:
        self.qp_per_transfer = qp_per_transfer
        self.post_batch_size = post_batch_size
        self.num_worker_threads = num_worker_threads
        self.poll_cq_mode = poll_cq_mode
        self.enable_notification = enable_notification
        self.notif_per_qp = notif_per_qp
        self.enable_transfer_chunking = enable_transfer_chunking
        self.chunk_bytes = chunk_bytes
        self.max_chunks_per_transfer = max_chunks_per_transfer
        self.num_nics_per_transfer = num_nics_per_transfer
        self.max_send_wr = 0
        self.max_cqe_num = 0
        self.max_msg_sge = 0


class XgmiBackendConfig:
    __slots__ = ("num_streams", "num_events")

    def __init__(self, num_streams: int = 64, num_events: int = 64) -> None:
        self.num_streams = num_streams
        self.num_events = num_events


# --------------------------------------------------------------------------- descriptors
_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder()


class EngineDesc:
    def __init__(self, key: str, node_id: str, hostname: str, host: str, port: int, pid: int) -> None:
        self.key, self.node_id, self.hostname = key, node_id, hostname
        self.host, self.port, self.pid = host, port, pid

    def _tuple(self) -> tuple:
        return (self.key, self.node_id, self.hostname, self.host, self.port, self.pid)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, EngineDesc) and self._tuple() == other._tuple()

    def pack(self) -> bytes:
        return _enc.encode(["fake-engine-desc", *self._tuple()])

    @staticmethod
    def unpack(b: bytes) -> EngineDesc:
        obj = _dec.decode(b)  # raises msgspec.DecodeError on garbage, like msgpack in mori
        if not (isinstance(obj, list) and len(obj) == 7 and obj[0] == "fake-engine-desc"):
            raise RuntimeError("std::bad_cast")  # what msgpack's as<EngineDesc>() raises
        return EngineDesc(*obj[1:])


class MemoryDesc:
    def __init__(
        self,
        engine_key: str = "",
        id: int = 0,  # noqa: A002 - mori's field name
        device_id: int = -1,
        data: int = 0,
        size: int = 0,
        loc: MemoryLocationType = MemoryLocationType.Unknown,
    ) -> None:
        self.engine_key, self.id, self.device_id = engine_key, id, device_id
        self.data, self.size, self.loc = data, size, loc
        self.device_bus_id = ""
        self.numa_node = -1
        self.ipc_handle = b"\0" * 64

    def _tuple(self) -> tuple:
        return (self.engine_key, self.id, self.device_id, self.data, self.size, int(self.loc))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MemoryDesc) and self._tuple() == other._tuple()

    def __hash__(self) -> int:
        return hash(self._tuple())

    def pack(self) -> bytes:
        return _enc.encode(["fake-memory-desc", *self._tuple()])

    @staticmethod
    def unpack(b: bytes) -> MemoryDesc:
        obj = _dec.decode(b)
        if not (isinstance(obj, list) and len(obj) == 7 and obj[0] == "fake-memory-desc"):
            raise RuntimeError("std::bad_cast")
        key, mid, dev, data, size, loc = obj[1:]
        return MemoryDesc(key, mid, dev, data, size, MemoryLocationType(loc))


@dataclass
class PeerFailureEvent:
    remote_engine_key: str = ""
    reason: PeerFailureReason = PeerFailureReason.UNKNOWN
    qp_num: int = 0
    port_num: int = 0
    device_name: str = "fake_mlx5_0"
    detail: str = ""


class TransferStatus:
    """Like mori's: ``Code()`` also drives progress (here: the fabric's deferred work)."""

    def __init__(self) -> None:
        self._code = StatusCode.INIT
        self._msg = ""
        self._on_poll: Any = None  # callable run by Code() while in progress (fake progress)

    def Code(self) -> StatusCode:  # noqa: N802 - mori's name
        if self._code == StatusCode.IN_PROGRESS and self._on_poll is not None:
            self._on_poll(self)
        return self._code

    def Message(self) -> str:  # noqa: N802
        return self._msg

    def Update(self, val: StatusCode, message: str) -> None:  # noqa: N802
        if self._code > StatusCode.ERR_BEGIN:
            return
        self._code, self._msg = val, message

    def SetCode(self, val: StatusCode) -> None:  # noqa: N802
        self._code = val

    def SetMessage(self, val: str) -> None:  # noqa: N802
        self._msg = val

    def Init(self) -> bool:  # noqa: N802
        return self.Code() == StatusCode.INIT

    def InProgress(self) -> bool:  # noqa: N802
        return self.Code() == StatusCode.IN_PROGRESS

    def Succeeded(self) -> bool:  # noqa: N802
        return self.Code() == StatusCode.SUCCESS

    def Failed(self) -> bool:  # noqa: N802
        return self.Code() > StatusCode.ERR_BEGIN


# --------------------------------------------------------------------------- fabric
@dataclass
class BatchRecord:
    """One session batch call as the fake saw it."""

    op: str  # "read" | "write"
    engine_key: str
    local_mem_id: int
    remote_engine_key: str
    remote_mem_id: int
    local_offsets: list[int]
    remote_offsets: list[int]
    sizes: list[int]
    transfer_uid: int
    status: TransferStatus


@dataclass
class FakeFabric:
    """What connects fake engines in one process, plus the test's switches."""

    #: "immediate": bytes move inside batch_read/batch_write and the status is SUCCESS.
    #: "deferred": status stays IN_PROGRESS until complete_all() (or polls_to_complete polls).
    mode: str = "immediate"
    polls_to_complete: int | None = None
    engines: dict[str, Any] = field(default_factory=dict)
    calls: list[tuple[str, str, str, int, dict]] = field(default_factory=list)
    batches: list[BatchRecord] = field(default_factory=list)
    pending: list[tuple[BatchRecord, Any]] = field(default_factory=list)
    _fail_next: collections.deque = field(default_factory=collections.deque)
    _hang_next: int = 0
    _ports: Any = field(default_factory=lambda: itertools.count(40000))

    def record(self, engine_key: str, cls: str, method: str, args: tuple, kwargs: dict) -> None:
        self.calls.append((engine_key, cls, method, len(args), dict(kwargs)))

    def methods_called(self) -> set[tuple[str, str, int]]:
        return {(cls, m, n) for _, cls, m, n, _ in self.calls}

    # switches -------------------------------------------------------------
    def fail_next(self, code: StatusCode = StatusCode.ERR_RDMA_OP, message: str = "fake RDMA error", count: int = 1):
        for _ in range(count):
            self._fail_next.append((code, message))

    def hang_next(self, count: int = 1) -> None:
        """The next ``count`` batches stay IN_PROGRESS until complete_all()/fail_all()."""
        self._hang_next += count

    def complete_all(self) -> int:
        n = 0
        while self.pending:
            rec, job = self.pending.pop(0)
            if rec.status._code == StatusCode.IN_PROGRESS:
                job(rec)
                n += 1
        return n

    def fail_inflight_to(self, remote_key: str, message: str = "fake: QP flushed") -> int:
        """Complete every in-flight batch towards ``remote_key`` with ERR_RDMA_OP (no bytes)."""
        n = 0
        for rec, _job in list(self.pending):
            if rec.remote_engine_key == remote_key and rec.status._code == StatusCode.IN_PROGRESS:
                rec.status.Update(StatusCode.ERR_RDMA_OP, message)
                self.pending.remove((rec, _job))
                n += 1
        return n

    def inject_peer_failure(
        self,
        on_engine: str,
        remote_key: str,
        reason: PeerFailureReason = PeerFailureReason.PEER_UNREACHABLE,
        detail: str = "fake IBV_EVENT_QP_FATAL",
    ) -> None:
        self.engines[on_engine]._peer_failures.append(
            PeerFailureEvent(remote_engine_key=remote_key, reason=reason, qp_num=7 if remote_key else 0, detail=detail)
        )


# --------------------------------------------------------------------------- engine
class IOEngineSession:
    """Session between one local and one remote MemoryDesc (mori.io.IOEngineSession)."""

    def __init__(self, mori_sess: Any) -> None:
        self._sess = mori_sess  # (engine, local MemoryDesc, remote MemoryDesc)

    def allocate_transfer_uid(self) -> int:
        engine = self._sess[0]
        engine._rec("IOEngineSession", "allocate_transfer_uid", ())
        return engine._next_uid()

    def _batch(self, op: str, local_offsets, remote_offsets, sizes, transfer_uid) -> TransferStatus:
        engine, local, remote = self._sess
        fabric: FakeFabric = engine._fabric
        status = TransferStatus()
        for name, lst in (("local_offsets", local_offsets), ("remote_offsets", remote_offsets), ("sizes", sizes)):
            if not isinstance(lst, list) or not all(type(x) is int for x in lst):
                # mori's pybind11 std::vector<size_t> conversion wants a sequence of ints.
                raise TypeError(f"fake mori: {name} must be a list of int, got {type(lst).__name__}")
        rec = BatchRecord(op, engine.key, local.id, remote.engine_key, remote.id,
                          list(local_offsets), list(remote_offsets), list(sizes), transfer_uid, status)
        fabric.batches.append(rec)
        if not (len(local_offsets) == len(remote_offsets) == len(sizes)):
            status.Update(StatusCode.ERR_INVALID_ARGS, "offset and size lists differ in length")
            return status
        if fabric._fail_next:
            code, message = fabric._fail_next.popleft()
            status.Update(code, message)
            return status

        def job(r: BatchRecord) -> None:
            err = engine._move(r.op, local, remote, r.local_offsets, r.remote_offsets, r.sizes)
            r.status.Update(StatusCode.SUCCESS if err is None else StatusCode.ERR_RDMA_OP, err or "")

        if fabric._hang_next:
            fabric._hang_next -= 1
            status.SetCode(StatusCode.IN_PROGRESS)
            fabric.pending.append((rec, job))
            return status
        if fabric.mode == "deferred":
            status.SetCode(StatusCode.IN_PROGRESS)
            fabric.pending.append((rec, job))
            if fabric.polls_to_complete is not None:
                left = [fabric.polls_to_complete]

                def on_poll(st: TransferStatus) -> None:
                    left[0] -= 1
                    if left[0] <= 0 and (rec, job) in fabric.pending:
                        fabric.pending.remove((rec, job))
                        job(rec)

                status._on_poll = on_poll
            return status
        job(rec)
        return status

    def batch_read(self, local_offsets, remote_offsets, sizes, transfer_uid) -> TransferStatus:
        self._sess[0]._rec("IOEngineSession", "batch_read", (local_offsets, remote_offsets, sizes, transfer_uid))
        return self._batch("read", local_offsets, remote_offsets, sizes, transfer_uid)

    def batch_write(self, local_offsets, remote_offsets, sizes, transfer_uid) -> TransferStatus:
        self._sess[0]._rec("IOEngineSession", "batch_write", (local_offsets, remote_offsets, sizes, transfer_uid))
        return self._batch("write", local_offsets, remote_offsets, sizes, transfer_uid)

    def alive(self) -> bool:
        engine, _, remote = self._sess
        return remote.engine_key in engine._fabric.engines


class IOEngine:
    """Fake of mori.io.IOEngine; ``_fabric`` is bound by make_fake_mori_io."""

    _fabric: FakeFabric

    def __init__(self, key, config) -> None:
        if not isinstance(config, IOEngineConfig):
            raise TypeError("fake mori: IOEngine(key, config) needs an IOEngineConfig")
        self.key = key
        self._config = config
        self._backends: dict[BackendType, Any] = {}
        self._mem: dict[int, MemoryDesc] = {}
        self._remote: dict[str, EngineDesc] = {}
        self._uids = itertools.count(1)
        self._mem_ids = itertools.count(1)
        self._peer_failures: collections.deque = collections.deque()
        self._port = config.port
        self._fabric.engines[key] = self
        self._rec("IOEngine", "__init__", (key, config))

    def _rec(self, cls: str, method: str, args: tuple, kwargs: dict | None = None) -> None:
        self._fabric.record(self.key, cls, method, args, kwargs or {})

    def _next_uid(self) -> int:
        return next(self._uids)

    def _move(self, op, local: MemoryDesc, remote: MemoryDesc, lo, ro, sz) -> str | None:
        if local.id not in self._mem:
            return f"local memory {local.id} is not registered"
        peer = self._fabric.engines.get(remote.engine_key)
        if peer is None or remote.engine_key not in self._remote:
            return f"remote engine {remote.engine_key} is unreachable"
        if remote.id not in peer._mem:
            return f"remote memory {remote.id} is not registered"
        for a, b, n in zip(lo, ro, sz):
            if a + n > local.size or b + n > remote.size:
                return f"segment out of range (local {a}+{n}/{local.size}, remote {b}+{n}/{remote.size})"
        for a, b, n in zip(lo, ro, sz):
            if op == "read":
                ctypes.memmove(local.data + a, remote.data + b, n)
            else:
                ctypes.memmove(remote.data + b, local.data + a, n)
        return None

    def get_engine_desc(self) -> EngineDesc:
        self._rec("IOEngine", "get_engine_desc", ())
        return EngineDesc(self.key, "fake-node", socket.gethostname(), self._config.host, self._port, os.getpid())

    def create_backend(self, type, config=None):  # noqa: A002 - mori's parameter name
        self._rec("IOEngine", "create_backend", (type, config))
        if type is BackendType.RDMA:
            config = config or RdmaBackendConfig()
            if not isinstance(config, RdmaBackendConfig):
                raise TypeError("fake mori: RDMA backend needs an RdmaBackendConfig")
            if self._port == 0:
                self._port = next(self._fabric._ports)  # mori binds a free OOB port here
        elif type is BackendType.XGMI:
            config = config or XgmiBackendConfig()
            if not isinstance(config, XgmiBackendConfig):
                raise TypeError("fake mori: XGMI backend needs an XgmiBackendConfig")
        else:
            raise NotImplementedError("backend not implemented yet")
        self._backends[type] = config

    def remove_backend(self, type):  # noqa: A002
        self._rec("IOEngine", "remove_backend", (type,))
        self._backends.pop(type, None)

    def register_remote_engine(self, engine_desc):
        self._rec("IOEngine", "register_remote_engine", (engine_desc,))
        if not isinstance(engine_desc, EngineDesc):
            raise TypeError("fake mori: register_remote_engine needs an EngineDesc")
        self._remote[engine_desc.key] = engine_desc

    def deregister_remote_engine(self, engine_desc):
        self._rec("IOEngine", "deregister_remote_engine", (engine_desc,))
        self._remote.pop(engine_desc.key, None)

    def register_memory(self, ptr, size, device_id, mem_loc):
        self._rec("IOEngine", "register_memory", (ptr, size, device_id, mem_loc))
        if not isinstance(mem_loc, MemoryLocationType):
            raise TypeError("fake mori: mem_loc must be a MemoryLocationType")
        if mem_loc is MemoryLocationType.GPU:
            raise RuntimeError("fake mori: no GPU in this fake (register CPU memory)")
        md = MemoryDesc(self.key, next(self._mem_ids), device_id, int(ptr), int(size), mem_loc)
        self._mem[md.id] = md
        return md

    def register_torch_tensor(self, tensor):
        self._rec("IOEngine", "register_torch_tensor", (tensor,))
        if not tensor.is_contiguous():
            raise RuntimeError("input tensor must be contiguous")
        loc = MemoryLocationType.CPU if tensor.device.type == "cpu" else MemoryLocationType.GPU
        return self.register_memory(tensor.data_ptr(), tensor.nelement() * tensor.element_size(),
                                    -1 if tensor.device.index is None else tensor.device.index, loc)

    def deregister_memory(self, mem_desc):
        self._rec("IOEngine", "deregister_memory", (mem_desc,))
        self._mem.pop(mem_desc.id, None)

    def allocate_transfer_uid(self):
        self._rec("IOEngine", "allocate_transfer_uid", ())
        return self._next_uid()

    def create_session(self, local_mem, remote_mem):
        self._rec("IOEngine", "create_session", (local_mem, remote_mem))
        if local_mem.engine_key != self.key or local_mem.id not in self._mem:
            return None
        if remote_mem.engine_key not in self._remote:
            return None
        return IOEngineSession((self, local_mem, remote_mem))

    def pop_inbound_transfer_status(self, remote_key, transfer_uid):
        self._rec("IOEngine", "pop_inbound_transfer_status", (remote_key, transfer_uid))
        return None

    def pop_peer_failure(self):
        self._rec("IOEngine", "pop_peer_failure", ())
        return self._peer_failures.popleft() if self._peer_failures else None

    def wait_all(self, statuses, timeout_ms: int = -1):
        self._rec("IOEngine", "wait_all", (statuses,), {"timeout_ms": timeout_ms})
        self._fabric.complete_all()
        for s in statuses:
            if s.Failed():
                return s.Code()
        return StatusCode.SUCCESS


#: The classes a fake namespace exposes, by their mori.io names.
_EXPORTS = {
    "IOEngineConfig": IOEngineConfig,
    "StatusCode": StatusCode,
    "BackendType": BackendType,
    "EngineDesc": EngineDesc,
    "MemoryDesc": MemoryDesc,
    "MemoryLocationType": MemoryLocationType,
    "PeerFailureEvent": PeerFailureEvent,
    "PeerFailureReason": PeerFailureReason,
    "PollCqMode": PollCqMode,
    "RdmaBackendConfig": RdmaBackendConfig,
    "XgmiBackendConfig": XgmiBackendConfig,
    "IOEngineSession": IOEngineSession,
    "TransferStatus": TransferStatus,
}


def make_fake_mori_io(mode: str = "immediate", polls_to_complete: int | None = None) -> types.SimpleNamespace:
    """A fresh fake ``mori.io`` namespace with its own fabric (``ns.fabric``)."""
    fabric = FakeFabric(mode=mode, polls_to_complete=polls_to_complete)
    engine_cls = type("IOEngine", (IOEngine,), {"_fabric": fabric})
    return types.SimpleNamespace(IS_FAKE=True, FAKE_VERSION=FAKE_VERSION, fabric=fabric, IOEngine=engine_cls, **_EXPORTS)
