"""kvtransport_vllm: the vLLM KV connector built on kvtransport.

``kv_transfer_config = {"kv_connector": "KVTransportConnector", "kv_role": ..., 
"kv_connector_extra_config": {...}}``; registered through the ``vllm.general_plugins``
entry point, or use ``"kv_connector_module_path": "kvtransport_vllm.connector"``.
See docs/vllm/USAGE.md.
"""

__all__ = ["KVTransportConnector"]


def __getattr__(name: str):  # lazy: importing the package must not import vLLM
    if name == "KVTransportConnector":
        from .connector import KVTransportConnector

        return KVTransportConnector
    raise AttributeError(name)
