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

from kvtransport.options_schema import Option, OptionsSchema, anything, boolean, integer, one_of, text

__all__ = ["RDMA_KNOBS", "SCHEMA", "XGMI_KNOBS", "MoriioOptions", "parse_options", "default_host"]

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


def _knob(typ: type, minimum: int | None):
    """The check of one mori config knob: an optional bool, or an optional int >= minimum."""
    if typ is bool:
        return lambda v: v if v is None else boolean(v)
    return integer(minimum, optional=True)


#: Every option, its default and its check; a None value leaves the option at its default.
SCHEMA = OptionsSchema(
    "moriio",
    Option("transport", None, one_of(None, *_TRANSPORTS)),
    Option("host", None, text(what="a non-empty address string", optional=True)),
    Option("port", None, integer(0, 65535, optional=True)),
    Option("engine_key", None, text(optional=True)),
    Option("poll_cq_mode", None, one_of(None, *_POLL_MODES)),
    Option("mori_module", None, anything),  # the mori.io module to use (None: import the real one)
    *(Option(name, None, _knob(typ, minimum)) for name, (typ, minimum) in RDMA_KNOBS.items()),
    *(Option(name, None, integer(1, optional=True)) for name in XGMI_KNOBS),
)


def parse_options(options: Mapping[str, Any]) -> MoriioOptions:
    """Validate ``options``; unknown names and bad values raise ``BackendOptionError``."""
    o = SCHEMA.parse(options)
    opts = MoriioOptions()
    if o["transport"] is not None:
        opts.transport = o["transport"]
    if o["host"] is not None:
        opts.host = o["host"]
    if o["port"] is not None:
        opts.port = o["port"]
    opts.engine_key, opts.poll_cq_mode, opts.mori_module = o["engine_key"], o["poll_cq_mode"], o["mori_module"]
    opts.rdma = {k: o[k] for k in RDMA_KNOBS if o[k] is not None}
    opts.xgmi = {f: o[k] for k, f in XGMI_KNOBS.items() if o[k] is not None}
    if opts.transport == "xgmi" and (opts.rdma or opts.poll_cq_mode):
        raise SCHEMA.error(
            "RDMA options were given with transport='xgmi': "
            f"{', '.join(sorted(opts.rdma) + (['poll_cq_mode'] if opts.poll_cq_mode else []))}; "
            "drop them or use transport='rdma'"
        )
    if opts.transport == "rdma" and opts.xgmi:
        raise SCHEMA.error("xgmi_* options need transport='xgmi'")
    return opts
