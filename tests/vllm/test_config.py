"""Configuration, registration and start-up errors (issue points 1 and 8)."""

import pytest

from harness import Engine, free_port_base, make_vllm_config
from kvtransport_vllm.config import ConnectorConfig, ConnectorConfigError


def test_unknown_key_names_key_and_accepted_ones():
    with pytest.raises(ConnectorConfigError, match=r"unknown .*'bakend'.*accepted keys"):
        ConnectorConfig.from_extra("kv_consumer", "e", {"bakend": "loopback"})


@pytest.mark.parametrize("extra, msg", [
    ({"mode": "pull"}, "mode must be"),
    ({"load_failure_policy": "retry"}, "load_failure_policy"),
    ({"transfer_timeout_s": -1}, "transfer_timeout_s must be a finite number > 0"),
    ({"transfer_timeout_s": "nan"}, "transfer_timeout_s must be a finite number > 0"),
    ({"lease_s": "nan"}, "lease_s must be a finite number > 0"),  # a NaN lease never lapsed
    ({"lease_s": float("inf")}, "lease_s must be a finite number > 0"),
    ({"side_channel_port": float("inf")}, "side_channel_port must be a number"),
    ({"max_message_bytes": "inf"}, "max_message_bytes must be a number"),
    ({"gil_switch_interval_s": "nan"}, "gil_switch_interval_s must be between"),
    ({"transfer_timeout_s": 30, "lease_s": 5}, "lease_s .* must be >= transfer_timeout_s"),
    ({"backend_options": [1]}, "backend_options must be"),
    ({"kv_cache_layout": "HND"}, r"kv_cache_layout must be one of \['cross_layer', 'heads_outer', 'vllm'\]"),
])
def test_bad_values(extra, msg):
    with pytest.raises(ConnectorConfigError, match=msg):
        ConnectorConfig.from_extra("kv_consumer", "e", extra)


@pytest.mark.parametrize("layout", ["heads_outer", "cross_layer", "vllm"])
def test_kv_cache_layout_is_a_setting(layout):
    """The layout the connector asks vLLM for is an ordinary setting (not refused as unknown)."""
    ConnectorConfig.from_extra("kv_consumer", "e", {"kv_cache_layout": layout})


def test_bad_role():
    with pytest.raises(ConnectorConfigError, match="kv_role"):
        ConnectorConfig.from_extra("kv_prefill", "e", {})


def test_plugin_registers_name_idempotently():
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvtransport_vllm.connector import KVTransportConnector
    from kvtransport_vllm.plugin import register

    register()
    register()  # vLLM may load plugins twice in one process
    cfg = make_vllm_config("kv_consumer", {"side_channel_port": 1})
    assert KVConnectorFactory.get_connector_class(cfg.kv_transfer_config) is KVTransportConnector


def test_module_path_works_too():
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvtransport_vllm.connector import KVTransportConnector

    cfg = make_vllm_config("kv_consumer", {}, kv_connector_module_path="kvtransport_vllm.connector")
    assert KVConnectorFactory.get_connector_class(cfg.kv_transfer_config) is KVTransportConnector


def test_entry_point_declared():
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert eps.get("kvtransport") == "kvtransport_vllm.plugin:register"


def test_supports_hma_so_default_config_keeps_hma():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma

    from kvtransport_vllm.connector import KVTransportConnector

    assert supports_hma(KVTransportConnector)


def _groups(*specs):
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec([f"layer{i}"], spec) for i, spec in enumerate(specs)])


def test_full_and_sliding_window_groups_are_accepted():
    """A hybrid model (full attention + sliding window) starts with the hybrid KV cache
    manager on: the connector moves each group's own blocks (tests/vllm/test_hybrid.py)."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    from kvtransport_vllm.connector import KVTransportConnector

    cfg = make_vllm_config("kv_consumer", {})
    kcc = _groups(FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.float32),
                  SlidingWindowSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.float32,
                                    sliding_window=32))
    KVTransportConnector(cfg, KVConnectorRole.SCHEDULER, kcc)


def test_load_failure_policy_reaches_vllm_scheduler():
    base = free_port_base()
    e = Engine("kv_consumer", {"side_channel_port": base, "load_failure_policy": "recompute"},
               kv_load_failure_policy="fail")
    try:
        assert e.scheduler.recompute_kv_load_failures is True
    finally:
        e.close()


def test_side_channel_port_in_use_is_a_clear_error():
    import socket

    from kvtransport_vllm.side_channel import SideChannelError

    base = free_port_base()
    s = socket.socket()
    s.bind(("127.0.0.1", base))
    s.listen()
    try:
        with pytest.raises(SideChannelError, match="side_channel_port"):
            Engine("kv_consumer", {"side_channel_port": base})
    finally:
        s.close()


def test_gil_switch_interval_is_opt_in_and_checked():
    """Python's thread switch interval is a process-wide setting: the connector leaves it
    alone unless asked (applied by process_tuning.py, tests/vllm/test_process_tuning.py)."""
    assert ConnectorConfig.from_extra("kv_consumer", "e", {"side_channel_auth": "off"}).gil_switch_interval_s == 0
    on = ConnectorConfig.from_extra("kv_consumer", "e", {"side_channel_auth": "off", "gil_switch_interval_s": 0.0005})
    assert on.gil_switch_interval_s == pytest.approx(0.0005)
    with pytest.raises(ConnectorConfigError, match="gil_switch_interval_s"):
        ConnectorConfig.from_extra("kv_consumer", "e", {"side_channel_auth": "off", "gil_switch_interval_s": "fast"})
