"""Translation between rollout.v1 messages and the service's dataclasses, in one place."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict
from typing import TYPE_CHECKING, get_args

from google.protobuf.descriptor import Descriptor

from rollout_api import rollout_pb2 as pb
from rollout_common.staleness import DEFAULT_MAX_STALENESS
from rollout_service import __version__
from rollout_service.delivery.audit import AuditReport
from rollout_service.delivery.broker import ACK_DROPPED_STALE, ACK_TRAINED
from rollout_service.delivery.consumer import Ack, ConsumerMessage, ConsumerRequest, Credit, WeightsWanted
from rollout_service.delivery.ledger import LedgerSnapshot
from rollout_service.delivery.lookahead import Lookahead
from rollout_service.edge.group_wire import delivery_response
from rollout_service.errors import InvalidArgument, echo
from rollout_service.eval_tally import EvalSpec
from rollout_service.evaluation import EvalResult, eval_result
from rollout_service.generation.prompts import PromptSpec
from rollout_service.runs import AdmissionMode, Run, RunSpec, RunState
from rollout_service.types import (
    AdvantageScaling,
    EngineRemoved,
    EngineState,
    EpisodeSpec,
    PauseModeName,
    RunStall,
    SamplingParams,
)
from rollout_service.weights.update_messages import TensorSpec, UpdateTimes

if TYPE_CHECKING:
    from rollout_service.service_reports import ServerInfo, ServiceStats

_SCALING_FROM_PB = {
    pb.ADVANTAGE_SCALING_UNSPECIFIED: AdvantageScaling.GROUP,
    pb.ADVANTAGE_SCALING_GROUP: AdvantageScaling.GROUP,
    pb.ADVANTAGE_SCALING_BATCH: AdvantageScaling.BATCH,
    pb.ADVANTAGE_SCALING_NONE: AdvantageScaling.NONE,
}
_SCALING_TO_PB = {scaling: number for number, scaling in _SCALING_FROM_PB.items() if number}  # not UNSPECIFIED
_ADMISSION_FROM_PB: dict[int, AdmissionMode] = {
    pb.ADMISSION_MODE_UNSPECIFIED: "paced",
    pb.ADMISSION_MODE_STALENESS: "staleness",
    pb.ADMISSION_MODE_PACED: "paced",
}
_ADMISSION_TO_PB = {mode: number for number, mode in _ADMISSION_FROM_PB.items() if number}  # not UNSPECIFIED
_STATE_TO_PB = {state: getattr(pb, f"RUN_STATE_{state.upper()}") for state in get_args(RunState)}
_STALL_KIND_TO_PB = {"generation": pb.STALL_KIND_GENERATION, "consumers": pb.STALL_KIND_CONSUMERS}
ACK_FROM_PB = {
    pb.ACK_STATUS_UNSPECIFIED: ACK_TRAINED,
    pb.ACK_STATUS_TRAINED: ACK_TRAINED,
    pb.ACK_STATUS_DROPPED_STALE: ACK_DROPPED_STALE,
}
PAUSE_MODE_FROM_PB = {getattr(pb, f"PAUSE_MODE_{mode.upper()}"): mode for mode in get_args(PauseModeName)}


def undecodable(data: bytes, message: Descriptor) -> str:
    """Why ``data`` does not parse as ``message``, naming the string field that is not UTF-8
    when there is one (protobuf's own error names only the message type)."""
    try:
        field = _bad_utf8_field(data, message)
    except IndexError:  # truncated: not a message at all
        field = None
    if field is None:
        return f"the request is not a valid {message.name}; send it encoded as protobuf"
    return f"{message.name}.{field} is not valid UTF-8; send strings as UTF-8"


def _bad_utf8_field(data: bytes, message: Descriptor) -> str | None:
    """The path of the first string field in ``data`` that is not UTF-8, if any."""
    position, seen = 0, Counter[int]()
    while position < len(data):
        tag, position = _varint(data, position)
        number, wire_type = tag >> 3, tag & 7
        if wire_type != 2:  # a number (varint, 64 or 32 bits): no text inside
            position = _varint(data, position)[1] if wire_type == 0 else position + (8 if wire_type == 1 else 4)
            continue
        size, position = _varint(data, position)
        value, position = data[position : position + size], position + size
        field = message.fields_by_number.get(number)
        if field is None:
            continue
        name = f"{field.name}[{seen[number]}]" if field.is_repeated else field.name
        seen[number] += 1
        if field.type == field.TYPE_STRING:
            try:
                value.decode()
            except UnicodeDecodeError:
                return name
        elif field.type == field.TYPE_MESSAGE and (inner := _bad_utf8_field(value, field.message_type)):
            return f"{name}.{inner}"
    return None


def _varint(data: bytes, position: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[position]
        value, shift, position = value | (byte & 0x7F) << shift, shift + 7, position + 1
        if byte < 0x80:
            return value, position


_ENCODING_FROM_PB = {
    pb.TENSOR_ENCODING_UNSPECIFIED: "",
    pb.TENSOR_ENCODING_FULL: "full",
    pb.TENSOR_ENCODING_SPARSE: "sparse",
}


def tensors_from_pb(tensors: list[pb.TensorMeta]) -> list[TensorSpec]:
    specs = []
    for t in tensors:
        if t.encoding not in _ENCODING_FROM_PB:
            raise InvalidArgument(f"tensor {echo(t.name)} has encoding {t.encoding}, not a known TensorEncoding")
        specs.append(TensorSpec(t.name, t.dtype, tuple(t.shape), _ENCODING_FROM_PB[t.encoding], t.changed, t.checksum))
    return specs


def prompt_from_pb(prompt: pb.Prompt) -> PromptSpec:
    kind = prompt.WhichOneof("content")
    metadata = dict(prompt.metadata)
    if kind == "messages":
        return PromptSpec(
            messages=[{"role": m.role, "content": m.content} for m in prompt.messages.messages],
            metadata=metadata,
        )
    if kind == "text":
        return PromptSpec(text=prompt.text, metadata=metadata)
    if kind == "token_ids":
        return PromptSpec(token_ids=list(prompt.token_ids.ids), metadata=metadata)
    raise InvalidArgument("a prompt has none of messages, text or token_ids set")


def sampling_from_pb(s: pb.SamplingParams) -> SamplingParams:
    return SamplingParams(
        max_tokens=s.max_tokens,  # the proto says > 0: RunSpec.validate refuses 0
        temperature=s.temperature if s.HasField("temperature") else 1.0,
        top_p=s.top_p or 1.0,
        top_k=s.top_k,
        stop=tuple(s.stop),
        seed=s.seed if s.HasField("seed") else None,
    )


def episode_from_pb(e: pb.EpisodeSpec) -> EpisodeSpec:
    return EpisodeSpec(
        tools=tuple(e.tools),
        tool_parser=e.tool_parser,
        tool_timeout_s=e.tool_timeout_seconds,
        max_turns=e.max_turns,
        max_episode_tokens=e.max_episode_tokens,
        environment=e.environment,
    )


def episode_to_pb(e: EpisodeSpec) -> pb.EpisodeSpec:
    fields = asdict(e)
    fields["tool_timeout_seconds"] = fields.pop("tool_timeout_s")  # the others are named as in the message
    return pb.EpisodeSpec(**fields)


def run_spec_from_pb(spec: pb.RunSpec) -> RunSpec:
    source = spec.prompt_source.WhichOneof("source")
    if source is None:
        raise InvalidArgument("prompt_source is not set; choose dataset, prompts, submitted or external")
    if spec.scale_rewards not in _SCALING_FROM_PB:
        raise InvalidArgument(f"scale_rewards {spec.scale_rewards} is not a known AdvantageScaling value")
    if spec.admission not in _ADMISSION_FROM_PB:
        raise InvalidArgument(f"admission {spec.admission} is not a known AdmissionMode value")
    return RunSpec(
        source_kind=source,
        dataset=spec.prompt_source.dataset,
        prompts=tuple(prompt_from_pb(p) for p in spec.prompt_source.prompts.prompts),
        sampling=sampling_from_pb(spec.sampling),
        group_size=spec.group_size,
        rewards=tuple((r.name, r.weight if r.HasField("weight") else 1.0) for r in spec.reward_functions),
        max_staleness=spec.max_staleness if spec.HasField("max_staleness") else DEFAULT_MAX_STALENESS,
        max_inflight=spec.max_inflight,
        max_buffered_groups=spec.max_buffered_groups,
        scale_rewards=_SCALING_FROM_PB[spec.scale_rewards],
        display_name=spec.display_name,
        episode=episode_from_pb(spec.episode),
        weight=spec.weight or 1.0,
        admission=_ADMISSION_FROM_PB[spec.admission],
        lease_timeout_s=spec.lease_timeout_seconds,
        await_first_update=spec.await_first_update,
        serve_adapter=spec.serve_adapter,
        group_deadline_s=spec.group_deadline_seconds,
        min_group_size=spec.min_group_size,
        eval=eval_spec_from_pb(spec.eval) if spec.HasField("eval") else None,
        max_mismatch_kl=spec.max_mismatch_kl,
    )


def eval_spec_from_pb(spec: pb.EvalSpec) -> EvalSpec:
    return EvalSpec(policy_version=spec.policy_version if spec.HasField("policy_version") else None)


def eval_result_to_pb(result: EvalResult) -> pb.EvalResult:
    fields = asdict(result)
    del fields["owner"]  # what GetStats filters by, not sent
    return pb.EvalResult(**fields)


def run_spec_to_pb(spec: RunSpec) -> pb.RunSpec:
    s = spec.sampling
    out = pb.RunSpec(
        sampling=pb.SamplingParams(
            max_tokens=s.max_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            stop=list(s.stop),
            seed=s.seed,
        ),
        group_size=spec.group_size,
        reward_functions=[pb.RewardFunctionSpec(name=n, weight=w) for n, w in spec.rewards],
        max_staleness=spec.max_staleness,
        max_inflight=spec.max_inflight,
        max_buffered_groups=spec.max_buffered_groups,
        scale_rewards=_SCALING_TO_PB[spec.scale_rewards],
        display_name=spec.display_name,
        weight=spec.weight,
        admission=_ADMISSION_TO_PB[spec.admission],
        lease_timeout_seconds=spec.lease_timeout_s,
        await_first_update=spec.await_first_update,
        serve_adapter=spec.serve_adapter,
        group_deadline_seconds=spec.group_deadline_s,
        min_group_size=spec.min_group_size,
        episode=episode_to_pb(spec.episode) if spec.episode.multi_turn else None,
        eval=pb.EvalSpec(policy_version=spec.eval.policy_version) if spec.eval is not None else None,
        max_mismatch_kl=spec.max_mismatch_kl,
    )
    if spec.source_kind == "dataset":
        out.prompt_source.dataset = spec.dataset
    else:  # the source's oneof field; prompts themselves are not echoed back
        getattr(out.prompt_source, spec.source_kind).SetInParent()
    return out


def ledger_to_pb(snapshot: LedgerSnapshot) -> pb.GoodputLedger:
    entries = {**snapshot.flows, **snapshot.stocks}
    fields = {
        name: pb.LedgerEntry(tokens=c.tokens, engine_seconds=c.seconds, groups=c.groups) for name, c in entries.items()
    }
    return pb.GoodputLedger(**fields, goodput=snapshot.goodput, goodput_seconds=snapshot.goodput_seconds)


def audit_to_pb(report: AuditReport) -> pb.BiasAudit:
    fields = {name: value for name, value in vars(report).items() if name not in ("features", "flagged")}
    features = [pb.FeatureDrift(**vars(drift)) for drift in report.features]
    return pb.BiasAudit(**fields, features=features, flagged=list(report.flagged))


def mismatch_control_to_pb(lookahead: Lookahead) -> pb.MismatchControl:
    return pb.MismatchControl(
        max_mismatch_kl=lookahead.max_mismatch_kl,
        mismatch_kl=lookahead.mismatch_kl,
        lookahead_versions=lookahead.versions,
        cuts=lookahead.cuts,
    )


def run_stats_to_pb(run: Run) -> pb.RunStats:
    b, a = run.broker, run.admission
    ledger = b.goodput()
    stats = pb.RunStats(
        **asdict(run.counters),  # named as in the message
        tokens_generated=ledger.generated.tokens,
        ledger=ledger_to_pb(ledger),
        audit=audit_to_pb(b.audit.report()),
        groups_trained=b.ack_counts[ACK_TRAINED],
        groups_dropped_stale=b.ack_counts[ACK_DROPPED_STALE],
        groups_buffered=len(b.buffered),
        groups_leased=b.num_leased,
        groups_returned=b.groups_returned,
        leases_expired=b.leases_expired,
        admission_waits=a.admission_waits,
        groups_per_version=a.groups_per_version or 0.0,
        admission_wait_seconds=a.admission_wait_seconds,
        lookahead_versions=a.lookahead_versions,
    )
    if a.lookahead is not None:
        stats.ledger.control.CopyFrom(mismatch_control_to_pb(a.lookahead))
    return stats


def stats_to_pb(stats: ServiceStats, runs: Iterable[Run]) -> pb.GetStatsResponse:
    """``stats``' fields are named as in the message, but for those converted here."""
    converted = ("slot_seconds", "evals", "engines", "last_weight_update")
    last_update = stats.last_weight_update
    return pb.GetStatsResponse(
        **{name: value for name, value in vars(stats).items() if name not in converted},
        slot_seconds_total=stats.slot_seconds,
        evals=[eval_result_to_pb(result) for result in stats.evals],
        engines=[engine_state_to_pb(engine) for engine in stats.engines],
        last_weight_update=update_times_to_pb(last_update) if last_update is not None else None,
        runs={run.run_id: run_stats_to_pb(run) for run in runs},
    )


def engine_state_to_pb(engine: EngineState) -> pb.EngineState:
    return pb.EngineState(**asdict(engine))


def engine_removed_to_pb(removed: EngineRemoved) -> pb.RemoveEngineResponse:
    return pb.RemoveEngineResponse(**asdict(removed))


def update_times_to_pb(times: UpdateTimes) -> pb.WeightUpdateTimes:
    phase = times.phases.get
    return pb.WeightUpdateTimes(
        update_id=times.update_id,
        committed=times.committed,
        join_seconds=phase("join", 0.0),
        pause_seconds=phase("pause", 0.0),
        transfer_seconds=phase("transfer", 0.0),
        finish_seconds=phase("finish", 0.0),
        resume_seconds=phase("resume", 0.0),
        paused_seconds=times.paused_seconds,
        eval_hold_seconds=phase("eval_hold", 0.0),
    )


def run_to_pb(run: Run) -> pb.Run:
    return pb.Run(
        run_id=run.run_id,
        spec=run_spec_to_pb(run.spec),
        state=_STATE_TO_PB[run.state],
        policy_version=run.policy_version,
        stats=run_stats_to_pb(run),
        error=run.error,
        max_inflight=run.max_inflight,
        max_buffered_groups=run.broker.max_buffered,
        stall=stall_to_pb(run.stall) if run.stall is not None else None,
        eval_result=eval_result_to_pb(eval_result(run)) if run.eval is not None else None,
    )


def stall_to_pb(stall: RunStall) -> pb.RunStall:
    return pb.RunStall(kind=_STALL_KIND_TO_PB[stall.kind], reason=stall.reason, seconds=stall.seconds)


def server_info_to_pb(info: ServerInfo) -> pb.GetServerInfoResponse:
    return pb.GetServerInfoResponse(service_version=__version__, **asdict(info))


def consumer_request_from_pb(message: pb.StreamSamplesRequest) -> ConsumerRequest:
    """A StreamSamples request after the subscribe: a credit or an ack."""
    kind = message.WhichOneof("kind")
    if kind == "credit":
        return Credit(message.credit.groups)
    if kind == "ack":
        ack = message.ack
        if ack.status not in ACK_FROM_PB:
            raise InvalidArgument(f"ack.status {ack.status} is not a known AckStatus")
        trained_at = ack.policy_version if ack.HasField("policy_version") else None
        mismatch = ack.mismatch_kl if ack.HasField("mismatch_kl") else None
        if mismatch is not None and not (math.isfinite(mismatch) and mismatch >= 0):
            raise InvalidArgument(f"ack.mismatch_kl is {mismatch}; send a finite KL >= 0, or leave it unset")
        return Ack(list(ack.group_ids), ACK_FROM_PB[ack.status], trained_at, mismatch)
    if kind == "subscribe":
        raise InvalidArgument("subscribe may only be the first message of a stream")
    raise InvalidArgument("empty StreamSamplesRequest: set one of subscribe, credit or ack")


def consumer_message_to_wire(message: ConsumerMessage) -> pb.StreamSamplesResponse | bytes:
    """What the stream sends: a group delivery as the response's bytes (``group_wire``:
    encoded once per group), anything else as a message."""
    if isinstance(message, WeightsWanted):
        wanted = pb.WeightsWanted(policy_version=message.policy_version, reason=message.reason)
        return pb.StreamSamplesResponse(weights_wanted=wanted)
    if isinstance(message, RunStall):
        return pb.StreamSamplesResponse(stall=stall_to_pb(message))
    return delivery_response(message.group, message.attempt)
