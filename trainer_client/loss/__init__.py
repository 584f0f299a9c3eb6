"""The GRPO-family loss: its settings with TRL's names (``config``), the losses as pure torch
functions, TRL parity-tested (``losses``), their TRL-named metrics (``metrics``), and the
chunked log-probs they are computed on (``logprobs``)."""
