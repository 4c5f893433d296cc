"""Request routing (issue point 5): peer address from kv_transfer_params or a MoRIIO
router compound request id. Pure functions, no vLLM."""

import pytest

from kvtransport_vllm.routing import (
    Endpoint,
    parse_moriio_address,
    parse_router_request_id,
    peer_from_params,
    transfer_key,
)

UUID = "0123456789abcdef0123456789abcdef"
RID = (f"chatcmpl___prefill_addr_host:10.0.0.1,handshake:6301,notify:61005"
       f"___decode_addr_host:10.0.0.2,handshake:6401,notify:61105_{UUID}")


def test_router_id_parsed():
    r = parse_router_request_id(RID)
    assert r.prefill == Endpoint("10.0.0.1", 6301, 61005)
    assert r.decode == Endpoint("10.0.0.2", 6401, 61105)
    assert r.uuid == UUID


def test_router_id_with_vllm_suffix():
    r = parse_router_request_id(f"cmpl-{RID}-0-1a2b3c4d")
    assert r is not None and r.uuid == UUID and r.decode.port == 6401


def test_ipv6_host():
    assert parse_moriio_address("host:::1,handshake:7,notify:8") == Endpoint("::1", 7, 8)


def test_plain_id_is_not_router():
    assert parse_router_request_id("cmpl-abc-0-ff") is None
    assert peer_from_params({}, "cmpl-abc", "prefill") is None


def test_malformed_router_address_raises_clear_error():
    bad = f"x___prefill_addr_host:1.2.3.4,handshake:notaport___decode_addr_host:h,handshake:1,notify:2_{UUID}"
    with pytest.raises(ValueError, match="malformed MoRIIO address"):
        parse_router_request_id(bad)


def test_params_win_over_router_id():
    ep = peer_from_params({"remote_host": "h", "remote_port": 9}, RID, "prefill")
    assert ep == Endpoint("h", 9)
    assert peer_from_params({}, RID, "prefill") == Endpoint("10.0.0.1", 6301, 61005)
    assert peer_from_params({}, RID, "decode") == Endpoint("10.0.0.2", 6401, 61105)


def test_transfer_key_shared_by_both_engines():
    # Both engines see the router id (possibly wrapped differently) -> same key.
    assert transfer_key({}, RID) == transfer_key({}, f"cmpl-{RID}-3-beef") == UUID
    # under a router id the uuid wins over a transfer_id (vllm-router's moriio mode sends both
    # engines a "tx-..." id of its own, under which no producer of ours holds anything)
    assert transfer_key({"transfer_id": "tx-0123abcd"}, RID) == UUID
    # a plain request id: the producer's own transfer_id
    assert transfer_key({"transfer_id": "P:r1"}, "cmpl-abc") == "P:r1"
