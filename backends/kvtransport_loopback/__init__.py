"""kvtransport_loopback."""
