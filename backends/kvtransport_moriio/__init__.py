"""kvtransport_moriio: the ``moriio`` backend over AMD mori's IO engine (``amd-mori``).

Entry point ``kvtransport.backends: moriio = kvtransport_moriio.backend:MoriioBackend``.
Modules, one job each: ``probe`` (can it run here, and if not why), ``options`` (backend
options and mori's RDMA knobs), ``wire`` (the agent blob), ``grouping`` (segments to per
region-pair offset lists), ``status`` (mori TransferStatus to PENDING/DONE/FAILED),
``notify`` (the notification side channel), ``backend`` (the glue). See docs/MORIIO.md.
"""
