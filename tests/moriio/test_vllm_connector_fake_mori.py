"""The vLLM connector selects ``backend: moriio`` with no other change (issue acceptance 3).

A real vLLM Scheduler pair (tests/vllm/harness.py) with the KVTransportConnector configured
``{"backend": "moriio"}``; mori itself is the FAKE (memmove in this process), so this
proves the connector and our glue agree, not RDMA. Decode's KV blocks must equal what
prefill computed, block by block, and both block pools must return to their free count.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvtransport_moriio.backend import using_mori_module  # noqa: E402

from .fake_mori_io import make_fake_mori_io  # noqa: E402

HARNESS = Path(__file__).resolve().parents[1] / "vllm" / "harness.py"


def _harness():
    spec = importlib.util.spec_from_file_location("kvt_vllm_harness_for_moriio", HARNESS)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("mode", ["read", "write"])
def test_vllm_connector_with_moriio_backend_moves_kv_fake_mori(mode):
    h = _harness()
    io = make_fake_mori_io()
    with using_mori_module(io):
        base = h.free_port_base(8)
        common = {"backend": "moriio", "backend_options": {"host": "127.0.0.1"}, "mode": mode,
                  "side_channel_host": "127.0.0.1", "transfer_timeout_s": 10.0}
        p = h.Engine("kv_producer", {**common, "side_channel_port": base})
        d = h.Engine("kv_consumer", {**common, "side_channel_port": base + 4})
        try:
            prompt = h.prompt_of(70)
            got: dict = {}
            p.add("r1", prompt, 1, {"do_remote_decode": True, "do_remote_prefill": False})
            h.run_until([p], lambda: "r1" in got, on_params=got.update)
            d.add("r1", prompt, 4, got["r1"])
            h.run_until([p, d], lambda: d.status("r1") is not None and d.status("r1").name == "RUNNING"
                        or any(o.request_id == "r1" and o.finished for o in d.outputs), timeout=20)
            assert d.check_kv("r1", prompt, len(prompt) - 1) == []
            h.run_until([p, d], lambda: d.status("r1") is None and p.status("r1") is None
                        and p.free_blocks() == p.free0 and d.free_blocks() == d.free0, timeout=20)
            assert len(io.fabric.engines) == 2  # both workers opened moriio agents on the fake
            batches = [b for b in io.fabric.batches if b.status.Succeeded()]
            assert batches, "no mori batch was issued"
            assert {b.op for b in batches} == {mode}
        finally:
            d.close()
            p.close()
