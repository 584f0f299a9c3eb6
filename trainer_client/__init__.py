"""Thin trainer client of the rollout service; importable without vLLM."""
