"""The gRPC servicer: each RPC parses its request, calls the service as its caller, and maps the
result; service errors become gRPC status codes in one place (``status_code``), streams included."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

from rollout_api import rollout_pb2 as pb
from rollout_api import rollout_pb2_grpc as pb_grpc
from rollout_service.config import SecuritySettings
from rollout_service.delivery.consumer import ConsumerRequest, ConsumerSession
from rollout_service.edge.convert import (
    PAUSE_MODE_FROM_PB,
    consumer_message_to_wire,
    consumer_request_from_pb,
    engine_removed_to_pb,
    engine_state_to_pb,
    prompt_from_pb,
    run_spec_from_pb,
    run_to_pb,
    server_info_to_pb,
    stats_to_pb,
    tensors_from_pb,
)
from rollout_service.edge.security import Principal, TokenTable, is_loopback, peer_host, principal_of
from rollout_service.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    ServiceError,
    Unauthenticated,
    echo,
)
from rollout_service.runs import Run
from rollout_service.service import RolloutService
from rollout_service.weights.adapters import MAX_ADAPTER_BYTES, check_adapter_file_name

logger = logging.getLogger(__name__)

SUBSCRIBE_TIMEOUT_S = 30.0
MAX_STATUS_MESSAGE_CHARS = 2048

T = TypeVar("T")


STATUS_CODES: dict[type[ServiceError], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
}


def status_code(error: ServiceError) -> grpc.StatusCode:
    """The status of the nearest mapped class of the error; INTERNAL if none."""
    for kind in type(error).__mro__:
        if kind in STATUS_CODES:
            return STATUS_CODES[kind]
    return grpc.StatusCode.INTERNAL


async def _abort_with(context: grpc.aio.ServicerContext, name: str, exc: Exception) -> None:
    """Answer an exception as a status: a service error's own, else INTERNAL (logged)."""
    if isinstance(exc, ServiceError):
        message = str(exc)
        if len(message) > MAX_STATUS_MESSAGE_CHARS:
            message = message[:MAX_STATUS_MESSAGE_CHARS] + "…"
        await context.abort(status_code(exc), message)
    else:
        logger.error("%s failed", name, exc_info=exc)
        await context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")


