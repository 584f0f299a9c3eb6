"""The gRPC edge maps every service error to its status in one place, for unary and
streaming RPCs alike; anything unexpected is logged and answered INTERNAL with a one-line
message, never UNKNOWN. Real gRPC over localhost; the engine behind it is scripted."""

from __future__ import annotations

import logging

import grpc
import pytest

from rollout_service.delivery.consumer import ConsumerSession
from rollout_service.edge.servicer import status_code
from rollout_service.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    ServiceError,
)
from tests.unit.rollout_service.builders import one_prompt_spec as spec
from tests.unit.rollout_service.edge.grpc_served import served


class RunTooSmall(InvalidArgument):
    """A subclass takes its parent's status."""


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (InvalidArgument("x"), grpc.StatusCode.INVALID_ARGUMENT),
        (RunTooSmall("x"), grpc.StatusCode.INVALID_ARGUMENT),
        (NotFound("x"), grpc.StatusCode.NOT_FOUND),
        (FailedPrecondition("x"), grpc.StatusCode.FAILED_PRECONDITION),
        (AlreadyExists("x"), grpc.StatusCode.ALREADY_EXISTS),
        (ResourceExhausted("x"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (ServiceError("x"), grpc.StatusCode.INTERNAL),
    ],
)
def test_each_kind_of_service_error_has_its_status(error: ServiceError, code: grpc.StatusCode) -> None:
    assert status_code(error) is code


def test_the_core_errors_know_nothing_of_grpc() -> None:
    import rollout_service.errors as errors

    assert "grpc" not in vars(errors)
    assert not hasattr(InvalidArgument("x"), "code")


async def test_an_unexpected_error_in_a_stream_is_internal_and_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    async def broken(self: ConsumerSession) -> None:
        raise RuntimeError("the session broke")

    monkeypatch.setattr(ConsumerSession, "next_message", broken)
    async with served() as (service, client):
        run = await service.create_run(spec())  # type: ignore[attr-defined]
        stream = client.stream(run.run_id, "c", credits=1)
        with caplog.at_level(logging.ERROR), pytest.raises(grpc.aio.AioRpcError) as info:
            async for _group in stream:
                pass
        assert info.value.code() == grpc.StatusCode.INTERNAL  # was UNKNOWN, and nothing logged
        assert info.value.details() == "RuntimeError: the session broke"
        assert any("StreamSamples failed" in r.message for r in caplog.records)
        await service.delete_run(run.run_id)  # type: ignore[attr-defined]


async def test_a_service_error_in_a_stream_keeps_its_status(monkeypatch: pytest.MonkeyPatch) -> None:
    async def full(self: ConsumerSession) -> None:
        raise ResourceExhausted("too many things; close some")

    monkeypatch.setattr(ConsumerSession, "next_message", full)
    async with served() as (service, client):
        run = await service.create_run(spec())  # type: ignore[attr-defined]
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _group in client.stream(run.run_id, "c", credits=1):
                pass
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert info.value.details() == "too many things; close some"
        await service.delete_run(run.run_id)  # type: ignore[attr-defined]
