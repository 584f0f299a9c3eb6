"""Delivery: each run's broker (buffered -> leased -> acked, and staleness-aware admission)
and one consumer's stream of it, without gRPC."""
