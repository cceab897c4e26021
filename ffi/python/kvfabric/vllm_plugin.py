"""vLLM's general plugin for kvfabric: registers :class:`kvfabric.vllm.KvfabricConnector` with
vLLM's connector factory, so that a vLLM user writes only

    --kv-transfer-config '{"kv_connector": "KvfabricConnector", "kv_role": "kv_both"}'

vLLM finds it through the ``vllm.general_plugins`` entry point of the installed package and
calls :func:`register` once in every process it starts (API server, engine core, workers),
before any of them builds a connector. The registration is lazy (a module path and a class
name): nothing of kvfabric, not even its library, loads until vLLM builds the connector. If
``VLLM_PLUGINS`` is set, it must name ``kvfabric``.
"""

from __future__ import annotations

NAME = "KvfabricConnector"


def register() -> None:
    """Registers the connector under :data:`NAME` (again in the same process: nothing)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(NAME, "kvfabric.vllm", "KvfabricConnector")
    except ValueError:
        # vLLM refuses a name registered twice: this process registered it already.
        pass
