"""Weights: the full-weight update control plane, per-run LoRA adapters, pool partitions and
membership, and bringing a restarted server back to the runs' policy."""
