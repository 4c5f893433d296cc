"""vLLM general plugin: makes ``"kv_connector": "KVTransportConnector"`` work without
``kv_connector_module_path`` (entry point ``vllm.general_plugins: kvtransport``)."""

from __future__ import annotations

CONNECTOR_NAME = "KVTransportConnector"


def register() -> None:
    """Register the connector with vLLM's factory; idempotent (vLLM loads plugins in
    every process, sometimes more than once).

    Uses only ``KVConnectorFactory.register_connector`` (public since vLLM 0.9, same in
    0.32 and 0.33), which refuses a name already registered with a ValueError: that
    refusal is how a second registration is told apart from a real error.
    """
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "kvtransport_vllm.connector", "KVTransportConnector")
    except ValueError as exc:
        if "already registered" not in str(exc):
            raise
