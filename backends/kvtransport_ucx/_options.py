"""Backend options of ``kvt.open("ucx", **options)`` and how they map to UCX configuration.

The transport list is applied per UCP context with ``ucp_config_modify`` (not through the
process environment), so two agents in one process may use different transports.

Device memory and the transport list: UCX closes every memory domain that none of the
selected transports belongs to, so a list without UCX's device transports (``tcp``, ``shm``,
``cma,tcp``) gives a context that does not know CUDA memory, and ``register`` of a GPU cache
fails. ``device_memory`` adds them (:func:`with_device_transports`): ``"cuda"`` / ``"rocm"``
always (the agent will register that kind), ``"auto"`` (default) where the loaded UCX moves
that kind on this host, ``"none"`` never. They are UCX's own alias: ``cuda`` = cuda_copy
(recognises CUDA memory and stages it through host buffers for transports that cannot reach
the GPU, such as tcp), cuda_ipc (GPU to GPU on one host) and gdr_copy (GDRCopy, where its
driver is loaded; the libucx-cu12 wheel has no such module, and the alias, unlike the
transport name, draws no "not available" warning for it).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvtransport.errors import BackendOptionError
from kvtransport.spi import usable_cpus

from . import _native

#: Default ``lane_split_bytes`` over the network, and to a same-host peer reached with cma
#: (see :meth:`UcxOptions.split_bytes`).
LANE_SPLIT_BYTES = 2 << 20
CMA_LANE_SPLIT_BYTES = 8 << 20
#: Friendly names for ``tls``; anything else is passed to UCX_TLS verbatim.
TLS_ALIASES = {
    "tcp": "tcp",
    "shm": "sysv,posix,cma",  # shared memory for messages, cma (process_vm_readv/writev) for RMA
    "cma+tcp": "cma,tcp",  # same host: cma for RMA, tcp for messages, so UCX reports peer failure
}
#: UCX settings we change from UCX's defaults (a user's ``ucx_config`` overrides them).
#: RNDV_THRESH=inf: with UCX 1.22 and peer error handling, RMA is otherwise emulated with
#: active messages over tcp even between processes of one host; with it, ``ucp_put/get``
#: use the zero-copy lanes (cma on one host, tcp put_zcopy across hosts). Measured, see
#: docs/UCX.md. It only affects the AM/tag rendezvous protocol, which this backend does not use.
DEFAULT_UCX_CONFIG = {"RNDV_THRESH": "inf"}
#: Tuning applied only when this UCX knows the setting (a system UCX built without cma does
#: not): CMA_TX_QUOTA=16 lets one progress call run up to 16 queued cma copies instead of 1,
#: which cut the per-segment cost of scattered transfers (4096 x 16 KiB: 1.9 -> 2.8 GB/s,
#: measured, docs/UCX.md) while one call still holds the worker for at most ~1 ms.
#: TCP_TX_SEG_SIZE/TCP_RX_SEG_SIZE=1m (UCX: 8k/64k): over tcp UCX emulates a get with
#: active-message replies of at most one TX segment, so an 8 KiB segment made READ cost one
#: message per 8 KiB. Measured two processes over loopback tcp, 5 runs (docs/UCX.md):
#: READ 16 MiB 1.5 -> 3.4 GB/s, 256 MiB 1.6 -> 3.6, 4096 x 16 KiB 1.0 -> 1.8; WRITE level;
#: ~1 MiB more memory per lane. UCX refuses RX < TX, so a user's ``ucx_config`` setting
#: either one drops both of ours.
_TCP_SEGMENTS = {"TCP_TX_SEG_SIZE": "1m", "TCP_RX_SEG_SIZE": "1m"}
OPTIONAL_UCX_CONFIG = {"CMA_TX_QUOTA": "16", **_TCP_SEGMENTS}
#: Device memory kind -> UCX's ``UCX_TLS`` alias for its transports, and the one transport
#: without which UCX does not recognise that memory at all (``ucp_context.c`` alias table).
DEVICE_TLS_ALIAS = {"cuda": "cuda", "rocm": "rocm"}
_DEVICE_COPY_TL = {"cuda": "cuda_copy", "rocm": "rocm_copy"}
DEVICE_MEMORY = ("auto", "none", *DEVICE_TLS_ALIAS)
#: Transports that cannot report a dead peer (no UCP_ERR_HANDLING_MODE_PEER support).
_NO_PEER_FAILURE = {"sm", "shm", "sysv", "posix", "mm", "self", "knem", "xpmem"}
_TLS_RE = re.compile(r"^\^?[a-z0-9_]+(,[a-z0-9_]+)*$")
_KEY_RE = re.compile(r"^[A-Z0-9_]+$")

KNOWN = ("tls", "err_mode", "net_devices", "progress", "ucx_config", "liveness_interval_s",
         "cancel_grace_s", "inline_progress_s", "lanes", "lane_split_bytes", "post", "device_memory")


class DeviceTransportsExcluded(ValueError):
    """A transport list that explicitly denies a device kind's transports."""


