"""kvtransport backend over NIXL (nixl-cu12)."""
