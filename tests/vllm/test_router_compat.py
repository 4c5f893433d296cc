"""Router compatibility (issue 17, point 2) against real vLLM Schedulers.

A "proxy" here is what sits between the prefill's response and the decode's request:
one forwards the producer's ``kv_transfer_params`` verbatim (vLLM's toy proxy, llm-d's
sidecar), one rebuilds them from NixlConnector's documented keys only (our
``transfer_id`` and every other key dropped). Both must load the producer's bytes; params
missing a required key must end as a logged, typed refusal that goes through the load
failure policy, never as a silent local prefill. Last, the connector inside vLLM's
``MultiConnector``.
"""

from __future__ import annotations

import logging

import pytest

import harness
from harness import finish_reason, prompt_of
from kvtransport_vllm.params import NIXL_KEYS, KVTransferParamsError, parse_remote_source
from kvtransport_vllm.routing import producer_key, transfer_key
from vllm.config import KVTransferConfig
from vllm.v1.request import RequestStatus

#: the keys a NixlConnector-only router may be assumed to forward, at the least
MINIMAL_KEYS = ("do_remote_prefill", "remote_engine_id", "remote_request_id", "remote_host", "remote_port",
                "remote_block_ids")


def verbatim(params: dict) -> dict:
    """Proxy 1: the prefill's kv_transfer_params, unchanged (vLLM's toy proxy)."""
    return dict(params)


def nixl_rebuilt(params: dict) -> dict:
    """Proxy 2: rebuilt from NixlConnector's documented keys only, everything else dropped."""
    out = {k: params[k] for k in NIXL_KEYS if k in params}
    out["do_remote_prefill"], out["do_remote_decode"] = True, False
    return out


def nixl_minimal(params: dict) -> dict:
    """Proxy 3: only the keys a NIXL pull needs (no remote_num_tokens, no tp_size)."""
    return {k: params[k] for k in MINIMAL_KEYS}


# ---------------------------------------------------------------------------- pure parsing
def test_consumer_derives_the_producers_key_without_transfer_id():
    params = {"remote_engine_id": "P", "remote_request_id": "cmpl-7-0-ab", "remote_host": "h", "remote_port": 9,
              "remote_block_ids": [1, 2]}
    assert transfer_key(params, "decode-side-id") == producer_key("P", "cmpl-7-0-ab") == "P:cmpl-7-0-ab"
    src = parse_remote_source(params, "decode-side-id", "read")
    assert (src.key, src.peer.host, src.peer.port, src.remote_block_ids) == ("P:cmpl-7-0-ab", "h", 9, [1, 2])
    # transfer_id, when forwarded, still wins
    assert parse_remote_source({**params, "transfer_id": "T"}, "x", "read").key == "T"


def test_incomplete_params_name_the_missing_keys():
    with pytest.raises(KVTransferParamsError) as e:
        parse_remote_source({"do_remote_prefill": True, "remote_host": "h"}, "r1", "read")
    assert e.value.missing == ("remote_port", "remote_engine_id", "remote_request_id", "remote_block_ids")
    assert "missing remote_port, remote_engine_id, remote_request_id, remote_block_ids" in str(e.value)
    assert "router must forward" in str(e.value)
    # WRITE mode needs no remote_block_ids (the producer writes into our blocks)
    ok = parse_remote_source({"remote_engine_id": "P", "remote_request_id": "q", "remote_host": "h",
                              "remote_port": 1}, "r1", "write")
    assert ok.remote_block_ids == []
    # a producer TP size other than ours is a heterogeneous-TP load (issue 14; whether the
    # heads map is decided at the hand-shake); one that is no TP size is refused here
    hetero = parse_remote_source({"remote_engine_id": "P", "remote_request_id": "q", "remote_host": "h",
                                  "remote_port": 1, "tp_size": 2}, "r1", "write", tp_size=1)
    assert hetero.remote_tp == 2
    with pytest.raises(KVTransferParamsError, match=r"tp_size 0 is outside \[1, 256\]"):
        parse_remote_source({"remote_engine_id": "P", "remote_request_id": "q", "remote_host": "h",
                             "remote_port": 1, "tp_size": 0}, "r1", "write", tp_size=1)


