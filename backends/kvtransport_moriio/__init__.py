"""kvtransport_moriio."""
