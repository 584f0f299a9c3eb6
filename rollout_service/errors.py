"""Errors as values inside the service; server.py maps them to gRPC status codes in one place."""

from __future__ import annotations

import grpc


class ServiceError(Exception):
    """An error a client caused or can act on; its message says what to change."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class InvalidArgument(ServiceError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(ServiceError):
    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(ServiceError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class AlreadyExists(ServiceError):
    code = grpc.StatusCode.ALREADY_EXISTS


class ResourceExhausted(ServiceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class EngineError(Exception):
    """A vLLM request failed for good (after retries); its group is dropped."""

    def __init__(self, server: str, message: str) -> None:
        super().__init__(f"{server}: {message}")
        self.server = server


class EnvironmentFailure(Exception):
    """An environment's reset or step raised or timed out: its group is dropped (reason
    ``environment``) and the run goes on."""


class RewardError(Exception):
    """A reward function failed or returned something unusable; its group is dropped."""


class StartupError(RuntimeError):
    """The service cannot start (no vLLM server, a managed server that did not come up);
    the message says what to change. The CLI prints it without a traceback."""