# ---------------------------------------------------------------------------- scheduler pairs
def _loaded_from_remote(pair, rid: str, prompt: list[int]) -> None:
    """What a user checks: the request reached RUNNING with the producer's bytes in its
    blocks, was first scheduled after the load (not from token 0), no load failed, and
    after both sides drain no block is leaked."""
    checks = pair.run_to_end_checking_kv(rid, prompt)
    assert checks == [[]], f"{rid}: loaded KV differs from the producer's in blocks {checks}"
    assert pair.C.first_start.get(rid, 0) >= len(prompt) - 1, \
        f"{rid} was computed locally from token {pair.C.first_start.get(rid)}, not loaded"
    assert not any(rid in o.failed_recving for o in pair.C.kv_outputs), f"{rid}: the load failed"
    assert sum(rid in (o.finished_recving or ()) for o in pair.C.kv_outputs) == 1
    assert finish_reason(pair.C, rid) == "length"
    pair.drain()
    pair.assert_no_leak()


@pytest.mark.parametrize("proxy", [verbatim, nixl_rebuilt, nixl_minimal])
@pytest.mark.parametrize("mode", ["read", "write"])
def test_proxy_loads_remote_kv_byte_exact(pairs, mode, proxy):
    pair = pairs(mode)
    prompt = prompt_of(70, seed=3)
    params = pair.prefill("p1", prompt)
    forwarded = proxy(params)
    if proxy is not verbatim:
        assert "transfer_id" not in forwarded and set(forwarded) <= set(NIXL_KEYS)
    pair.C.add("c1", prompt, 3, forwarded)
    _loaded_from_remote(pair, "c1", prompt)


@pytest.mark.parametrize("mode", ["read", "write"])
def test_rebuilt_params_many_requests_keys_do_not_collide(pairs, mode):
    """Several prefills in flight, each rebuilt without transfer_id: every consumer
    request finds its own producer hold (the derived keys differ per request)."""
    pair = pairs(mode)
    prompts = {f"r{i}": prompt_of(40 + 8 * i, seed=10 + i) for i in range(3)}
    fwd = {rid: nixl_rebuilt(pair.prefill(f"p-{rid}", p)) for rid, p in prompts.items()}
    for rid, p in prompts.items():
        pair.C.add(rid, p, 2, fwd[rid])
    seen: dict[str, list[int]] = {}

    def all_done() -> bool:
        for rid, p in prompts.items():
            req = pair.C.scheduler.requests.get(rid)
            if (rid not in seen and req is not None and pair.C.status(rid) == RequestStatus.RUNNING
                    and req.num_computed_tokens >= len(p)):
                seen[rid] = pair.C.check_kv(rid, p, len(p))
        return not any(rid in pair.C.scheduler.requests for rid in prompts)

    pair.run(all_done, timeout=30)
    assert seen == {rid: [] for rid in prompts}
    assert not any(o.failed_recving for o in pair.C.kv_outputs)
    pair.drain()
    pair.assert_no_leak()


@pytest.mark.parametrize("policy", ["recompute", "fail"])
@pytest.mark.parametrize("mode,missing", [("read", "remote_engine_id"), ("read", "remote_request_id"),
                                          ("read", "remote_host"), ("read", "remote_block_ids"),
                                          ("write", "remote_port")])
