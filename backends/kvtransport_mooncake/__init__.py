"""kvtransport backend over Mooncake Transfer Engine."""
