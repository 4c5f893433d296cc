"""API drift guard: checks that run against whichever vLLM is installed (0.32 in CI, the
official 0.33 wheel by hand, see docs/VLLM_COMPAT.md), so a vLLM change that breaks the
connector shows up here as a failure naming the method, not as a crash in a serving
engine.

* every abstract method of ``KVConnectorBase_V1`` (and ``SupportsHMA``) is implemented;
* every base method the connector overrides keeps a call-compatible signature: each base
  parameter is accepted under the same name and kind, extra parameters have defaults, a
  classmethod stays a classmethod, a property stays a property;
* the connector constructs with ``(vllm_config, role, kv_cache_config)`` — positionally
  and by keyword, as vLLM's factory does — in both roles, and through the factory by
  name (plugin registration);
* the stats class honours ``KVConnectorStats``' contract (aggregate / reduce / reset).
"""

from __future__ import annotations

import inspect

import pytest

from harness import make_vllm_config
from kvtransport_vllm.connector import KVTransportConnector
from kvtransport_vllm.plugin import CONNECTOR_NAME, register
from kvtransport_vllm.stats import KVTransportStats
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1 import base as vbase
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

_EXTRA = {"backend": "loopback", "mode": "read", "side_channel_port": 5999}
register()  # VllmConfig resolves the connector name while validating


def _base_classes() -> list[type]:
    out = [KVConnectorBase_V1]
    hma = getattr(vbase, "SupportsHMA", None)
    if hma is not None:
        out.append(hma)
    return out


def _raw(cls: type, name: str):
    """The attribute as defined (classmethod / staticmethod / property kept), via the MRO."""
    for k in cls.__mro__:
        if name in vars(k):
            return k, vars(k)[name]
    raise AttributeError(name)


def _overridden() -> list[tuple[type, str]]:
    """(base, name) of every public or hook method both a vLLM base and we define."""
    out = []
    for b in _base_classes():
        for name, attr in vars(b).items():
            if name.startswith("__") or name in ("_abc_impl",):
                continue
            owner, _ = _raw(KVTransportConnector, name)
            if owner is KVTransportConnector:
                out.append((b, name))
    return out


def test_all_abstract_methods_implemented():
    missing = sorted(getattr(KVTransportConnector, "__abstractmethods__", ()))
    assert not missing, f"KVTransportConnector does not implement abstract {missing} of the installed vLLM"
    for b in _base_classes():
        for name in sorted(getattr(b, "__abstractmethods__", ())):
            owner, _ = _raw(KVTransportConnector, name)
            assert owner is KVTransportConnector, f"{b.__name__}.{name} is abstract and not overridden"


def _check_signature(base_fn, ours_fn, where: str) -> None:
    bsig, osig = inspect.signature(base_fn), inspect.signature(ours_fn)
    oparams = list(osig.parameters.values())
    has_var_kw = any(p.kind is p.VAR_KEYWORD for p in oparams)
    has_var_pos = any(p.kind is p.VAR_POSITIONAL for p in oparams)
    positional = [p for p in oparams if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    bpos = 0
    for bp in bsig.parameters.values():
        if bp.kind is bp.VAR_KEYWORD:
            assert has_var_kw, f"{where}: base takes **{bp.name}, ours does not"
            continue
        if bp.kind is bp.VAR_POSITIONAL:
            assert has_var_pos, f"{where}: base takes *{bp.name}, ours does not"
            continue
        op = osig.parameters.get(bp.name)
        if bp.kind in (bp.POSITIONAL_ONLY, bp.POSITIONAL_OR_KEYWORD):
            # vLLM may pass it positionally at this index or by name
            assert bpos < len(positional) or has_var_pos, f"{where}: parameter {bp.name!r} not accepted"
            if bpos < len(positional):
                assert positional[bpos].name == bp.name or bp.kind is bp.POSITIONAL_ONLY, (
                    f"{where}: parameter {bpos} is {positional[bpos].name!r}, vLLM's is {bp.name!r}")
            bpos += 1
        else:  # keyword-only
            assert op is not None or has_var_kw, f"{where}: keyword {bp.name!r} not accepted"
        if bp.default is not bp.empty:
            assert op is None or op.default is not op.empty or has_var_kw, (
                f"{where}: vLLM's {bp.name!r} is optional, ours is required")
    base_names = set(bsig.parameters)
    for op in oparams:
        if op.name not in base_names and op.kind not in (op.VAR_POSITIONAL, op.VAR_KEYWORD):
            assert op.default is not op.empty, f"{where}: our extra parameter {op.name!r} needs a default"


@pytest.mark.parametrize("base_cls, name", _overridden(), ids=lambda x: getattr(x, "__name__", x))
def test_override_signature_compatible(base_cls, name):
    _, battr = _raw(base_cls, name)
    _, oattr = _raw(KVTransportConnector, name)
    where = f"KVTransportConnector.{name}"
    for kind in (classmethod, staticmethod, property):
        assert isinstance(oattr, kind) == isinstance(battr, kind), (
            f"{where}: vLLM declares it {type(battr).__name__}, ours is {type(oattr).__name__}")
    if isinstance(battr, property):
        return
    unwrap = (lambda a: a.__func__) if isinstance(battr, (classmethod, staticmethod)) else (lambda a: a)
    _check_signature(unwrap(battr), unwrap(oattr), where)


def test_overrides_found():
    """The drift check above really inspects the connector (guards an empty parametrisation)."""
    names = {n for _, n in _overridden()}
    assert {"get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
            "start_load_kv", "save_kv_layer", "wait_for_save", "get_finished", "request_finished"} <= names


@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER])
def test_constructs_with_vllm_arguments(role):
    cfg = make_vllm_config("kv_both", dict(_EXTRA), engine_id="compat")
    kvc = _kv_cache_config()
    for conn in (KVTransportConnector(cfg, role, kvc),
                 KVTransportConnector(vllm_config=cfg, role=role, kv_cache_config=kvc)):
        assert conn.role == role
        assert isinstance(conn, KVConnectorBase_V1)
        if hasattr(vbase, "supports_hma"):
            assert vbase.supports_hma(conn)
        conn.shutdown()