def test_missing_key_is_a_logged_refusal_through_the_policy(pairs, caplog, mode, missing, policy):
    # short lease: when the key cannot be derived the producer cannot be told, and frees
    # its hold when the lease lapses
    pair = pairs(mode, policy=policy, timeout_s=1.0, lease_s=2.0)
    prompt = prompt_of(50, seed=4)
    params = nixl_rebuilt(pair.prefill("p1", prompt))
    del params[missing]
    caplog.set_level(logging.WARNING)
    pair.C.add("c1", prompt, 2, params)
    checks = pair.run_to_end_checking_kv("c1", prompt)
    refusals = [r.getMessage() for r in caplog.records
                if "KVTransferParamsError" in r.getMessage() and "c1" in r.getMessage()]
    assert len(refusals) == 1, f"expected one logged refusal for c1, got {refusals}"
    assert f"missing {missing}" in refusals[0] and "router must forward" in refusals[0]
    assert any("c1" in o.failed_recving for o in pair.C.kv_outputs), "refusal not reported as a failed load"
    if policy == "recompute":
        pair.assert_recomputed("c1", prompt, checks)
    else:
        assert finish_reason(pair.C, "c1") == "error"
        assert "c1" not in pair.C.first_start, "a request failed under policy=fail was scheduled"
    pair.drain()
    pair.assert_no_leak()


def test_refusal_with_known_producer_frees_its_hold_at_once(pairs):
    """READ params without remote_block_ids still name the producer and the key: it is
    told to free its blocks now, not when its lease lapses."""
    pair = pairs("read", policy="recompute", timeout_s=30.0, lease_s=60.0)
    prompt = prompt_of(50, seed=6)
    params = nixl_rebuilt(pair.prefill("p1", prompt))
    del params["remote_block_ids"]
    pair.C.add("c1", prompt, 2, params)
    pair.drain(timeout=10.0)  # far below the 60 s lease: only the release can free p1
    pair.assert_no_leak()


@pytest.mark.parametrize("proxy", [nixl_rebuilt, nixl_minimal])
def test_abort_before_allocation_with_rebuilt_params_releases_producer(pairs, proxy):
    """A decode request aborted before it got blocks tells the producer to free, with the
    key derived from NIXL's keys (no transfer_id), long before the producer's lease."""
    pair = pairs("read", timeout_s=30.0, lease_s=60.0)
    prompt = prompt_of(50, seed=9)
    params = proxy(pair.prefill("p1", prompt))
    pair.C.add("c1", prompt, 2, params)
    pair.C.abort("c1")  # never scheduled: no block on C
    pair.drain(timeout=10.0)  # far below the 60 s lease: only the release can free p1
    pair.assert_no_leak()


# ---------------------------------------------------------------------------- MultiConnector
def _as_multi_connector(**kw):
    """What harness.make_vllm_config builds, with KVTransportConnector moved inside vLLM's
    MultiConnector (the shape a framework that knows only built-in names would use).
    vLLM's scheduler reads the load failure policy from the outer config."""
    child = {"kv_connector": kw["kv_connector"], "kv_role": kw["kv_role"],
             "kv_connector_extra_config": kw["kv_connector_extra_config"]}
    return KVTransferConfig(kv_connector="MultiConnector", kv_role=kw["kv_role"], engine_id=kw["engine_id"],
                            kv_load_failure_policy=kw["kv_load_failure_policy"],
                            kv_connector_extra_config={"connectors": [child]})


@pytest.mark.parametrize("proxy", [verbatim, nixl_rebuilt])
@pytest.mark.parametrize("mode", ["read", "write"])
def test_inside_multiconnector(pairs, monkeypatch, mode, proxy):
    from kvtransport_vllm.connector import KVTransportConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    monkeypatch.setattr(harness, "KVTransferConfig", _as_multi_connector)
    pair = pairs(mode)
    for e in pair.engines:
        assert isinstance(e.connector, MultiConnector) and isinstance(e.worker, MultiConnector)
        assert [type(c) for c in e.connector.sub_connectors] == [KVTransportConnector]
        assert [type(c) for c in e.worker.sub_connectors] == [KVTransportConnector]
    prompt = prompt_of(70, seed=8)
    params = pair.prefill("p1", prompt)
    assert params["do_remote_prefill"] and params["remote_engine_id"] == "P"
    pair.C.add("c1", prompt, 3, proxy(params))
    _loaded_from_remote(pair, "c1", prompt)