def with_device_transports(tls: str, kind: str) -> str:
    """``tls`` (a ``UCX_TLS`` value) with the transports of device memory ``kind`` added.

    An allow list naming neither the kind's alias nor its copy transport gets the alias
    appended (``tcp`` -> ``tcp,cuda``); ``all``, a list that names them, or a deny list that
    does not deny them are returned unchanged. A deny list that denies them
    (``^cuda``, ``^cuda_copy``) raises :class:`DeviceTransportsExcluded`: it is the user's
    explicit choice, and only they can take it back."""
    alias, copy_tl = DEVICE_TLS_ALIAS[kind], _DEVICE_COPY_TL[kind]
    names = set(tls.lstrip("^").split(","))
    if tls.startswith("^"):
        if names & {alias, copy_tl}:
            raise DeviceTransportsExcluded(f"{tls!r} denies {sorted(names & {alias, copy_tl})}, without which UCX "
                                           f"does not recognise {kind} memory")
        return tls
    if tls == "all" or names & {alias, copy_tl}:
        return tls
    return f"{tls},{alias}"


def device_tls(tls: str | None, setting: str, device_memory: str, environ: Mapping[str, str],
               kinds_here: Callable[[], frozenset[str]], backend: str = "ucx") -> str | None:
    """The transport list to hand to UCX for ``device_memory`` (see the module docstring);
    the ``nixl`` backend resolves its UCX plugin's list with it too.

    ``tls`` is the explicit list (``setting`` names the option it came from), None when UCX
    reads ``UCX_TLS`` from ``environ`` (or uses its default). A user's ``UCX_TLS`` is not
    rewritten: with an explicit ``device_memory`` kind, one that leaves the kind out is refused
    naming it; with ``auto``, ``register`` explains the refusal if device memory comes."""
    def _err(msg: str) -> BackendOptionError:
        return BackendOptionError(f"{backend} backend: {msg}")

    if device_memory == "none":
        return tls
    if device_memory == "auto":
        explicit = tls is not None and tls != "all" and not tls.startswith("^")
        kinds = [k for k in DEVICE_TLS_ALIAS if k in kinds_here()] if explicit else []
    else:
        kinds = [device_memory]
    for kind in kinds:
        alias = DEVICE_TLS_ALIAS[kind]
        if tls is None:
            env = environ.get("UCX_TLS")
            if not env:
                continue
            try:
                fixed = with_device_transports(env, kind)
            except DeviceTransportsExcluded:
                fixed = None
            if fixed != env:
                fix = f"UCX_TLS={fixed}" if fixed else f"take '{alias}' and {_DEVICE_COPY_TL[kind]} out of UCX_TLS"
                raise _err(f"device_memory={device_memory!r} needs UCX's {kind} transports (UCX_TLS alias "
                           f"'{alias}': without {_DEVICE_COPY_TL[kind]} UCX does not recognise {kind} memory), but "
                           f"the environment's UCX_TLS={env!r} leaves them out. Fix: {fix}, or unset UCX_TLS, or "
                           f"give the {backend} option tls (e.g. tls='tcp'), to which device_memory adds them")
            continue
        try:
            tls = with_device_transports(tls, kind)
        except DeviceTransportsExcluded as why:
            raise _err(f"device_memory={device_memory!r} needs UCX's {kind} transports, but {setting} {why}. "
                       f"Fix: remove them from the deny list, or use device_memory='none' and keep {kind} "
                       "memory out of this agent") from None
    return tls


