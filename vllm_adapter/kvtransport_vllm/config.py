"""The connector's configuration, read only from vLLM's ``kv_transfer_config``.

Every key of ``kv_connector_extra_config`` is checked here, once, so that a typo is a
clear start-up error that names the key and the accepted ones, never a silent default.
"""

from __future__ import annotations

import ipaddress
import math
import os
import socket
from dataclasses import dataclass, field
from typing import Any

from kvtransport.auth import AUTH_OFF, AuthConfigError, Authenticator, load_secret

from .layout_request import LAYOUT_CONFIG_KEYS, layout_setting
from .spin_yield import SPIN_YIELD_MODES

__all__ = ["ConnectorConfig", "ConnectorConfigError", "EXTRA_CONFIG_KEYS", "AUTH_CHANNEL", "routable_host",
           "data_parallel_rank", "rank_port", "check_parallel_layout"]

#: Channel name bound into every side-channel MAC (a sealed message of another
#: kvtransport channel, e.g. the bench job, is refused here).
AUTH_CHANNEL = "kvtransport-vllm"


class ConnectorConfigError(ValueError):
    """``kv_transfer_config`` for KVTransportConnector is invalid; the message says how to fix it."""


#: Accepted keys of ``kv_connector_extra_config`` and what each means (docs/vllm/USAGE.md).
EXTRA_CONFIG_KEYS: dict[str, str] = {
    "backend": "kvtransport backend name (loopback, ucx, moriio or any installed entry point)",
    "mode": "read (decode pulls) or write (prefill pushes)",
    "backend_options": "dict of options passed to kvtransport.open() for the backend",
    "side_channel_host": "address this engine advertises for its side channel (default: $VLLM_HOST_IP, else the "
    "address of the default route's interface; start-up fails when neither exists on a networked host)",
    "side_channel_port": "base TCP port of the side channel; DP rank d, TP rank r listens on "
    "port + d * tp_size + r",
    "transfer_timeout_s": "a remote load ends (done or failed) within this many seconds",
    "lease_s": "producer keeps finished blocks this long without consumer progress",
    "load_failure_policy": "recompute or fail: what vLLM does with a failed load",
    "side_channel_secret": "cluster secret (>= 16 bytes) sealing every side-channel message (AES-256-GCM: encrypted and authenticated); "
    "default: $KVTRANSPORT_SECRET or the file $KVTRANSPORT_SECRET_FILE",
    "side_channel_auth": "on (default) or off: off disables side-channel authentication explicitly",
    "max_message_bytes": "largest side-channel message accepted (default 16 MiB)",
    "gil_switch_interval_s": "opt-in (default 0: Python's own 5 ms): Python thread switch interval set in each "
    "worker process running the connector, a process-wide change: the side-channel and copy threads wait at "
    "most this long for the GIL held by vLLM's busy worker loop",
    "vllm_spin_yield": "auto (default), sleep or sched_yield: how vLLM's busy-wait loops yield in the processes "
    "running the connector; auto uses sleep (time.sleep(0), keeps the side-channel thread served) while more vLLM "
    "worker processes share this process's CPUs than there are CPUs, else sched_yield (vLLM's own) "
    "(docs/vllm/USAGE.md, Busy-wait yield)",
    # vllm-router service discovery (discovery.py): MoRIIOConnector's key names
    "proxy_ip": "host of vllm-router's --vllm-discovery-address this engine registers with (default: none)",
    "proxy_ping_port": "port of vllm-router's --vllm-discovery-address (with proxy_ip)",
    "http_port": "this engine's --port, announced to vllm-router (with proxy_ip)",
    "kv_buffer_device": "auto (default: the transport moves the KV cache where it lives) or cpu (host staging: "
    "device blocks are copied through pinned host buffers, for transports without device memory support)",
    "layerwise_write": "false (default) or true: in mode write, a producer that knows the decode's block ids "
    "during its prefill (router flow) pushes each layer's completed blocks from save_kv_layer while the next "
    "layers compute; the rest follows when the prefill ends",
    "layerwise_layers_per_post": "with layerwise_write: consecutive layers sent in one post (default: the layer "
    "count / 8, rounded up, so at most 8 posts per prefill step; 1: every layer alone)",
    "kv_recompute_threshold": "decode side: a remote load of fewer tokens (beyond the local prefix hit) than this is "
    "not made, the prompt is computed locally and the producer's hold released at once; 0 (default) loads any",
    **LAYOUT_CONFIG_KEYS,
}

_MODES = ("read", "write")
_POLICIES = ("recompute", "fail")
_BUFFER_DEVICES = ("auto", "cpu")


