"""What the service and the trainer both need and neither owns: the split of one host's
CPU cores between vLLM and a trainer (``cpu_budget``), and the locally built tiny default
model (``tiny_model``). Nothing here imports either side, or grpc."""
