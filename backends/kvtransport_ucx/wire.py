"""The agent blob a ``ucx`` agent exports: the addresses of its UCP workers, inside the
core's versioned envelope (:mod:`kvtransport.blob`), which carries who we are for the
same-host liveness check."""

from __future__ import annotations

from kvtransport.blob import AgentBlob, BlobCodec

__all__ = ["UcxBlob", "CODEC"]


class UcxBlob(AgentBlob, frozen=True):
    """UCP worker addresses and error-handling mode of one ucx agent."""

    #: Address of our lane 0 (== ``lane_addresses[0]``): notifications go there.
    address: bytes
    err_mode: str
    #: Informational: the pid check uses the boot id.
    hostname: str
    #: Addresses of all our lanes.
    lane_addresses: list[bytes] = []


#: Version 2: the envelope of kvtransport.blob (version 1 had its own identity fields).
CODEC = BlobCodec("ucx", 2, UcxBlob)