#: Where the routing probe "sends": connect() on a datagram socket sends no packet, it only
#: makes the kernel pick the source address its routing table would use for that
#: destination, i.e. the address of the interface behind the default route (the way
#: vLLM's get_ip() finds the address peers reach it at). IPv4 first, then IPv6.
_ROUTE_PROBES = ((socket.AF_INET, ("8.8.8.8", 80)), (socket.AF_INET6, ("2001:4860:4860::8888", 80)))

_NO_ROUTE = (
    "KVTransportConnector: cannot pick the address peers should reach this engine's side "
    "channel at: VLLM_HOST_IP is unset and this host has network interfaces but no default "
    "route (IPv4 or IPv6) to choose among them. Set side_channel_host in "
    "kv_connector_extra_config (or VLLM_HOST_IP in the environment) to this host's address on "
    "the network the other engines use"
)


def routable_host() -> str | None:
    """This host's address on its default route (IPv4, else IPv6), or None without one.

    A loopback or unspecified answer is no answer: no other host could use it."""
    for family, target in _ROUTE_PROBES:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect(target)
                addr = str(s.getsockname()[0])
        except OSError:
            continue
        ip = ipaddress.ip_address(addr.split("%", 1)[0])
        if not (ip.is_loopback or ip.is_unspecified):
            return addr
    return None


def _loopback_only() -> bool:
    """True when no network interface but loopback is up: every peer is on this host."""
    for _, name in socket.if_nameindex():
        if name == "lo":
            continue
        try:
            with open(f"/sys/class/net/{name}/operstate") as f:
                if f.read().strip() != "down":
                    return False
        except OSError:
            return False  # cannot tell: assume a usable interface, so do not guess loopback
    return True


def _default_host() -> tuple[str, bool]:
    """(address to advertise, whether it was chosen here rather than given).

    ``VLLM_HOST_IP`` is the operator's choice, as for vLLM itself. Otherwise the address
    behind the default route; on a host with nothing but loopback, 127.0.0.1 (no other
    host exists for it). Anything else is ambiguous, and a wrong guess would make a
    remote decode engine time out on every load, so start-up fails naming the setting."""
    env = os.environ.get("VLLM_HOST_IP")
    if env:
        return env, False
    addr = routable_host()
    if addr is not None:
        return addr, True
    if _loopback_only():
        return "127.0.0.1", True
    raise ConnectorConfigError(_NO_ROUTE)


def _wildcard(host: str) -> str:
    """The any-address of ``host``'s family (what a server listens on to be reachable on
    every interface, loopback included)."""
    return "::" if ":" in host else "0.0.0.0"


