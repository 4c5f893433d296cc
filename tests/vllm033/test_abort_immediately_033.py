"""vLLM 0.33's immediate-abort path, on 0.33's own Scheduler.

When the decode engine's serving layer refuses a request that carries
``kv_transfer_params`` (a paused engine, a rejected request), vLLM 0.33 still adds it
to the scheduler with ``abort_immediately=True`` and aborts it at once
(``EngineCore.add_request``), so that the connector's ``request_finished`` runs and the
producer's blocks are not stranded. Checked here for READ and WRITE: the producer's hold
ends exactly once, by our release and not by its lease running out; the consumer never
loads, never reports the request as received, and leaks no block.
"""

from __future__ import annotations

import pytest
from harness import Pair, prompt_of
from vllm import SamplingParams
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.request import Request, RequestStatus
from vllm.utils.hashing import sha256


def _add_as_engine_core_does(engine, rid: str, prompt: list[int], params: dict) -> None:
    """What 0.33's ``EngineCore.add_request`` does with an ``abort_immediately`` request."""
    req = Request(request_id=rid, prompt_token_ids=list(prompt),
                  sampling_params=SamplingParams(max_tokens=4, ignore_eos=True), pooling_params=None,
                  block_hasher=get_request_block_hasher(engine.block_size, sha256), abort_immediately=True)
    req.kv_transfer_params = dict(params)
    engine.scheduler.add_request(req)
    assert req.abort_immediately
    engine.scheduler.finish_requests([rid], RequestStatus.FINISHED_ABORTED)


@pytest.mark.parametrize("mode", ["read", "write"])
def test_immediately_aborted_request_releases_the_producer_hold_once(mode):
    pair = Pair(mode, lease_s=120.0)  # a lease that cannot run out during the test
    try:
        prompt = prompt_of(40)
        params = pair.prefill("r1", prompt)
        assert pair.P.free_blocks() < pair.P.free0, "the producer holds no blocks: nothing to release"

        _add_as_engine_core_does(pair.C, "r1", prompt, params)
        pair.drain()  # hang guard only: ends once no request is left on either engine

        sent = [kvo for kvo in pair.P.kv_outputs if kvo.finished_sending and "r1" in kvo.finished_sending]
        assert len(sent) == 1, f"producer ended its hold {len(sent)} times"
        assert pair.P.worker._worker.ctx.stats["leases_expired"] == 0, "the hold ended by its lease, not our release"
        recv = [kvo for kvo in pair.C.kv_outputs
                if (kvo.finished_recving and "r1" in kvo.finished_recving) or "r1" in (kvo.failed_recving or ())]
        assert recv == [], "an aborted request was reported as received"
        for _ in range(5):  # a second release would show in the next steps
            pair.P.step()
            pair.C.step()
        assert len([k for k in pair.P.kv_outputs if k.finished_sending and "r1" in k.finished_sending]) == 1
        pair.assert_no_leak()
    finally:
        pair.close()
