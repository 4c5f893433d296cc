"""Acceptance 1: the seed scenario (MoRIIO READ mode -> KeyError -> EngineDeadError).

READ mode, a router compound request id, and a model runner that emits no output row for
a request whose KV has not landed yet. The old behaviour (remote load reported as
synchronous) schedules the request at once, and ``update_from_output`` dies on
``req_id_to_index[req_id]`` — reproduced below as the negative control, so this test
can fail. With KVTransportConnector the request waits in WAITING_FOR_REMOTE_KVS and is
never in ``num_scheduled_tokens`` before its KV arrived (R1).
"""

import pytest

from harness import Pair, prompt_of
from kvtransport_vllm.connector import KVTransportConnector
from vllm.v1.request import RequestStatus

UUID = "5eed5eed5eed5eed5eed5eed5eed5eed"


class SyncReadConnector(KVTransportConnector):
    """The seed's bug, re-created for the negative control: READ load reported as sync."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        n, _ = super().get_num_new_matched_tokens(request, num_computed_tokens)
        return (max(n - 1, 0), False)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        # The load is "in flight" (as in the seed, it just has not landed yet when the
        # scheduler runs the request); no job reaches our worker, so nothing reports.
        return


def _router_id(pair, tag):
    return (f"cmpl-___prefill_addr_host:127.0.0.1,handshake:{pair.p_port},notify:1"
            f"___decode_addr_host:127.0.0.1,handshake:{pair.c_port},notify:2_{UUID}-0-{tag}")


def _scenario(pair):
    prompt = prompt_of(96, seed=11)
    params = pair.prefill(_router_id(pair, "p"), prompt)
    rid = _router_id(pair, "d")
    # The stand-in runner has no KV for the request until the worker reported it landed
    # (done_recving) -> it emits no output row for it before that.
    pair.C.no_row = lambda r: r == rid and not any(rid in (o.finished_recving or ()) for o in pair.C.kv_outputs)
    pair.C.kv_outputs.clear()
    pair.C.add(rid, prompt, 4, {"do_remote_prefill": True, "remote_block_ids": params["remote_block_ids"],
                                 "transfer_id": params["transfer_id"]})
    return rid, prompt


def test_seed_scenario_no_keyerror_never_scheduled_before_kv():
    pair = Pair("read")
    try:
        rid, prompt = _scenario(pair)
        pair.C.step()  # the step where the old connector scheduled it: no row emitted
        assert pair.C.status(rid) == RequestStatus.WAITING_FOR_REMOTE_KVS
        pair.run(lambda: pair.C.status(rid) is None)  # runs to completion, no KeyError
        done_at = next(i for i, o in enumerate(pair.C.kv_outputs) if rid in (o.finished_recving or ()))
        log = pair.C.scheduled_log[-len(pair.C.kv_outputs):]
        assert all(rid not in s for s in log[: done_at + 1]), "R1: scheduled before its KV arrived"
        assert any(rid in s for s in log[done_at + 1:])
        assert [o.finish_reason for o in pair.C.outputs if o.request_id == rid][-1] is not None
        pair.drain()
        pair.assert_no_leak()
    finally:
        pair.close()


def test_negative_control_sync_read_reproduces_seed_keyerror():
    pair = Pair("read", consumer_cls=SyncReadConnector)
    try:
        rid, _ = _scenario(pair)
        with pytest.raises(KeyError):
            pair.C.step()  # scheduled before KV, no output row -> req_id_to_index KeyError
    finally:
        pair.close()
