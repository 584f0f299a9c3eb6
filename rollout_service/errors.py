"""The service's errors, plain Python: the core knows nothing of gRPC (``edge.servicer`` maps them)."""

from __future__ import annotations

MAX_ECHO_CHARS = 128
"""What an error message repeats of a caller's input: a 1 MB id must not make a 1 MB status."""


def echo(value: object) -> str:
    """A caller's input as an error message quotes it (``repr``), cut at ``MAX_ECHO_CHARS``."""
    text = str(value)
    return repr(text if len(text) <= MAX_ECHO_CHARS else text[:MAX_ECHO_CHARS] + "…")


class ServiceError(Exception):
    """An error a client caused or can act on; its message says what to change."""


class InvalidArgument(ServiceError):
    """The request itself is wrong (a field out of its bounds, a malformed message)."""


class NotFound(ServiceError):
    """It names a run (or update) the service does not hold."""


class FailedPrecondition(ServiceError):
    """Valid, but not now: the run is stopped, an update is in progress, a claim is held."""


class AlreadyExists(ServiceError):
    """A name that must be unique is taken (a consumer id within its run)."""


class ResourceExhausted(ServiceError):
    """A limit on what sizes memory or work (runs, consumers, credits, queued prompts)."""


class Unauthenticated(ServiceError):
    """The call carries no valid bearer token."""


class PermissionDenied(ServiceError):
    """The caller is known but may not do this (push base weights, name another address)."""


class EngineError(Exception):
    """A vLLM request failed for good (after retries); its group is dropped."""

    def __init__(self, server: str, message: str) -> None:
        super().__init__(f"{server}: {message}")
        self.server = server


class RequestRejected(EngineError):
    """vLLM refused the request itself (HTTP 4xx): no retry, and the server stays healthy."""


class EnvironmentFailure(Exception):
    """An environment's reset or step raised or timed out: its group is dropped."""


class RewardError(Exception):
    """A reward function failed or returned something unusable; its group is dropped."""


class StartupError(RuntimeError):
    """The service cannot start; the message says what to change (the CLI prints no traceback)."""