def _edge(method: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    @functools.wraps(method)
    async def wrapper(self: RolloutServicer, request: Any, context: grpc.aio.ServicerContext) -> T:
        try:
            return await method(self, request, context)
        except Exception as exc:
            await _abort_with(context, method.__name__, exc)
        raise AssertionError("unreachable")

    return wrapper


def _stream_edge(method: Callable[..., AsyncIterator[T]]) -> Callable[..., AsyncIterator[T]]:
    """``_edge`` for server-streaming methods."""

    @functools.wraps(method)
    async def wrapper(self: RolloutServicer, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[T]:
        try:
            # aclosing: a stream closed at a yield runs the method's cleanup (lease release) now, not at GC
            async with contextlib.aclosing(method(self, request, context)) as messages:
                async for message in messages:
                    yield message
        except Exception as exc:
            await _abort_with(context, method.__name__, exc)

    return wrapper


async def _consumer_requests(requests: AsyncIterator[pb.StreamSamplesRequest]) -> AsyncIterator[ConsumerRequest]:
    """A stream's requests after its subscribe; a client that goes away just ends them."""
    try:
        async for message in requests:
            yield consumer_request_from_pb(message)
    except grpc.aio.AioRpcError as exc:
        logger.debug("a consumer stream ended: %s", exc.code())


async def _adapter_files(requests: AsyncIterator[pb.PushAdapterRequest]) -> tuple[str, dict[str, bytes]]:
    """Reassemble PushAdapter's chunks: the first message names the run, each names its file."""
    run_id = ""
    chunks: dict[str, list[bytes]] = {}
    total = 0
    async for request in requests:
        if not run_id:
            run_id = request.run_id
            if not run_id:
                raise InvalidArgument("the first PushAdapter message must name the run (run_id)")
        elif request.run_id and request.run_id != run_id:
            raise InvalidArgument(f"PushAdapter chunks name two runs: {echo(run_id)} and {echo(request.run_id)}")
        if not request.file_name:
            raise InvalidArgument("every PushAdapter message must name the file its data belongs to (file_name)")
        check_adapter_file_name(request.file_name)
        total += len(request.data)
        if total > MAX_ADAPTER_BYTES:
            raise InvalidArgument(f"the adapter exceeds {MAX_ADAPTER_BYTES >> 30} GiB; is it a full model?")
        chunks.setdefault(request.file_name, []).append(request.data)
    if not run_id:
        raise InvalidArgument("PushAdapter received no messages; send the adapter's files in chunks")
    return run_id, {name: b"".join(parts) for name, parts in chunks.items()}


class RolloutServicer(pb_grpc.RolloutServiceServicer):
    """Each RPC acts for its caller: others' runs are NOT_FOUND, so run ids do not leak; admins see all."""

    def __init__(
        self, service: RolloutService, tokens: TokenTable | None = None, security: SecuritySettings | None = None
    ) -> None:
        self.service = service
        self.tokens = tokens if tokens is not None else TokenTable({})
        self.security = security if security is not None else SecuritySettings()

    def _caller(self, context: grpc.aio.ServicerContext) -> Principal:
        return principal_of(self.tokens, context)

    def _visible(self, caller: Principal) -> list[Run]:
        return [r for r in self.service.runs.values() if caller.admin or r.owner == caller.name]

    def _run(self, run_id: str, caller: Principal) -> Run:
        """The caller's run; NOT_FOUND naming only its own runs if it is another's."""
        run = self.service.runs.find(run_id)
        if run is None or not (caller.admin or run.owner == caller.name):
            yours = ", ".join(r.run_id for r in self._visible(caller)) or "none"
            raise NotFound(f"no run {echo(run_id)}; {'runs' if caller.admin else 'your runs'}: {yours}")
        return run

    @_edge
    async def GetServerInfo(self, request, context):  # type: ignore[no-untyped-def]
        info = self.service.server_info()
        if not self._caller(context).admin:
            info = dataclasses.replace(info, engine_urls=[])  # the servers' development endpoints are not for everyone
        return server_info_to_pb(info)

    @_edge
    async def CreateRun(self, request: pb.CreateRunRequest, context) -> pb.CreateRunResponse:  # type: ignore[no-untyped-def]
        if not request.HasField("spec"):
            raise InvalidArgument("spec is not set")
        spec = await asyncio.to_thread(run_spec_from_pb, request.spec)  # its prompts may be a whole dataset
        run = await self.service.create_run(spec, owner=self._caller(context).name)
        return pb.CreateRunResponse(run=run_to_pb(run))

    @_edge
    async def GetRun(self, request: pb.GetRunRequest, context) -> pb.GetRunResponse:  # type: ignore[no-untyped-def]
        return pb.GetRunResponse(run=run_to_pb(self._run(request.run_id, self._caller(context))))

    @_edge
    async def ListRuns(self, request, context) -> pb.ListRunsResponse:  # type: ignore[no-untyped-def]
        return pb.ListRunsResponse(runs=[run_to_pb(r) for r in self._visible(self._caller(context))])

    @_edge
    async def DeleteRun(self, request: pb.DeleteRunRequest, context) -> pb.DeleteRunResponse:  # type: ignore[no-untyped-def]
        self._run(request.run_id, self._caller(context))
        return pb.DeleteRunResponse(run=run_to_pb(await self.service.delete_run(request.run_id)))

    @_edge
    async def SubmitPrompts(self, request: pb.SubmitPromptsRequest, context) -> pb.SubmitPromptsResponse:  # type: ignore[no-untyped-def]
        self._run(request.run_id, self._caller(context))
        accepted, queued = await self.service.submit_prompts(request.run_id, request.prompts, prompt_from_pb)
        return pb.SubmitPromptsResponse(accepted=accepted, queued=queued)

    @_edge
    async def GetStats(self, request, context) -> pb.GetStatsResponse:  # type: ignore[no-untyped-def]
        caller = self._caller(context)
        stats = self.service.stats()
        evals = [result for result in stats.evals if caller.admin or result.owner == caller.name]
        engines = stats.engines if caller.admin else []  # the servers' development endpoints are not for everyone
        return stats_to_pb(dataclasses.replace(stats, evals=evals, engines=engines), self._visible(caller))

    def _require_admin(self, context: grpc.aio.ServicerContext, what: str) -> None:
        caller = self._caller(context)
        if not caller.admin:
            raise PermissionDenied(f"principal {caller.name!r} may not {what}: set admin for it in security.principals")

    @_edge
    async def AddEngine(self, request: pb.AddEngineRequest, context) -> pb.AddEngineResponse:  # type: ignore[no-untyped-def]
        self._require_admin(context, "add vLLM servers to the pool")
        if not request.url:
            raise InvalidArgument("url is empty; give the vLLM server's base URL, e.g. http://10.0.0.7:8000")
        engine = await self.service.require_membership().add(request.url)
        return pb.AddEngineResponse(engine=engine_state_to_pb(engine))

    @_edge
    async def RemoveEngine(self, request: pb.RemoveEngineRequest, context) -> pb.RemoveEngineResponse:  # type: ignore[no-untyped-def]
        self._require_admin(context, "remove vLLM servers from the pool")
        if not request.url:
            raise InvalidArgument("url is empty; give the server's base URL as GetStats lists it")
        membership = self.service.require_membership()
        if request.HasField("drain_timeout_seconds"):
            removed = await membership.remove(request.url, request.drain_timeout_seconds)
        else:
            removed = await membership.remove(request.url)
        return engine_removed_to_pb(removed)

    def _check_push(self, run_id: str, trainer_address: str, context: grpc.aio.ServicerContext) -> None:
        """Only principals allowed may push base weights, and only from their own or an allowed address."""
        caller = self._caller(context)
        run = self._run(run_id, caller)
        if not self.tokens.enabled:
            return
        if not (caller.admin or caller.push_base_weights) and not run.spec.serve_adapter:
            raise PermissionDenied(
                f"principal {caller.name!r} may not push base weights: they change the policy of every full-weight "
                "run; set push_base_weights for it in security.principals"
            )
        peer = peer_host(context)
        same = trainer_address == peer or (is_loopback(trainer_address) and is_loopback(peer))
        if not same and trainer_address not in self.security.trainer_addresses:
            raise PermissionDenied(
                f"trainer_address {echo(trainer_address)} is not the caller's own address ({peer}); vLLM's workers "
                "would load weights from there. Add it to security.trainer_addresses if it is the trainer's"
            )

    def _check_update(self, update_id: str, context: grpc.aio.ServicerContext) -> None:
        run_id = self.service.weights.of_update(update_id).run_of(update_id)
        if run_id is not None:
            self._run(run_id, self._caller(context))

    @_edge
    async def BeginWeightUpdate(self, request: pb.BeginWeightUpdateRequest, context) -> pb.BeginWeightUpdateResponse:  # type: ignore[no-untyped-def]
        self._check_push(request.run_id, request.trainer_address, context)
        sync = await self.service.weights.ready_for_push(request.run_id)
        if request.pause_mode == pb.PAUSE_MODE_UNSPECIFIED:
            mode = sync.settings.default_pause_mode()
        elif request.pause_mode in PAUSE_MODE_FROM_PB:
            mode = PAUSE_MODE_FROM_PB[request.pause_mode]
        else:
            raise InvalidArgument(f"pause_mode {request.pause_mode} is not a known PauseMode")
        ticket = await sync.begin(
            request.run_id,
            request.trainer_address,
            request.trainer_port,
            tensors_from_pb(request.tensors),
            mode,
            resend=request.resend,
            join=request.join_group,
        )
        return pb.BeginWeightUpdateResponse(
            update_id=ticket.update_id,
            join_group=ticket.join_group,
            group_world_size=ticket.group_world_size,
            backend=ticket.backend,
            policy_version=ticket.policy_version,
            group_epoch=ticket.group_epoch,
            delta_allowed=ticket.delta_allowed,
        )

    @_edge
    async def CommitWeightUpdate(self, request: pb.CommitWeightUpdateRequest, context) -> pb.CommitWeightUpdateResponse:  # type: ignore[no-untyped-def]
        self._check_update(request.update_id, context)
        version, seconds = await self.service.weights.of_update(request.update_id).commit(request.update_id)
        return pb.CommitWeightUpdateResponse(policy_version=version, seconds=seconds)

    @_edge
    async def AbortWeightUpdate(self, request: pb.AbortWeightUpdateRequest, context) -> pb.AbortWeightUpdateResponse:  # type: ignore[no-untyped-def]
        self._check_update(request.update_id, context)
        version = await self.service.weights.of_update(request.update_id).abort(request.update_id, request.reason)
        return pb.AbortWeightUpdateResponse(policy_version=version)

    @_edge
    async def PushAdapter(  # type: ignore[override]
        self, request_iterator: AsyncIterator[pb.PushAdapterRequest], context: grpc.aio.ServicerContext
    ) -> pb.PushAdapterResponse:
        run_id, files = await _adapter_files(request_iterator)
        self._run(run_id, self._caller(context))
        started = time.monotonic()
        version, name = await self.service.publish_adapter(run_id, files)
        return pb.PushAdapterResponse(policy_version=version, adapter_name=name, seconds=time.monotonic() - started)

    @_stream_edge
    async def StreamSamples(  # type: ignore[override]
        self, request_iterator: AsyncIterator[pb.StreamSamplesRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.StreamSamplesResponse | bytes]:
        session: ConsumerSession | None = None
        reader: asyncio.Task[None] | None = None
        try:
            subscribe = await self._first_message(request_iterator)
            consumer_id, credits = subscribe.consumer_id, subscribe.initial_credits
            self._run(subscribe.run_id, self._caller(context))
            candidate = ConsumerSession(self.service, subscribe.run_id, consumer_id, credits)
            candidate.check_limits()
            candidate.broker.subscribe(consumer_id, credits)
            # Only a stream that subscribed may release (not a refused duplicate of a live consumer id).
            session = candidate
            session.broker.admission.watch(session.wake)
            requests = _consumer_requests(request_iterator)
            reader = asyncio.create_task(session.read(requests), name=f"read-{subscribe.consumer_id}")
            yield pb.StreamSamplesResponse(
                subscribed=pb.Subscribed(
                    run_id=session.run.run_id,
                    policy_version=session.run.policy_version,
                    max_staleness=session.run.spec.max_staleness,
                )
            )
            while (message := await session.next_message()) is not None:
                yield consumer_message_to_wire(message)
        finally:
            if reader is not None:
                reader.cancel()
            if session is not None:
                session.broker.admission.unwatch(session.wake)
                returned = await session.broker.release(session.consumer_id)
                if returned:
                    logger.info("consumer %s left; %d unacked groups returned", session.consumer_id, returned)

    @staticmethod
    async def _first_message(requests: AsyncIterator[pb.StreamSamplesRequest]) -> pb.Subscribe:
        try:
            first = await asyncio.wait_for(anext(requests), SUBSCRIBE_TIMEOUT_S)
        except StopAsyncIteration:
            raise InvalidArgument("the stream closed before sending subscribe") from None
        except TimeoutError:
            raise InvalidArgument(f"no subscribe within {SUBSCRIBE_TIMEOUT_S:.0f}s of opening the stream") from None
        if first.WhichOneof("kind") != "subscribe":
            raise InvalidArgument("the first StreamSamplesRequest must be subscribe (run_id, consumer_id)")
        sub = first.subscribe
        if not sub.run_id:
            raise InvalidArgument("subscribe.run_id is empty")
        if not sub.consumer_id:
            raise InvalidArgument("subscribe.consumer_id is empty; name the consumer, e.g. trainer-rank0")
        return sub
