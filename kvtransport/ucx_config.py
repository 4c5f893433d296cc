"""UCX configuration shared by the backends that run UCX: ``ucx`` (directly) and ``nixl``
(NIXL's UCX plugin). Both take a ``tls`` option (a UCX transport list or a friendly alias)
and a ``ucx_config`` mapping of UCX settings, and both must add UCX's device transports to
an explicit list for device memory; this module says once what those are and how they are
checked, so the two backends cannot drift apart.

Device memory and the transport list: UCX closes every memory domain that none of the
selected transports belongs to, so a list without UCX's device transports (``tcp``, ``shm``,
``cma,tcp``) gives a context that does not know CUDA memory, and ``register`` of a GPU cache
fails. ``device_memory`` adds them (:func:`device_tls`): ``"cuda"`` / ``"rocm"`` always
(the agent will register that kind), ``"auto"`` where the loaded UCX moves that kind on this
host, ``"none"`` never. They are UCX's own alias: ``cuda`` = cuda_copy (recognises CUDA
memory and stages it through host buffers for transports that cannot reach the GPU, such as
tcp), cuda_ipc (GPU to GPU on one host) and gdr_copy (GDRCopy, where its driver is loaded;
the libucx-cu12 wheel has no such module, and the alias, unlike the transport name, draws no
"not available" warning for it).

Pure Python: no UCX library is loaded here.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from kvtransport.errors import BackendOptionError

__all__ = ["TLS_ALIASES", "DEVICE_TLS_ALIAS", "DeviceTransportsExcluded", "device_tls", "reports_peer_failure",
           "tls_setting", "ucx_environment", "ucx_settings",
           "with_device_transports"]

#: Friendly names for ``tls``; anything else is passed to UCX_TLS verbatim.
TLS_ALIASES = {
    "tcp": "tcp",
    "shm": "sysv,posix,cma",  # shared memory for messages, cma (process_vm_readv/writev) for RMA
    "cma+tcp": "cma,tcp",  # same host: cma for RMA, tcp for messages, so UCX reports peer failure
}
#: Transports that cannot report a dead peer (no ``UCP_ERR_HANDLING_MODE_PEER`` support);
#: cma can, but only over a transport that can (it sends no messages of its own).
_NO_PEER_FAILURE = frozenset({"sm", "shm", "sysv", "posix", "mm", "self", "knem", "xpmem", "cma"})
_TLS_RE = re.compile(r"^\^?[a-z0-9_]+(,[a-z0-9_]+)*$")
_KEY_RE = re.compile(r"^[A-Z0-9_]+$")
#: Device memory kind -> UCX's ``UCX_TLS`` alias for its transports, and the one transport
#: without which UCX does not recognise that memory at all (``ucp_context.c`` alias table).
DEVICE_TLS_ALIAS = {"cuda": "cuda", "rocm": "rocm"}
_DEVICE_COPY_TL = {"cuda": "cuda_copy", "rocm": "rocm_copy"}


def _err(backend: str, msg: str) -> BackendOptionError:
    return BackendOptionError(f"{backend} backend: {msg}")


def tls_setting(tls: Any, backend: str) -> str:
    """The ``tls`` option as a ``UCX_TLS`` value: an alias of :data:`TLS_ALIASES` resolved,
    anything else checked to be a comma-separated transport list (``^`` = deny list)."""
    if not isinstance(tls, str) or not tls:
        raise _err(backend, f"tls must be a string such as 'tcp', 'shm', 'cma+tcp' or 'sysv,posix,cma', got {tls!r}")
    tls = TLS_ALIASES.get(tls, tls)
    if not _TLS_RE.match(tls):
        raise _err(backend, f"tls={tls!r} is not a comma-separated UCX transport list (e.g. 'tcp', 'sysv,posix,cma')")
    return tls


def ucx_settings(extra: Any, backend: str) -> dict[str, str]:
    """The ``ucx_config`` option as UCX settings: keys upper-cased without the ``UCX_``
    prefix, values as strings; a key that is no UCX setting name is refused."""
    extra = extra or {}
    if not isinstance(extra, Mapping):
        raise _err(backend, f"ucx_config must be a mapping of UCX settings without the UCX_ prefix (such as "
                            f"{{'TLS': 'tcp'}}), got {extra!r}")
    out: dict[str, str] = {}
    for k, v in extra.items():
        key = str(k).upper().removeprefix("UCX_")
        if not _KEY_RE.match(key):
            raise _err(backend, f"ucx_config key {k!r} is not a UCX setting name")
        out[key] = str(v)
    return out


def reports_peer_failure(tls: str | None) -> bool:
    """Whether UCX can report a dead peer over the transport list ``tls`` (None = UCX's
    default): False for an allow list of shared-memory transports only (and cma)."""
    listed = set((tls or "").lstrip("^").split(",")) - {""}
    return not (listed and not (tls or "").startswith("^") and listed <= _NO_PEER_FAILURE)


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
    """The transport list to hand to UCX for ``device_memory`` (see the module docstring).

    ``tls`` is the explicit list (``setting`` names the option it came from), None when UCX
    reads ``UCX_TLS`` from ``environ`` (or uses its default). A user's ``UCX_TLS`` is not
    rewritten: with an explicit ``device_memory`` kind, one that leaves the kind out is refused
    naming it; with ``auto``, ``register`` explains the refusal if device memory comes."""
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
                raise _err(backend, f"device_memory={device_memory!r} needs UCX's {kind} transports (UCX_TLS alias "
                           f"'{alias}': without {_DEVICE_COPY_TL[kind]} UCX does not recognise {kind} memory), but "
                           f"the environment's UCX_TLS={env!r} leaves them out. Fix: {fix}, or unset UCX_TLS, or "
                           f"give the {backend} option tls (e.g. tls='tcp'), to which device_memory adds them")
            continue
        try:
            tls = with_device_transports(tls, kind)
        except DeviceTransportsExcluded as why:
            raise _err(backend, f"device_memory={device_memory!r} needs UCX's {kind} transports, but {setting} {why}. "
                       f"Fix: remove them from the deny list, or use device_memory='none' and keep {kind} "
                       "memory out of this agent") from None
    return tls


#: One process environment: UCX_* settings are applied while one UCX context starts at a time.
_ENV_LOCK = threading.Lock()


@contextlib.contextmanager
def ucx_environment(settings: Mapping[str, str]) -> Iterator[None]:
    """``UCX_*`` variables set from ``settings`` (names without the prefix) while a library
    that reads them creates its UCP context (NIXL's UCX plugin, which has no per-agent
    configuration call: the only way to choose transports per agent), then restored."""
    if not settings:
        yield
        return
    with _ENV_LOCK:
        saved = {k: os.environ.get(f"UCX_{k}") for k in settings}
        os.environ.update({f"UCX_{k}": v for k, v in settings.items()})
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(f"UCX_{k}", None)
                else:
                    os.environ[f"UCX_{k}"] = v
