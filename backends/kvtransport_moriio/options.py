"""Backend options of ``kvtransport.open("moriio", **options)``, validated up front.

The RDMA tuning knobs are mori's own ``RdmaBackendConfig`` fields under the same names.
Each defaults to ``None``, meaning "leave mori's default": we construct mori's config with
no arguments and only assign the knobs the user set, so our defaults can never drift
from the installed mori's (``describe()`` reports the values actually in effect).
mori 1.2 defaults, for reference: qp_per_transfer=1, post_batch_size=-1 (auto),
num_worker_threads=-1 (auto), poll_cq_mode=polling, enable_transfer_chunking=False,
chunk_bytes=65536, max_chunks_per_transfer=64, num_nics_per_transfer=1.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvtransport.errors import BackendOptionError

__all__ = ["RDMA_KNOBS", "XGMI_KNOBS", "MoriioOptions", "parse_options", "default_host"]

#: option name -> (type, minimum allowed value or None). Names equal RdmaBackendConfig fields.
RDMA_KNOBS: dict[str, tuple[type, int | None]] = {
    "qp_per_transfer": (int, 1),
    "post_batch_size": (int, -1),
    "num_worker_threads": (int, -1),
    "enable_transfer_chunking": (bool, None),
    "chunk_bytes": (int, 1),
    "max_chunks_per_transfer": (int, 1),
    "num_nics_per_transfer": (int, 1),
    "notif_per_qp": (int, 1),
}
#: option name -> XgmiBackendConfig field.
XGMI_KNOBS: dict[str, str] = {"xgmi_num_streams": "num_streams", "xgmi_num_events": "num_events"}

_TRANSPORTS = ("rdma", "xgmi")
_POLL_MODES = ("polling", "event")


def default_host() -> str:
    """This node's address as peers would reach it: the hostname's IPv4 address."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


@dataclass
class MoriioOptions:
    transport: str = "rdma"
    #: Address mori's out-of-band TCP handshake and our notification socket bind to.
    host: str = field(default_factory=default_host)
    #: mori's out-of-band TCP port; 0 lets mori pick a free one.
    port: int = 0
    engine_key: str | None = None
    poll_cq_mode: str | None = None
    rdma: dict[str, Any] = field(default_factory=dict)
    xgmi: dict[str, int] = field(default_factory=dict)
    #: The ``mori.io`` module to use; None imports the real one. Tests inject a fake here.
    mori_module: Any = None


def _check_int(name: str, value: Any, minimum: int | None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BackendOptionError(f"moriio option {name!r} must be an int, got {value!r}")
    if minimum is not None and value < minimum:
        raise BackendOptionError(f"moriio option {name!r} must be >= {minimum}, got {value}")
    return value


def parse_options(options: Mapping[str, Any]) -> MoriioOptions:
    """Validate ``options``; unknown names and bad values raise ``BackendOptionError``."""
    opts = MoriioOptions()
    known = {"transport", "host", "port", "engine_key", "poll_cq_mode", "mori_module"}
    known |= set(RDMA_KNOBS) | set(XGMI_KNOBS)
    for name, value in options.items():
        if name not in known:
            raise BackendOptionError(
                f"unknown moriio option {name!r}; valid options: {', '.join(sorted(known))}"
            )
        if value is None:
            continue
        if name == "transport":
            if value not in _TRANSPORTS:
                raise BackendOptionError(f"moriio option 'transport' must be one of {_TRANSPORTS}, got {value!r}")
            opts.transport = value
        elif name == "host":
            if not isinstance(value, str) or not value:
                raise BackendOptionError(f"moriio option 'host' must be a non-empty address string, got {value!r}")
            opts.host = value
        elif name == "port":
            opts.port = _check_int(name, value, 0)
            if opts.port > 65535:
                raise BackendOptionError(f"moriio option 'port' must be <= 65535, got {value}")
        elif name == "engine_key":
            if not isinstance(value, str) or not value:
                raise BackendOptionError(f"moriio option 'engine_key' must be a non-empty string, got {value!r}")
            opts.engine_key = value
        elif name == "poll_cq_mode":
            if value not in _POLL_MODES:
                raise BackendOptionError(f"moriio option 'poll_cq_mode' must be one of {_POLL_MODES}, got {value!r}")
            opts.poll_cq_mode = value
        elif name == "mori_module":
            opts.mori_module = value
        elif name in RDMA_KNOBS:
            typ, minimum = RDMA_KNOBS[name]
            if typ is bool:
                if not isinstance(value, bool):
                    raise BackendOptionError(f"moriio option {name!r} must be a bool, got {value!r}")
                opts.rdma[name] = value
            else:
                opts.rdma[name] = _check_int(name, value, minimum)
        else:  # XGMI knob
            opts.xgmi[XGMI_KNOBS[name]] = _check_int(name, value, 1)
    if opts.transport == "xgmi" and (opts.rdma or opts.poll_cq_mode):
        raise BackendOptionError(
            "moriio RDMA options were given with transport='xgmi': "
            f"{', '.join(sorted(opts.rdma) + (['poll_cq_mode'] if opts.poll_cq_mode else []))}; "
            "drop them or use transport='rdma'"
        )
    if opts.transport == "rdma" and opts.xgmi:
        raise BackendOptionError("moriio xgmi_* options need transport='xgmi'")
    return opts
