"""Weights: the full-weight update control plane (pause, vLLM's handshake, version,
prefix-cache reset, resume), per-run LoRA adapters, and bringing a restarted server back
to the runs' policy."""
