"""vLLM general plugin: makes ``"kv_connector": "KVTransportConnector"`` work without
``kv_connector_module_path`` (entry point ``vllm.general_plugins: kvtransport``)."""

from __future__ import annotations

CONNECTOR_NAME = "KVTransportConnector"


def register() -> None:
    """Register the connector with vLLM's factory; idempotent (vLLM loads plugins in
    every process, sometimes more than once)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME in KVConnectorFactory._registry:
        return
    KVConnectorFactory.register_connector(CONNECTOR_NAME, "kvtransport_vllm.connector", "KVTransportConnector")
