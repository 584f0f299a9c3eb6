"""The trainer's weights on their way into vLLM: what is pushed, the push's control flow, and
one sender per vLLM weight-transfer backend."""
