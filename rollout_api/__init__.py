"""The gRPC API of ``proto/rollout/v1/rollout.proto``, shared by the service and its clients.

The generated code (``rollout_pb2``, ``rollout_pb2_grpc`` and their type stubs, written by
``setup.py`` on install or by ``make proto``; git-ignored, never edited by hand), the
Python client of the API (``client``) and the live view built on it (``top``): both sides'
CLIs use them, and a trainer imports them without the service.
"""
