"""Pipeline and context parallelism are refused at start-up, naming the setting.

What a user sees: an engine started with ``--pipeline-parallel-size 2``, or with prefill or
decode context parallelism, and KVTransportConnector fails at connector construction (both
roles: engine core and worker) with the connector's config error naming the flag, instead
of two pipeline stages claiming the same side-channel port (ports are per DP and TP rank)
or KV blocks of the wrong layers or tokens being moved. Checked through real ``VllmConfig``
objects of the tiny model, built as the vLLM harness builds them, with a real
``ParallelConfig``; tensor parallelism alone is still accepted.
"""

from __future__ import annotations

import dataclasses

import pytest
from vllm.config import ParallelConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from harness import free_port_base, make_vllm_config
from kvtransport_vllm.config import ConnectorConfig, ConnectorConfigError
from kvtransport_vllm.plugin import register


def _config(**parallel):
    cfg = make_vllm_config("kv_producer", {"side_channel_port": free_port_base(), "side_channel_auth": "off"})
    (name, size), = parallel.items()
    if name != "pipeline_parallel_size":
        # vLLM accepts DCP only with more TP ranks than KV heads and heads divisible by TP (the
        # 2-head tiny model cannot), and this CPU build's model runner refuses PCP itself (a GPU
        # build's need not): the validated config gets the field as vLLM stores it
        setattr(cfg.parallel_config, name, size)
        return cfg
    # a real ParallelConfig with the layout, validated by vLLM itself, in the engine's config
    return dataclasses.replace(cfg, parallel_config=ParallelConfig(**parallel))


@pytest.mark.parametrize("parallel, flag", [
    ({"pipeline_parallel_size": 2}, "--pipeline-parallel-size 2"),
    ({"decode_context_parallel_size": 2}, "--decode-context-parallel-size 2"),
    ({"prefill_context_parallel_size": 2}, "--prefill-context-parallel-size 2"),
], ids=["pp2", "dcp2", "pcp2"])
@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER], ids=["scheduler", "worker"])
def test_unsupported_parallel_layout_refused_at_construction_naming_the_setting(parallel, flag, role):
    register()
    cfg = _config(**parallel)
    (name,) = parallel
    assert getattr(cfg.parallel_config, name) == 2  # vLLM kept the layout
    with pytest.raises(ConnectorConfigError) as err:
        KVConnectorFactory.create_connector(cfg, role, None)
    msg = str(err.value)
    assert f"does not support {name} 2" in msg and flag in msg, msg
    assert msg.count("KVTransportConnector") == 1  # one message, naming the setting and the fix


def test_tensor_parallel_alone_is_accepted():
    cfg = _config(tensor_parallel_size=2)
    assert ConnectorConfig.from_vllm(cfg).kv_role == "kv_producer"
