"""Async gRPC client of the rollout service: runs, and a credit-based group stream.

``GroupStream`` keeps the request side of StreamSamples open for the stream's lifetime:
it grants credits and sends acks on the same call, as the protocol requires.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rollout_api import rollout_pb2 as pb
from rollout_api import rollout_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

DEFAULT_RPC_TIMEOUT_S = 30.0


Metadata = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class ClientSecurity:
    """How a client reaches the service: TLS roots (plus a client certificate for mutual
    TLS) and a bearer token. By default from the environment, so every tool the project ships
    (trainer, demo, benchmarks) picks them up: ``ROLLOUT_TLS_CA``, ``ROLLOUT_TLS_CERT``,
    ``ROLLOUT_TLS_KEY``, and ``ROLLOUT_TOKEN`` or ``ROLLOUT_TOKEN_FILE`` (never a flag: a
    command line is visible to every user of the host)."""

    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    token: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> ClientSecurity:
        def path(name: str) -> Path | None:
            return Path(env[name]) if env.get(name) else None

        token = env.get("ROLLOUT_TOKEN") or None
        token_file = path("ROLLOUT_TOKEN_FILE")
        if token is None and token_file is not None:
            token = token_file.read_text().strip()
        return cls(path("ROLLOUT_TLS_CA"), path("ROLLOUT_TLS_CERT"), path("ROLLOUT_TLS_KEY"), token)

    def channel(self, target: str, options: list[tuple[str, int]]) -> grpc.aio.Channel:
        if self.ca_file is None:
            if self.cert_file is not None:
                raise ValueError(
                    "a client certificate needs TLS: set ROLLOUT_TLS_CA (the CA of the service's certificate)"
                )
            return grpc.aio.insecure_channel(target, options=options)
        credentials = grpc.ssl_channel_credentials(
            root_certificates=self.ca_file.read_bytes(),
            private_key=self.key_file.read_bytes() if self.key_file is not None else None,
            certificate_chain=self.cert_file.read_bytes() if self.cert_file is not None else None,
        )
        return grpc.aio.secure_channel(target, credentials, options=options)

    def metadata(self) -> Metadata:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()


async def health_status(target: str, timeout_s: float = 5.0, security: ClientSecurity | None = None) -> str:
    """The service's gRPC health status (``SERVING``, ``NOT_SERVING``, ...) over the same TLS
    as every client (ROLLOUT_TLS_CA ...); health needs no token. For probes that cannot do TLS
    themselves (a Kubernetes ``grpc`` probe): ``rollout-service health``. Raises
    ``HealthCheckFailed`` when the service gives no answer within ``timeout_s``."""
    security = security if security is not None else ClientSecurity.from_env()
    try:
        async with security.channel(target, []) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
    except grpc.aio.AioRpcError as exc:
        raise HealthCheckFailed(rpc_reason(exc)) from None
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


class HealthCheckFailed(Exception):
    """The service gave no health answer (unreachable, TLS refused, timed out)."""


class ServiceNotServing(Exception):
    """The service did not say SERVING within the wait (``wait_until_serving``)."""


async def final_run(target: str, run_id: str, timeout_s: float = DEFAULT_RPC_TIMEOUT_S) -> pb.Run | None:
    """The run as a trainer's summary reads it after its last step; None when the service is not
    reached or refuses (logged: the summary of a finished run is still written without it)."""
    try:
        async with RolloutClient(target, timeout_s=timeout_s) as client:
            return await client.get_run(run_id)
    except (grpc.RpcError, TimeoutError) as exc:
        logger.warning("the final state of run %s is unknown: %r", run_id, exc)
        return None


def paced_lookahead(run: pb.Run | None) -> float | None:
    """How many versions ahead of its trainer a paced run starts groups now
    (``RunStats.lookahead_versions``); None for a run under another admission, or unknown."""
    if run is None or run.spec.admission != pb.ADMISSION_MODE_PACED:
        return None
    return run.stats.lookahead_versions


async def books_now(client: RolloutClient, run_id: str) -> dict[str, float | str]:
    """The run's goodput ledger and bias audit as ``ledger_record`` and ``audit_record`` flatten
    them; empty while the service does not answer (a trainer's stream reports that itself)."""
    try:
        run = await client.get_run(run_id)
    except (grpc.RpcError, TimeoutError) as exc:
        logger.debug("no ledger of run %s now: %r", run_id, exc)
        return {}
    return {**ledger_record(run.stats.ledger), **audit_record(run.stats.audit)}


def audit_record(audit: pb.BiasAudit) -> dict[str, float | str]:
    """The bias audit as flat values for a metrics record: ``audit/<feature>/smd`` and ``/ks``,
    ``audit/prompt_coverage``, ``audit/uniform_coverage``, ``audit/staleness_mean`` and ``audit/flagged``
    (comma-separated)."""
    record: dict[str, float | str] = {}
    for drift in audit.features:
        record[f"audit/{drift.feature}/smd"] = drift.smd
        record[f"audit/{drift.feature}/ks"] = drift.ks
    record["audit/prompt_coverage"] = audit.prompt_coverage
    record["audit/uniform_coverage"] = audit.uniform_coverage
    record["audit/staleness_mean"] = audit.staleness_mean
    record["audit/flagged"] = ",".join(audit.flagged)
    return record


def ledger_record(ledger: pb.GoodputLedger) -> dict[str, float]:
    """The goodput ledger as flat numbers for a metrics record: ``goodput``, ``goodput_seconds``,
    ``ledger_tokens/<entry>``, ``ledger_engine_seconds/<entry>``, and the mismatch bound's state
    as ``control/<field>`` where the run has one."""
    record: dict[str, float] = {"goodput": ledger.goodput, "goodput_seconds": ledger.goodput_seconds}
    for field in ledger.DESCRIPTOR.fields:
        if field.message_type is pb.LedgerEntry.DESCRIPTOR:
            entry = getattr(ledger, field.name)
            record[f"ledger_tokens/{field.name}"] = entry.tokens
            record[f"ledger_engine_seconds/{field.name}"] = round(entry.engine_seconds, 6)
    if ledger.control.max_mismatch_kl:
        record.update({f"control/{field.name}": value for field, value in ledger.control.ListFields()})
    return record


async def wait_until_serving(target: str, timeout_s: float, poll_s: float = 2.0) -> None:
    """Until the service answers SERVING, which it does once start-up is done and a vLLM
    server answers: a trainer started beside a service and servers that are still coming up
    (containers, Kubernetes) waits for them instead of failing its first push. Raises
    ``ServiceNotServing`` with the last answer after ``timeout_s``."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    logged_at = None
    while True:
        try:
            status = await health_status(target, timeout_s=min(5.0, max(timeout_s, 0.1)))
        except HealthCheckFailed as exc:
            status = str(exc)
        if status == "SERVING":
            return
        now = asyncio.get_running_loop().time()
        if now >= deadline:
            raise ServiceNotServing(
                f"the rollout service at {target} did not say SERVING within {timeout_s:g}s (last: {status}); "
                "is it up, and does one of its vLLM servers answer? (--wait-for-service sets the wait)"
            )
        if logged_at is None or now - logged_at >= 30:
            logger.info("waiting for the rollout service at %s to serve (now: %s)", target, status)
            logged_at = now
        await asyncio.sleep(min(poll_s, deadline - now))  # polling another process's health, not synchronisation


GRPC_CORE_WRITE_FAILED = "Internal error from Core"
"""What grpc's asyncio client reports, as INTERNAL, for a write to a stream whose call has
just ended: the call's own status (UNAVAILABLE when the service died) is overwritten
(grpc/grpc#36066). No answer of the service carries these details."""


RpcError = grpc.aio.AioRpcError
"""A call that failed with a status (the service's answer, or no connection), for callers that
import no grpc; ``rpc_reason`` says it in one line."""


def rpc_reason(exc: BaseException) -> str:
    """What a failed call says, in one line: ``STATUS: message`` for an RPC error."""
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return str(exc) or type(exc).__name__


def unavailable(exc: BaseException) -> bool:
    """The service could not be reached (it is down or restarting), as opposed to an answer.

    That includes a stream whose ack or credit was written as the service died: grpc then
    says INTERNAL (``GRPC_CORE_WRITE_FAILED``), and a trainer took it for an answer and ended
    its run instead of reconnecting (seen in ``tests/integration/faults/test_service_restart.py``)."""
    if not isinstance(exc, grpc.aio.AioRpcError):
        return False
    code = exc.code()
    return code == grpc.StatusCode.UNAVAILABLE or (
        code == grpc.StatusCode.INTERNAL and exc.details() == GRPC_CORE_WRITE_FAILED
    )


def _log_stall(stall: pb.RunStall) -> None:
    logger.warning("the service reports the run stalled (%s): %s", pb.StallKind.Name(stall.kind), stall.reason)


def _log_weights_wanted(wanted: pb.WeightsWanted) -> None:
    logger.info("the service wants this run's weights (not pushed by this consumer): %s", wanted.reason)


class GroupStream:
    """Iterate scored groups of one run; ``ack`` what was trained to release them.

    Credits: ``credits`` groups are granted up front and one more after each ack, so at
    most ``credits`` groups are ever unacked on this consumer.

    The service may ask for the run's weights (``WeightsWanted``, when a restarted vLLM
    server waits for them): the stream passes that to ``on_weights_wanted``, which a pushing
    trainer sets; by default it is logged and ignored (a follower does not push).
    """

    def __init__(
        self, stub: pb_grpc.RolloutServiceStub, run_id: str, consumer_id: str, credits: int, metadata: Metadata = ()
    ) -> None:
        self._outbox: asyncio.Queue[pb.StreamSamplesRequest | None] = asyncio.Queue()
        self._outbox.put_nowait(
            pb.StreamSamplesRequest(
                subscribe=pb.Subscribe(run_id=run_id, consumer_id=consumer_id, initial_credits=credits)
            )
        )
        self._call = stub.StreamSamples(self._requests(), metadata=metadata)
        self.subscribed: pb.Subscribed | None = None
        self.on_weights_wanted: Callable[[pb.WeightsWanted], None] = _log_weights_wanted
        self.on_stall: Callable[[pb.RunStall], None] = _log_stall
        """Called when the service reports the run stalled (``RunStall``); default: a warning."""

    async def _requests(self) -> AsyncIterator[pb.StreamSamplesRequest]:
        while (message := await self._outbox.get()) is not None:
            yield message
            self._outbox.task_done()  # gRPC asks for the next message once this one is written

    async def __aiter__(self) -> AsyncIterator[pb.Group]:
        async for response in self._call:
            kind = response.WhichOneof("kind")
            if kind == "subscribed":
                self.subscribed = response.subscribed
            elif kind == "group":
                yield response.group
            elif kind == "weights_wanted":
                self.on_weights_wanted(response.weights_wanted)
            elif kind == "stall":
                self.on_stall(response.stall)
            else:  # a kind this client does not know (a newer service): nothing to train
                logger.debug("skipping a stream message of kind %s", kind)

    def ack(
        self,
        group_ids: list[str],
        status: pb.AckStatus.ValueType = pb.ACK_STATUS_TRAINED,
        regrant: bool = True,
        policy_version: int | None = None,
        mismatch_kl: float | None = None,
    ) -> None:
        """Ack groups and (by default) grant as many new credits. ``policy_version``: the
        version they were trained at, so the service's admission counts them there;
        ``mismatch_kl``: the sampler-trainer mismatch measured training them."""
        ack = pb.Ack(group_ids=group_ids, status=status, policy_version=policy_version, mismatch_kl=mismatch_kl)
        self._outbox.put_nowait(pb.StreamSamplesRequest(ack=ack))
        if regrant and group_ids:
            self.grant(len(group_ids))

    async def flushed(self) -> None:
        """Return once every ack and credit queued so far has been written to the call."""
        await self._outbox.join()

    def grant(self, groups: int) -> None:
        self._outbox.put_nowait(pb.StreamSamplesRequest(credit=pb.Credit(groups=groups)))

    async def aclose(self, timeout_s: float = 10.0) -> None:
        """End the stream gracefully: pending acks are delivered first, then the request side
        closes and the server ends the call (returning any unacked groups to the run)."""
        self._outbox.put_nowait(None)
        try:
            await asyncio.wait_for(self._call.code(), timeout_s)
        except TimeoutError:
            self.cancel()

    def cancel(self) -> None:
        """Abandon the stream at once; unsent acks are lost and their groups redelivered."""
        self._call.cancel()


class RolloutClient:
    """One channel to the service; use as ``async with RolloutClient(target) as client``."""

    def __init__(
        self, target: str, timeout_s: float = DEFAULT_RPC_TIMEOUT_S, security: ClientSecurity | None = None
    ) -> None:
        self.target = target
        self.timeout_s = timeout_s
        security = security if security is not None else ClientSecurity.from_env()
        self._channel = security.channel(target, options=[("grpc.max_receive_message_length", 64 << 20)])
        self._metadata = security.metadata()
        self.stub = pb_grpc.RolloutServiceStub(self._channel)

    async def __aenter__(self) -> RolloutClient:
        await asyncio.wait_for(self._channel.channel_ready(), self.timeout_s)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._channel.close()

    async def server_info(self) -> pb.GetServerInfoResponse:
        return await self.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=self.timeout_s, metadata=self._metadata)

    async def create_run(self, spec: pb.RunSpec) -> pb.Run:
        return (
            await self.stub.CreateRun(pb.CreateRunRequest(spec=spec), timeout=self.timeout_s, metadata=self._metadata)
        ).run

    async def get_run(self, run_id: str) -> pb.Run:
        return (
            await self.stub.GetRun(pb.GetRunRequest(run_id=run_id), timeout=self.timeout_s, metadata=self._metadata)
        ).run

    async def list_runs(self) -> list[pb.Run]:
        """The runs this caller may see (its own; every run for an admin)."""
        return list(
            (await self.stub.ListRuns(pb.ListRunsRequest(), timeout=self.timeout_s, metadata=self._metadata)).runs
        )

    async def delete_run(self, run_id: str) -> pb.Run:
        return (
            await self.stub.DeleteRun(
                pb.DeleteRunRequest(run_id=run_id), timeout=self.timeout_s, metadata=self._metadata
            )
        ).run

    async def stats(self) -> pb.GetStatsResponse:
        return await self.stub.GetStats(pb.GetStatsRequest(), timeout=self.timeout_s, metadata=self._metadata)

    async def add_engine(self, url: str) -> pb.EngineState:
        """Add a vLLM server to the service's pool (an admin's call); it is held until it
        holds the runs' policy."""
        request = pb.AddEngineRequest(url=url)
        return (await self.stub.AddEngine(request, timeout=self.timeout_s, metadata=self._metadata)).engine

    async def remove_engine(self, url: str, drain_timeout_s: float | None = None) -> pb.RemoveEngineResponse:
        """Drain a vLLM server and take it out of the pool (an admin's call). The call waits
        for the drain, so its deadline covers ``drain_timeout_s`` too."""
        request = pb.RemoveEngineRequest(url=url, drain_timeout_seconds=drain_timeout_s)
        deadline = self.timeout_s + (120.0 if drain_timeout_s is None else drain_timeout_s)
        return await self.stub.RemoveEngine(request, timeout=deadline, metadata=self._metadata)

    async def submit_prompts(self, run_id: str, prompts: list[pb.Prompt]) -> pb.SubmitPromptsResponse:
        request = pb.SubmitPromptsRequest(run_id=run_id, prompts=prompts)
        return await self.stub.SubmitPrompts(request, timeout=self.timeout_s, metadata=self._metadata)

    async def begin_weight_update(
        self,
        run_id: str,
        trainer_address: str,
        trainer_port: int,
        tensors: list[pb.TensorMeta],
        pause_mode: pb.PauseMode.ValueType = pb.PAUSE_MODE_UNSPECIFIED,
        resend: bool = False,
        join_group: bool = False,
    ) -> pb.BeginWeightUpdateResponse:
        """``resend``: the current version's weights again; the commit keeps the version;
        ``join_group``: this trainer holds no transfer group (the servers join a fresh one)."""
        request = pb.BeginWeightUpdateRequest(
            run_id=run_id,
            trainer_address=trainer_address,
            trainer_port=trainer_port,
            tensors=tensors,
            pause_mode=pause_mode,
            resend=resend,
            join_group=join_group,
        )
        return await self.stub.BeginWeightUpdate(request, timeout=self.timeout_s, metadata=self._metadata)

    async def push_adapter(
        self, run_id: str, files: dict[str, bytes], timeout_s: float, chunk_bytes: int = 4 << 20
    ) -> pb.PushAdapterResponse:
        """Stream a LoRA adapter's files (PEFT's save_pretrained output) to a serve_adapter run."""

        def chunks() -> Iterator[pb.PushAdapterRequest]:
            first = True
            for name, data in files.items():
                for start in range(0, max(len(data), 1), chunk_bytes):
                    yield pb.PushAdapterRequest(
                        run_id=run_id if first else "", file_name=name, data=data[start : start + chunk_bytes]
                    )
                    first = False

        return await self.stub.PushAdapter(chunks(), timeout=timeout_s, metadata=self._metadata)

    async def commit_weight_update(self, update_id: str, timeout_s: float) -> pb.CommitWeightUpdateResponse:
        """Waits for every server to receive and apply the weights: give it the transfer timeout."""
        request = pb.CommitWeightUpdateRequest(update_id=update_id)
        return await self.stub.CommitWeightUpdate(request, timeout=timeout_s, metadata=self._metadata)

    async def abort_weight_update(self, update_id: str, reason: str) -> pb.AbortWeightUpdateResponse:
        request = pb.AbortWeightUpdateRequest(update_id=update_id, reason=reason)
        return await self.stub.AbortWeightUpdate(request, timeout=self.timeout_s, metadata=self._metadata)

    def stream(self, run_id: str, consumer_id: str, credits: int = 4) -> GroupStream:
        return GroupStream(self.stub, run_id, consumer_id, credits, self._metadata)


def dataset_run_spec(
    dataset: str,
    rewards: dict[str, float],
    group_size: int = 8,
    max_tokens: int = 64,
    max_staleness: int | None = None,
    **fields: object,
) -> pb.RunSpec:
    """A RunSpec over a built-in dataset, for the common case (``max_staleness`` None: the service's default)."""
    spec = pb.RunSpec(
        group_size=group_size,
        max_staleness=max_staleness,
        reward_functions=[pb.RewardFunctionSpec(name=n, weight=w) for n, w in rewards.items()],
        **fields,  # type: ignore[arg-type]
    )
    spec.prompt_source.dataset = dataset
    spec.sampling.max_tokens = max_tokens
    return spec
