"""The edge: the gRPC server and its message conversion (the only gRPC in the service),
the assembly of a running service, and the ``rollout-service`` CLI."""
