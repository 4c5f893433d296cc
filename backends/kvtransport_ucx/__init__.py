"""kvtransport_ucx."""
