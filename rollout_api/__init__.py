"""The gRPC API of ``proto/rollout/v1/rollout.proto``, shared by the service and its clients.

Only generated code lives here (``rollout_pb2``, ``rollout_pb2_grpc`` and their type
stubs, written by ``setup.py`` on install or by ``make proto``; git-ignored, never edited
by hand), so a trainer imports the API without the service.
"""
