"""The GRPO-family loss: TRL-named settings, pure torch losses and metrics, chunked log-probs."""