@dataclass(frozen=True)
class UcxOptions:
    tls: str | None = None  # resolved UCX_TLS value; None = UCX default / UCX_TLS from env
    err_mode: str = "peer"  # "peer" | "none"
    net_devices: str | None = None
    progress: str = "thread"  # "thread" (sleeps on the worker fd) | "busy" (spins)
    ucx_config: dict[str, str] = field(default_factory=dict)
    liveness_interval_s: float = 0.2
    cancel_grace_s: float = 2.0
    #: How long ``post`` may drive UCX progress on the caller's thread (see backend.py).
    inline_progress_s: float = 0.005
    #: UCP workers per agent; a large transfer is shared among them so that the posting
    #: thread and the progress thread copy in parallel (cma), or use more QPs (RDMA).
    lanes: int = 2
    #: Transfers smaller than this use lane 0 only; None: :meth:`split_bytes` decides.
    lane_split_bytes: int | None = None
    #: Resolved posting path: "native" (one call into the compiled _post.c per lane and
    #: transfer) or "ctypes" (one ctypes call per segment); see _native.py.
    post: str = "ctypes"
    #: The ``device_memory`` option as given ("auto", "none", "cuda", "rocm"); ``tls``
    #: already holds the device transports it added.
    device_memory: str = "auto"

    def may_use_cma(self) -> bool:
        """Whether same-host peers may be reached with cma (the UCX default, ``all``, or a
        transport list naming cma)."""
        if self.tls is None or self.tls == "all":
            return True
        return not self.tls.startswith("^") and "cma" in self.tls.split(",")

    def split_bytes(self, same_host: bool) -> int:
        """The size from which a transfer to a peer is shared among the lanes.

        The option wins when set. Otherwise: ``CMA_LANE_SPLIT_BYTES`` (8 MiB) to a same-host
        peer reached with cma, where the lane thread's hand-off (~0.1 ms) outweighs the copy
        it takes over below that (two processes, one 4 MiB READ: 338 us split, 225 us on one
        lane; 8 MiB even; 16 MiB 852 against 1112 us); ``LANE_SPLIT_BYTES`` (2 MiB) over the
        network, where a tcp READ gains from 4 MiB on (1242 against 1696 us)."""
        if self.lane_split_bytes is not None:
            return self.lane_split_bytes
        return CMA_LANE_SPLIT_BYTES if same_host and self.may_use_cma() else LANE_SPLIT_BYTES

    def optional_ucx_settings(self) -> dict[str, str]:
        """Our tuning defaults that a UCX build may not know (skipped there)."""
        skip = set(self.ucx_config)
        if skip & _TCP_SEGMENTS.keys():
            skip |= _TCP_SEGMENTS.keys()
        return {k: v for k, v in OPTIONAL_UCX_CONFIG.items() if k not in skip}

    def ucx_settings(self) -> dict[str, str]:
        """Settings that must apply (a refusal is a configuration error)."""
        cfg = {**DEFAULT_UCX_CONFIG, **self.ucx_config}
        if self.tls is not None:
            cfg["TLS"] = self.tls
        if self.net_devices is not None:
            cfg["NET_DEVICES"] = self.net_devices
        return cfg


def _err(msg: str) -> BackendOptionError:
    return BackendOptionError(f"ucx backend: {msg}")