@dataclass(frozen=True)
class ConnectorConfig:
    """Validated connector settings (see :data:`EXTRA_CONFIG_KEYS`)."""

    kv_role: str
    engine_id: str
    backend: str = "loopback"
    mode: str = "read"
    backend_options: dict[str, Any] = field(default_factory=dict)
    #: the address peers are told (in kv_transfer_params and hand-shakes) to reach us at
    side_channel_host: str = field(default_factory=lambda: _default_host()[0])
    side_channel_port: int = 5600
    transfer_timeout_s: float = 30.0
    lease_s: float = 60.0
    load_failure_policy: str | None = None
    #: Cluster secret sealing the side channel (kvtransport.auth); None only when authentication is explicitly off.
    side_channel_secret: bytes | None = field(default=None, repr=False)
    side_channel_auth: bool = True
    max_message_bytes: int = 16 * 1024 * 1024
    #: "auto": register the KV cache itself; "cpu": stage blocks through pinned host buffers
    kv_buffer_device: str = "auto"
    #: opt-in sys.setswitchinterval() in the worker process (process_tuning.py): our threads wait at most
    #: this long for the GIL held by vLLM's busy loop; 0 (default): leave Python's own interval
    gil_switch_interval_s: float = 0.0
    #: how vLLM's busy-wait loops yield in our processes (spin_yield.py): "auto", "sleep" or "sched_yield"
    vllm_spin_yield: str = "auto"
    #: WRITE: push each layer's completed prompt blocks during the prefill (layerwise.py)
    layerwise_write: bool = False
    #: layers per layer-wise post (0: the layer count / 8, rounded up; layerwise.py)
    layerwise_layers_per_post: int = 0
    #: consumer: fewer remotely loadable tokens than this are computed locally (0: always load)
    kv_recompute_threshold: int = 0
    #: True when side_channel_host was chosen by this module (default route or
    #: loopback-only host), False when given (extra config or VLLM_HOST_IP)
    side_channel_host_auto: bool = False
    #: vllm-router service discovery to register with (discovery.DiscoveryTarget); None: do not register
    discovery: Any = None

    @property
    def side_channel_bind_host(self) -> str:
        """The address the side-channel server listens on.

        A given address is listened on as given (the operator picked the network). A chosen
        one is only our best guess of the address peers use, so the server listens on every
        interface: peers on this host still reach it at 127.0.0.1, as they did when
        127.0.0.1 was the default, and remote peers at the advertised address. Every
        request must still be sealed with the cluster secret (kvtransport.auth)."""
        return _wildcard(self.side_channel_host) if self.side_channel_host_auto else self.side_channel_host

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def make_authenticator(self) -> Authenticator | None:
        """The side channel's sealer/opener; None only when auth is explicitly off."""
        if not self.side_channel_auth:
            return None
        if not self.side_channel_secret:
            raise ConnectorConfigError(_NO_SECRET)
        return Authenticator(self.side_channel_secret, AUTH_CHANNEL, max_nonces=1 << 18)

    @classmethod
    def from_extra(cls, kv_role: str | None, engine_id: str | None, extra: dict[str, Any] | None) -> ConnectorConfig:
        extra = dict(extra or {})
        if "side_channel_token" in extra:
            raise ConnectorConfigError(
                "KVTransportConnector: side_channel_token was replaced by sealed (authenticated, encrypted) messages: set "
                "side_channel_secret (the same value, >= 16 bytes, on every engine) in "
                "kv_connector_extra_config, or KVTRANSPORT_SECRET / KVTRANSPORT_SECRET_FILE in the "
                "environment; side_channel_auth: off disables authentication explicitly"
            )
        unknown = sorted(set(extra) - set(EXTRA_CONFIG_KEYS))
        if unknown:
            raise ConnectorConfigError(
                f"KVTransportConnector: unknown kv_connector_extra_config key(s) {unknown}; "
                f"accepted keys: {sorted(EXTRA_CONFIG_KEYS)}"
            )
        layout_setting(extra)  # the layout vLLM was asked for (connector classmethod): a bad value fails here too
        if kv_role not in ("kv_producer", "kv_consumer", "kv_both"):
            raise ConnectorConfigError(
                f"KVTransportConnector: kv_role must be kv_producer, kv_consumer or kv_both, got {kv_role!r}"
            )
        mode = str(extra.get("mode", "read")).lower()
        if mode not in _MODES:
            raise ConnectorConfigError(f"KVTransportConnector: mode must be 'read' or 'write', got {mode!r}")
        policy = extra.get("load_failure_policy")
        if policy is not None and policy not in _POLICIES:
            raise ConnectorConfigError(
                f"KVTransportConnector: load_failure_policy must be 'recompute' or 'fail', got {policy!r}"
            )
        opts = extra.get("backend_options", {}) or {}
        if not isinstance(opts, dict):
            raise ConnectorConfigError("KVTransportConnector: backend_options must be a JSON object (dict)")

        def _num(key: str, default: float, kind: type) -> Any:
            raw = extra.get(key, default)
            try:
                val = kind(raw)
            except (TypeError, ValueError, OverflowError):  # int(inf) overflows
                raise ConnectorConfigError(f"KVTransportConnector: {key} must be a number, got {raw!r}") from None
            if not math.isfinite(val) or val <= 0:  # NaN passes every comparison
                raise ConnectorConfigError(f"KVTransportConnector: {key} must be a finite number > 0, got {raw!r}")
            return val

        port = _num("side_channel_port", 5600, int)
        if port > 65535:
            raise ConnectorConfigError(f"KVTransportConnector: side_channel_port {port} is not a TCP port")
        timeout = _num("transfer_timeout_s", 30.0, float)
        lease = _num("lease_s", max(60.0, 2 * timeout), float)
        if lease < timeout:
            raise ConnectorConfigError(
                f"KVTransportConnector: lease_s ({lease}) must be >= transfer_timeout_s ({timeout}), "
                "otherwise the producer frees blocks while a consumer may still be reading them"
            )
        backend = extra.get("backend", "loopback")
        if not isinstance(backend, str) or not backend:
            raise ConnectorConfigError("KVTransportConnector: backend must be a non-empty string")
        auth_on, secret = _auth_settings(extra)
        buffer_device = str(extra.get("kv_buffer_device", "auto")).lower()
        if buffer_device not in _BUFFER_DEVICES:
            raise ConnectorConfigError(
                f"KVTransportConnector: kv_buffer_device must be 'auto' or 'cpu', got {extra.get('kv_buffer_device')!r}"
            )
        spin_yield = extra.get("vllm_spin_yield", "auto")
        if spin_yield not in SPIN_YIELD_MODES:
            raise ConnectorConfigError(
                f"KVTransportConnector: vllm_spin_yield must be 'auto', 'sleep' or 'sched_yield', got {spin_yield!r}")
        layerwise = extra.get("layerwise_write", False)
        if not isinstance(layerwise, bool):
            raise ConnectorConfigError(
                f"KVTransportConnector: layerwise_write must be true or false, got {layerwise!r}")
        if layerwise and mode != "write":
            raise ConnectorConfigError(
                "KVTransportConnector: layerwise_write needs mode 'write' (the producer pushes each layer); "
                "set mode 'write' on both engines or drop layerwise_write")
        if layerwise and buffer_device == "cpu":
            raise ConnectorConfigError(
                "KVTransportConnector: layerwise_write is not supported with kv_buffer_device 'cpu' (host staging "
                "copies whole requests, not layers); use kv_buffer_device 'auto' or drop layerwise_write")
        given = extra.get("side_channel_host")
        if given is not None and not isinstance(given, str):
            raise ConnectorConfigError(
                f"KVTransportConnector: side_channel_host must be a host name or address (a string), got {given!r}"
            )
        host, host_auto = (given.strip(), False) if given and given.strip() else _default_host()
        from .discovery import parse_discovery  # here: discovery.py imports this module's error type
        return cls(
            kv_role=kv_role,
            engine_id=str(engine_id or "engine"),
            backend=backend,
            mode=mode,
            backend_options=opts,
            side_channel_host=host,
            side_channel_host_auto=host_auto,
            side_channel_port=port,
            transfer_timeout_s=timeout,
            lease_s=lease,
            load_failure_policy=policy,
            side_channel_secret=secret,
            side_channel_auth=auth_on,
            max_message_bytes=_num("max_message_bytes", 16 * 1024 * 1024, int),
            kv_buffer_device=buffer_device,
            gil_switch_interval_s=_switch_interval(extra.get("gil_switch_interval_s", 0.0)),
            vllm_spin_yield=spin_yield,
            discovery=parse_discovery(extra),
            layerwise_write=layerwise,
            layerwise_layers_per_post=(_num("layerwise_layers_per_post", 1, int)
                                       if "layerwise_layers_per_post" in extra else 0),
            kv_recompute_threshold=(0 if extra.get("kv_recompute_threshold", 0) == 0
                                    else _num("kv_recompute_threshold", 0, int)),
        )

    @classmethod
    def from_vllm(cls, vllm_config: Any) -> ConnectorConfig:
        """The settings of ``vllm_config``'s ``kv_transfer_config``; an engine layout the
        connector cannot serve (:func:`check_parallel_layout`) is refused first."""
        check_parallel_layout(vllm_config)
        ktc = vllm_config.kv_transfer_config
        return cls.from_extra(ktc.kv_role, ktc.engine_id, ktc.kv_connector_extra_config)


