"""Rollout service: drives vLLM, scores groups as they complete, streams samples over gRPC."""

__version__ = "0.1.0"