def _kv_cache_config():
    import torch

    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    return KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(
        ["layers.0", "layers.1"], FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64,
                                                    dtype=torch.float32))])


def test_factory_creates_registered_connector():
    register()
    register()  # idempotent (vLLM loads plugins in every process, sometimes twice)
    cfg = make_vllm_config("kv_consumer", dict(_EXTRA), engine_id="compat-f")
    assert KVConnectorFactory.get_connector_class(cfg.kv_transfer_config) is KVTransportConnector
    conn = KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, _kv_cache_config())
    assert type(conn) is KVTransportConnector and conn.role == KVConnectorRole.SCHEDULER
    assert CONNECTOR_NAME == cfg.kv_transfer_config.kv_connector


def test_sleep_mode_refused():
    """Sleep mode would free / remap KV memory peers still address: refused on every
    version (0.33 asks supports_sleep_mode, 0.32 has no hook so the constructor refuses)."""
    if hasattr(KVConnectorBase_V1, "supports_sleep_mode"):
        assert KVConnectorBase_V1.supports_sleep_mode(None) is True  # vLLM's default: we must override
        assert KVTransportConnector.supports_sleep_mode(None) is False
    cfg = make_vllm_config("kv_consumer", dict(_EXTRA), engine_id="compat-s")
    cfg.model_config.enable_sleep_mode = True
    with pytest.raises(ValueError, match="sleep mode"):
        KVTransportConnector(cfg, KVConnectorRole.SCHEDULER, _kv_cache_config())


def test_stats_contract():
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

    a = KVTransportConnector.build_kv_connector_stats({"bytes": 10, "transfers": 1, "loads_ok": 1,
                                                        "latency_s_sum": 0.5, "latency_s_max": 0.5})
    b = KVTransportStats({"bytes": 5, "transfers": 2, "failures": 1, "latency_s_max": 0.9})
    assert isinstance(a, KVConnectorStats)
    assert not a.is_empty() and KVTransportStats().is_empty()
    red = a.aggregate(b).reduce()
    assert red["kv_bytes"] == 15 and red["kv_transfers"] == 3 and red["kv_load_failures"] == 1
    assert red["max_load_latency_ms"] == 900.0 and red["avg_load_latency_ms"] == 500.0
    assert all(isinstance(v, (int, float)) for v in red.values())
    a.reset()
    assert a.is_empty()
    # side-channel refusals alone are worth a report, and add up across workers
    c = KVTransportStats({"sc_auth_failures": 2, "sc_dropped": 1})
    assert not c.is_empty()
    red = c.aggregate(KVTransportStats({"sc_auth_failures": 3, "sc_malformed": 1, "sc_version_mismatch": 4})).reduce()
    assert (red["kv_side_channel_auth_failures"], red["kv_side_channel_malformed"],
            red["kv_side_channel_version_mismatch"], red["kv_side_channel_dropped"]) == (5, 1, 4, 1)


def test_signature_check_detects_drift():
    """The checker itself fails on the drift it exists to catch."""

    def base(self, request, num_computed_tokens, *, hint=None): ...

    def renamed(self, req, num_computed_tokens, *, hint=None): ...

    def missing(self, request, *, hint=None): ...

    def required_extra(self, request, num_computed_tokens, extra, *, hint=None): ...

    def optional_made_required(self, request, num_computed_tokens, *, hint): ...

    def fine(self, request, num_computed_tokens, extra=1, **kwargs): ...

    _check_signature(base, fine, "fine")
    for bad in (renamed, missing, required_extra, optional_made_required):
        with pytest.raises(AssertionError):
            _check_signature(base, bad, bad.__name__)