#: Parallel settings the connector cannot serve: (ParallelConfig field, command-line flag, why).
_UNSUPPORTED_PARALLEL = (
    ("pipeline_parallel_size", "--pipeline-parallel-size",
     "each pipeline stage holds the KV cache of its own layers, but side-channel ports, hand-shakes and block "
     "layouts are per tensor-parallel rank only (two stages would claim the same port and describe half the layers "
     "each)"),
    ("decode_context_parallel_size", "--decode-context-parallel-size",
     "each rank holds every n-th token of a block, a layout the block transfer does not map"),
    ("prefill_context_parallel_size", "--prefill-context-parallel-size",
     "the prompt's tokens are split across ranks, a layout the block transfer does not map"),
)


def check_parallel_layout(vllm_config: Any) -> None:
    """Refuse, at start-up and naming the setting, parallel layouts the connector does
    not move correctly: pipeline parallelism and context parallelism (prefill or decode).
    Served instead, they would collide on side-channel ports or move KV blocks of the
    wrong layers or tokens. Tensor and data parallelism are supported."""
    pc = getattr(vllm_config, "parallel_config", None)
    if pc is None:
        return
    for name, flag, why in _UNSUPPORTED_PARALLEL:
        size = int(getattr(pc, name, 1) or 1)
        if size > 1:
            raise ConnectorConfigError(
                f"KVTransportConnector does not support {name} {size} ({flag} {size}): {why}. Start the engine "
                f"with {flag} 1 and use tensor parallelism (--tensor-parallel-size) or data parallelism instead.")


