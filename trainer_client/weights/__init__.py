"""The trainer's weights on their way into vLLM: what is pushed (``policy_weights``), the
push's control flow over the service's gRPC API (``push``), and one sender per vLLM
weight-transfer backend behind a common base (``sender``, ``gloo``, ``nccl``, chosen in
``backends``), with the rendezvous port they host (``group_port``)."""