def parse_options(options: Mapping[str, Any], environ: Mapping[str, str] = os.environ,
                  kinds_here: Callable[[], frozenset[str]] | None = None) -> UcxOptions:
    """Check the caller's options and resolve the transport list.

    ``environ`` is where UCX will read ``UCX_TLS`` from; ``kinds_here`` answers which device
    kinds the loaded UCX moves on this host (default: ask UCX, :func:`_memory.device_kinds_here`;
    only asked for ``device_memory='auto'`` with an explicit allow list)."""
    unknown = sorted(set(options) - set(KNOWN))
    if unknown:
        raise _err(f"unknown option(s) {unknown}; known options are {list(KNOWN)}")
    tls = options.get("tls")
    if tls is not None:
        if not isinstance(tls, str) or not tls:
            raise _err(f"tls must be a string such as 'tcp', 'shm', 'cma+tcp' or 'sysv,posix,cma', got {tls!r}")
        tls = TLS_ALIASES.get(tls, tls)
        if tls in ("auto", "all"):
            tls = None if tls == "auto" else "all"
        elif not _TLS_RE.match(tls):
            raise _err(f"tls={tls!r} is not a comma-separated UCX transport list (e.g. 'tcp', 'sysv,posix,cma')")
    listed = set((tls or "").lstrip("^").split(",")) - {""}
    default_mode = "none" if listed and not tls.startswith("^") and listed <= _NO_PEER_FAILURE | {"cma"} \
        else "peer"
    err_mode = options.get("err_mode", "auto")
    if err_mode == "auto":
        err_mode = default_mode
    if err_mode not in ("peer", "none"):
        raise _err(f"err_mode must be 'auto', 'peer' or 'none', got {err_mode!r}")
    if err_mode == "peer" and default_mode == "none":
        raise _err(f"err_mode='peer' needs a transport that reports peer failure (tcp, verbs); "
                   f"tls={tls!r} has none. Use err_mode='auto' (liveness by pid for same-host peers) or tls='cma+tcp'")
    progress = options.get("progress", "thread")
    if progress not in ("thread", "busy"):
        raise _err(f"progress must be 'thread' or 'busy', got {progress!r}")
    net = options.get("net_devices")
    if net is not None and (not isinstance(net, str) or not net):
        raise _err(f"net_devices must be a UCX_NET_DEVICES string such as 'eth0' or 'all', got {net!r}")
    extra = options.get("ucx_config") or {}
    if not isinstance(extra, Mapping):
        raise _err(f"ucx_config must be a mapping of UCX settings without the UCX_ prefix, got {extra!r}")
    extra_s: dict[str, str] = {}
    for k, v in extra.items():
        key = str(k).upper().removeprefix("UCX_")
        if not _KEY_RE.match(key):
            raise _err(f"ucx_config key {k!r} is not a UCX setting name")
        extra_s[key] = str(v)
    try:
        live = float(options.get("liveness_interval_s", 0.2))
        grace = float(options.get("cancel_grace_s", 2.0))
        inline = float(options.get("inline_progress_s", 0.005))
    except (TypeError, ValueError) as exc:
        raise _err(f"liveness_interval_s, cancel_grace_s and inline_progress_s must be numbers: {exc}") from None
    if not (live > 0 and grace >= 0 and 0 <= inline <= 1.0):
        raise _err("liveness_interval_s must be > 0, cancel_grace_s >= 0 and inline_progress_s in [0, 1] "
                   f"(got {live}, {grace}, {inline})")
    # Default: two lanes, or one when this thread may run on one CPU only (a pinned engine).
    lanes = options.get("lanes", min(2, usable_cpus()))
    split = options.get("lane_split_bytes")
    if isinstance(lanes, bool) or not isinstance(lanes, int) or not 1 <= lanes <= 8:
        raise _err(f"lanes must be an integer from 1 to 8 (UCP workers per agent), got {lanes!r}")
    if split is not None and (isinstance(split, bool) or not isinstance(split, int) or split < 0):
        raise _err(f"lane_split_bytes must be a non-negative integer, got {split!r}")
    post = _native.resolve(options.get("post"))
    device = options.get("device_memory", "auto")
    if device not in DEVICE_MEMORY:
        raise _err(f"device_memory must be one of {list(DEVICE_MEMORY)} (the device memory this agent will "
                   f"register: its UCX transports are added to an explicit tls list), got {device!r}")
    if kinds_here is None:
        from ._memory import device_kinds_here as kinds_here  # loads libucp: only when needed
    if tls is not None or "TLS" not in extra_s:
        tls = device_tls(tls, "tls", device, environ, kinds_here)
    else:  # the list came in ucx_config: add to it there
        extra_s["TLS"] = device_tls(extra_s["TLS"], "ucx_config TLS", device, environ, kinds_here)
    return UcxOptions(tls, err_mode, net, progress, extra_s, live, grace, inline, lanes, split, post, device)