def data_parallel_rank(vllm_config: Any) -> int:
    """This engine's data-parallel rank, as vLLM's own connectors read it.

    ``parallel_config.data_parallel_index`` first: vLLM sets it to the DP rank in every
    engine-core process, whereas a dense (non-MoE) model's DP ranks are reconfigured as
    independent engines with ``data_parallel_rank`` reset to 0 (``ParallelConfig.
    reconfigure_for_independent_dp_rank``), so that field alone would give every rank the
    same ports. ``data_parallel_rank`` only for a vLLM without the index; 0 without a
    parallel config (DP=1)."""
    pc = getattr(vllm_config, "parallel_config", None)
    if pc is None:
        return 0
    rank = getattr(pc, "data_parallel_index", None)
    if rank is None:
        rank = getattr(pc, "data_parallel_rank", 0)
    return int(rank or 0)


def rank_port(base: int, dp_rank: int, tp_size: int, tp_rank: int = 0) -> int:
    """The side-channel port of (DP rank, TP rank): ``base + dp_rank * tp_size + tp_rank``.

    Every worker of every DP rank of one engine gets its own port from one configured
    base, so DP ranks on one host can share a configuration. ``tp_rank=0`` gives the DP
    rank's own base, which a producer advertises as ``remote_port``; a consumer adds its
    TP rank to it. DP=1 is ``base + tp_rank``, the layout before DP was handled. A port
    past 65535 is a start-up error naming the setting to lower."""
    if dp_rank < 0 or tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ConnectorConfigError(
            f"KVTransportConnector: invalid rank for the side-channel port: dp_rank {dp_rank}, "
            f"tp_rank {tp_rank}, tp_size {tp_size}")
    port = base + dp_rank * tp_size + tp_rank
    if port > 65535:
        raise ConnectorConfigError(
            f"KVTransportConnector: side_channel_port {base} + DP rank {dp_rank} x TP size {tp_size} + TP rank "
            f"{tp_rank} = {port} is not a TCP port; lower side_channel_port so that base + DP size x TP size - 1 "
            "<= 65535")
    return port


def _switch_interval(raw: Any) -> float:
    try:
        val = float(raw)
    except (TypeError, ValueError):
        raise ConnectorConfigError(f"KVTransportConnector: gil_switch_interval_s must be a number, got {raw!r}") from None
    if not 0 <= val <= 1:  # NaN included
        raise ConnectorConfigError(
            f"KVTransportConnector: gil_switch_interval_s must be between 0 (leave Python's default) and 1 s, got {raw!r}")
    return val


_NO_SECRET = (
    "KVTransportConnector: side-channel authentication is on but no cluster secret is set. "
    "Set side_channel_secret in kv_connector_extra_config, or KVTRANSPORT_SECRET (or "
    "KVTRANSPORT_SECRET_FILE) in the environment, to the same value (>= 16 bytes) on every "
    "engine; or disable authentication explicitly with side_channel_auth: off (or "
    "KVTRANSPORT_AUTH=off) on a trusted network"
)


def _auth_settings(extra: dict[str, Any]) -> tuple[bool, bytes | None]:
    """(auth on?, secret) from the extra config, else the environment (kvtransport.auth).

    Never silently open: without a secret and without an explicit "off", start-up fails.
    """
    mode = extra.get("side_channel_auth", "on")
    if isinstance(mode, bool):
        mode = "on" if mode else AUTH_OFF
    mode = str(mode).lower()
    if mode not in ("on", AUTH_OFF):
        raise ConnectorConfigError(f"KVTransportConnector: side_channel_auth must be 'on' or 'off', got {mode!r}")
    if mode == AUTH_OFF:
        return False, None
    raw = extra.get("side_channel_secret")
    if raw is not None and not isinstance(raw, str):
        raise ConnectorConfigError("KVTransportConnector: side_channel_secret must be a string")
    try:
        secret = load_secret(raw if raw else None)
    except AuthConfigError as exc:
        if "no cluster secret" in str(exc):
            raise ConnectorConfigError(_NO_SECRET) from None
        source = "side_channel_secret" if raw else "KVTRANSPORT_SECRET / KVTRANSPORT_SECRET_FILE"
        raise ConnectorConfigError(f"KVTransportConnector: {source}: {exc}") from None
    except OSError as exc:
        raise ConnectorConfigError(f"KVTransportConnector: cannot read KVTRANSPORT_SECRET_FILE: {exc}") from None
    return secret is not None, secret
