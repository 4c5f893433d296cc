"""The worker's side-channel dispatch: one handler per request type, refusals for the rest.

Through a live producer's real side channel, as an authentic peer: every request type
the protocol defines is answered by its own handler (never "unexpected"), and a message
that is only ever a reply (Reply, Welcome, Error) sent as a request gets
``Error(code="unexpected")`` while the server keeps serving.
"""

from __future__ import annotations

import pytest

from harness import ask_producer, prompt_of
from kvtransport_vllm.handlers import SideChannelHandlers
from kvtransport_vllm.messages import (
    Aborted,
    Cancel,
    Done,
    Error,
    Hello,
    LayoutInfo,
    Release,
    Renew,
    Reply,
    Welcome,
    WriteReq,
    Written,
)

REQUESTS = (Hello, Done, Renew, Release, Cancel, WriteReq, Written, Aborted)


def _sample(kind, pw):
    layout = pw.layout
    return {
        Hello: lambda: Hello(engine_id="peer-tp0", tp_rank=0, agent_md=b"", layout=layout,
                             reply_host="127.0.0.1", reply_port=1),
        Done: lambda: Done(keys=["unknown-key-0"]),
        Renew: lambda: Renew(keys=["unknown-key-1"]),
        Release: lambda: Release(keys=["unknown-key"]),
        Cancel: lambda: Cancel(keys=["unknown-key-2"]),
        WriteReq: lambda: WriteReq(key="unknown-key-3", block_ids=[1], engine_id="nobody", reply_host="127.0.0.1",
                                   reply_port=1),
        Written: lambda: Written(key="unknown-key-4", ok=True),
        Aborted: lambda: Aborted(keys=["unknown-key-5"]),
    }[kind]()


def test_every_request_type_has_its_own_handler(pairs):
    pair = pairs("read")
    pw = pair.P.worker._worker
    table = pw.handlers._table
    assert set(table) == set(REQUESTS)
    assert isinstance(pw.handlers, SideChannelHandlers)
    params = pair.prefill("p1", prompt_of(40))
    key = params["transfer_id"]
    pair.P.step()  # the hold reaches the worker
    for kind in REQUESTS:
        reply = ask_producer(pair, _sample(kind, pw))
        assert not (isinstance(reply, Error) and reply.code == "unexpected"), (kind.__name__, reply)
        assert isinstance(reply, (Reply, Welcome)), (kind.__name__, reply)
    # what the hold's handlers say about a held key, in protocol order
    assert ask_producer(pair, Renew(keys=[key])).status == {key: "ok"}
    assert ask_producer(pair, Done(keys=[key], load="L1")).status == {key: "ok"}  # read-then-confirm: frees the hold
    assert ask_producer(pair, Done(keys=[key], load="L1")).status == {key: "ok"}  # idempotent for that load
    assert ask_producer(pair, Done(keys=[key], load="L2")).status == {key: "expired"}  # another load of the key
    assert ask_producer(pair, Renew(keys=[key])).status == {key: "expired"}


@pytest.mark.parametrize("msg", [Reply(status={"k": "ok"}), Error(code="x", message="y"),
                                 Welcome(engine_id="e", agent_md=b"", layout=LayoutInfo(16, "float32", 1, 1, 1, 1))],
                         ids=["Reply", "Error", "Welcome"])
def test_reply_types_sent_as_requests_are_refused(pairs, msg):
    pair = pairs("read")
    reply = ask_producer(pair, msg)
    assert isinstance(reply, Error) and reply.code == "unexpected", reply
    assert type(msg).__name__ in reply.message
    # the server still serves
    assert isinstance(ask_producer(pair, Renew(keys=["nothing"])), Reply)
