"""Paced admission's lookahead: learned from the consumers' waits and the groups' buffer time,
checked against worked numbers (gain 0.5, target slack 0.1 of a step)."""

import asyncio
import re

import pytest

from rollout_api import rollout_pb2 as pb
from rollout_service.delivery.admission import RunAdmission
from rollout_service.delivery.broker import ACK_TRAINED, RunBroker
from rollout_service.delivery.consumer import Ack
from rollout_service.delivery.lookahead import Lookahead
from rollout_service.edge.convert import consumer_request_from_pb, run_spec_from_pb, run_spec_to_pb
from rollout_service.errors import InvalidArgument
from rollout_service.generation.prompts import PromptSpec
from rollout_service.metrics import ServiceMetrics
from rollout_service.runs import RunSpec
from rollout_service.types import SamplingParams
from tests.support import wait_until
from tests.unit.rollout_service.builders import spec
from tests.unit.rollout_service.delivery.broker_helpers import Clock, produce
from tests.unit.scripted import ScriptedGroupEngine, make_service


def version(lookahead: Lookahead, clock: Clock, seconds: float, slack: float | None, starved: float = 0.0) -> None:
    """One trainer version of ``seconds``: a consumer starved ``starved`` seconds at its start,
    then took groups, the readiest of which had waited ``slack`` seconds."""
    if starved:
        lookahead.consumer_waits()
        clock.now += starved
        lookahead.consumer_served()
    if slack is not None:
        lookahead.group_taken(slack + 0.5)
        lookahead.group_taken(slack)
    clock.now += seconds - starved
    lookahead.version_ended()


def test_groups_that_waited_two_steps_running_in_the_buffer_bring_the_lookahead_down() -> None:
    clock = Clock()
    lookahead = Lookahead(2, clock=clock)
    assert lookahead.versions == 2.0  # starts where staleness admission is
    version(lookahead, clock, 1.0, slack=1.0)  # the version before counts as slack 0: (0.1 - 0) / 1
    assert lookahead.versions == 2.0
    version(lookahead, clock, 2.0, slack=1.2)  # slack min(1.2, 1.0): (0.2 - 1.0) / 2 = -0.4, half of it
    assert lookahead.versions == pytest.approx(1.8)
    version(lookahead, clock, 1.0, slack=0.1)  # on target: stays
    assert lookahead.versions == pytest.approx(1.8)


def test_slack_right_after_a_wait_does_not_cut_the_lookahead() -> None:
    """A version whose trainer waited let generation run ahead: the next version's early
    groups are its echo, not lookahead to spare."""
    clock = Clock()
    lookahead = Lookahead(2, clock=clock)
    lookahead.versions = 1.0
    version(lookahead, clock, 1.0, slack=0.0, starved=0.2)  # (0.1 + 0.2) / 1
    assert lookahead.versions == pytest.approx(1.15)
    version(lookahead, clock, 1.0, slack=0.8)  # min(0.8, 0): (0.1 - 0) / 1
    assert lookahead.versions == pytest.approx(1.2)
    version(lookahead, clock, 1.0, slack=0.8)  # min(0.8, 0.8): (0.1 - 0.8) / 1
    assert lookahead.versions == pytest.approx(0.85)


def test_a_trainer_that_waits_raises_it_and_it_stays_within_zero_and_max_staleness() -> None:
    clock = Clock()
    lookahead = Lookahead(2, clock=clock)
    for _ in range(6):
        version(lookahead, clock, 1.0, slack=3.0)  # -1.45 a version at most
    assert lookahead.versions == 0.0
    version(lookahead, clock, 1.0, slack=0.0, starved=0.3)  # (0.1 + 0.3) / 1
    assert lookahead.versions == pytest.approx(0.2)
    for _ in range(10):
        version(lookahead, clock, 1.0, slack=0.0, starved=0.5)
    assert lookahead.versions == 2.0  # a generation-bound run keeps max_staleness


def test_a_version_with_nothing_taken_and_nobody_waiting_teaches_nothing() -> None:
    clock = Clock()
    lookahead = Lookahead(2, clock=clock)
    lookahead.versions = 1.0
    version(lookahead, clock, 1.0, slack=None)
    assert lookahead.versions == 1.0  # a step's error would have raised it by 0.05


def test_a_wait_that_spans_a_version_end_counts_in_both_versions() -> None:
    clock = Clock()
    lookahead = Lookahead(2, clock=clock)
    lookahead.versions = 0.0
    lookahead.consumer_waits()
    lookahead.consumer_waits()  # two consumers wait at once: the time counts once
    clock.now += 1.0
    lookahead.version_ended()  # (0.1 + 1.0) / 1 -> +0.55
    assert lookahead.versions == pytest.approx(0.55)
    clock.now += 0.5
    lookahead.consumer_served()
    lookahead.consumer_served()
    clock.now += 0.5
    lookahead.version_ended()  # (0.1 + 0.5) / 1 -> +0.3
    assert lookahead.versions == pytest.approx(0.85)


async def test_a_mismatch_over_the_bound_cuts_a_version_whatever_pacing_asks() -> None:
    """Bound 0.02: over it, a version off (though the trainer starved and pacing would raise
    it); between 0.01 and 0.02, held; under 0.01, pacing decides again."""
    clock = Clock()
    lookahead = Lookahead(4, clock=clock, max_mismatch_kl=0.02)
    assert lookahead.versions == 1.0  # a bound starts one version ahead, not at max_staleness
    lookahead.versions = 4.0
    lookahead.mismatch_reported(0.01)
    lookahead.mismatch_reported(0.03)  # the version's worst counts
    version(lookahead, clock, 1.0, slack=None, starved=0.5)  # pacing alone: +0.5 * (0.1 + 0.5) = +0.3
    assert (lookahead.versions, lookahead.cuts, lookahead.mismatch_kl) == (3.0, 1, 0.03)
    lookahead.mismatch_reported(0.015)
    version(lookahead, clock, 1.0, slack=None, starved=0.5)  # no headroom: not raised
    assert (lookahead.versions, lookahead.cuts) == (3.0, 1)
    lookahead.mismatch_reported(0.004)
    version(lookahead, clock, 1.0, slack=None, starved=0.5)  # headroom: pacing raises it
    assert lookahead.versions == pytest.approx(3.3) and lookahead.mismatch_kl == 0.004
    for _ in range(5):  # it never goes below 0
        lookahead.mismatch_reported(1.0)
        version(lookahead, clock, 1.0, slack=None)  # nothing taken, nobody waited: only the bound speaks
    assert lookahead.versions == 0.0 and lookahead.cuts == 6
    version(lookahead, clock, 1.0, slack=0.1)  # no report: pacing's (0.1 - min(0.1, 0)) / 1, halved
    assert lookahead.versions == pytest.approx(0.05) and lookahead.mismatch_kl == 1.0


def test_without_a_bound_the_reports_change_nothing() -> None:
    clock, bounded = Clock(), Clock()
    free, reported = Lookahead(2, clock=clock), Lookahead(2, clock=bounded)
    for lookahead, c in ((free, clock), (reported, bounded)):
        lookahead.mismatch_reported(5.0)
        version(lookahead, c, 2.0, slack=1.2)
    assert free.versions == reported.versions and reported.cuts == 0


def test_acks_carry_their_mismatch_to_the_lookahead() -> None:
    metrics = ServiceMetrics()
    lookahead = Lookahead(2, max_mismatch_kl=0.1)
    admission = RunAdmission("r", metrics, max_staleness=2, lookahead=lookahead)
    admission.trained(0, mismatch_kl=0.5)
    admission.trained(0)  # unmeasured: no report
    admission.set_trainer_version(1)  # the version ends
    assert (lookahead.cuts, lookahead.versions, lookahead.mismatch_kl) == (1, 0.0, 0.5)


async def test_groups_that_waited_in_the_broker_lower_what_admission_lets_start() -> None:
    """max_staleness 2, C = 4, a trainer slower than generation: groups that sat a whole step
    in the buffer lower the bound below staleness admission's 3 versions' worth."""
    clock = Clock()
    lookahead = Lookahead(2, clock=clock)
    admission = RunAdmission("r", ServiceMetrics(), max_staleness=2, lookahead=lookahead)
    broker = RunBroker("r", 100, ServiceMetrics(), clock=clock, admission=admission)
    broker.subscribe("c", credits=4)
    admission.set_trainer_version(1)
    admission.set_policy_version(1)
    await produce(broker, *(f"a{i}" for i in range(12)))  # at t = 0
    await train(broker, clock, trained_at=1, seconds=1.0)  # a0-a3, taken at once
    admission.set_trainer_version(2)  # error (0.1 - 0) / 1: stays at max_staleness
    assert lookahead.versions == 2.0
    admission.set_policy_version(2)
    await train(broker, clock, trained_at=2, seconds=1.0)  # a4-a7 waited 1 s (the version before: 0)
    admission.set_trainer_version(3)
    assert lookahead.versions == 2.0
    admission.set_policy_version(3)
    await train(broker, clock, trained_at=3, seconds=1.0)  # a8-a11 waited 2 s: min(2, 1) = 1 s of slack
    admission.set_trainer_version(4)  # (0.1 - 1.0) / 1 = -0.9, half of it
    assert lookahead.versions == pytest.approx(1.55)
    admission.set_policy_version(4)
    assert admission.groups_per_version == 4
    await produce(broker, *(f"b{i}" for i in range(11)))  # (1.55 + 1) * 4 = 10.2: the 11th starts at 10
    assert not broker.has_room()  # staleness admission would let 12 be pending


async def test_a_consumer_that_waits_for_a_group_raises_the_lookahead() -> None:
    clock = Clock()
    lookahead = Lookahead(2, clock=clock)
    lookahead.versions = 1.0
    admission = RunAdmission("r", ServiceMetrics(), max_staleness=2, lookahead=lookahead)
    broker = RunBroker("r", 100, ServiceMetrics(), clock=clock, admission=admission)
    broker.subscribe("c", credits=1)
    waiting = asyncio.ensure_future(broker.take("c"))
    await wait_until(lambda: lookahead.consumers_waiting == 1, 5, "the take to wait on the empty buffer")
    clock.now += 0.4
    await produce(broker, "a0")
    assert (await asyncio.wait_for(waiting, 5)).group_id == "a0"
    assert lookahead.consumers_waiting == 0
    clock.now += 0.6
    admission.set_trainer_version(1)  # 1 s, starved 0.4, slack 0: (0.1 + 0.4) / 1, half of it
    assert lookahead.versions == pytest.approx(1.25)


async def test_a_cancelled_take_stops_counting_as_a_wait() -> None:
    clock = Clock()
    lookahead = Lookahead(2, clock=clock)
    admission = RunAdmission("r", ServiceMetrics(), max_staleness=2, lookahead=lookahead)
    broker = RunBroker("r", 100, ServiceMetrics(), clock=clock, admission=admission)
    broker.subscribe("c", credits=1)
    waiting = asyncio.ensure_future(broker.take("c"))
    await wait_until(lambda: lookahead.consumers_waiting == 1, 5, "the take to wait on the empty buffer")
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    assert lookahead.consumers_waiting == 0


async def train(broker: RunBroker, clock: Clock, trained_at: int, seconds: float) -> None:
    """One step of a trainer with credits for 4 groups: take them, train, ack."""
    taken = [(await broker.take("c")).group_id for _ in range(4)]
    clock.now += seconds
    broker.ack("c", taken, ACK_TRAINED, trained_at=trained_at)


async def trained_staleness(admission: str, steps: int = 20) -> tuple[float, float]:
    """A trainer slower than generation on the real scheduler, broker and admission (a
    scripted engine): 4 groups a step, pushes that commit at once. Returns the mean staleness
    of the groups its last 10 steps trained, and the run's lookahead at the end."""
    service = make_service(ScriptedGroupEngine(), max_inflight=16)
    spec = RunSpec(
        source_kind="prompts",
        prompts=(PromptSpec(token_ids=[1]),),
        sampling=SamplingParams(max_tokens=4),
        group_size=2,
        rewards=(("completion_length", 1.0),),
        max_staleness=2,
        admission=admission,  # type: ignore[arg-type]
        max_buffered_groups=8,  # as rollout-trainer asks for: max_staleness steps' worth
        await_first_update=True,
    )
    run = await service.create_run(spec)
    run.broker.subscribe("trainer", credits=4)
    service.versions.set_trainer(1)  # the trainer's first push
    service.set_policy_version(1)
    staleness: list[int] = []
    try:
        for version in range(1, steps + 1):
            groups = [await asyncio.wait_for(run.broker.take("trainer"), 5) for _ in range(4)]
            await asyncio.sleep(0.04)  # the trainer's step: its compute, while generation goes on
            run.broker.ack("trainer", [g.group_id for g in groups], ACK_TRAINED, trained_at=version)
            staleness += [version - g.policy_version for g in groups] if version > steps - 10 else []
            service.versions.set_trainer(version + 1)  # the push begins ...
            service.set_policy_version(version + 1)  # ... and commits
        return sum(staleness) / len(staleness), run.admission.lookahead_versions
    finally:
        await service.close()


async def test_a_trainer_slower_than_generation_trains_fresher_groups_under_paced_admission() -> None:
    full, full_lookahead = await trained_staleness("staleness")
    paced, paced_lookahead = await trained_staleness("paced")
    # Staleness admission keeps two steps' worth buffered: every group waits two versions.
    assert full_lookahead == 2.0 and full >= 1.9
    # Paced admission starts them about one step ahead, or just in time.
    assert paced_lookahead < 1.5 and paced <= 1.0, (paced, paced_lookahead)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"max_mismatch_kl": -0.1}, "max_mismatch_kl is -0.1; it must be a finite number in [0, 100]"),
        ({"max_mismatch_kl": float("nan")}, "max_mismatch_kl is nan"),
        ({"max_mismatch_kl": 0.1, "admission": "staleness"}, "set admission ADMISSION_MODE_PACED"),
        ({"max_mismatch_kl": 0.1, "max_staleness": 0}, "and max_staleness > 0"),
    ],
)
def test_a_bad_mismatch_bound_says_what_to_change(fields, message) -> None:
    with pytest.raises(InvalidArgument, match=re.escape(message)):
        spec([[1]], **fields).validate()


def test_the_bound_and_the_acks_mismatch_go_over_the_wire() -> None:
    message = pb.RunSpec(group_size=2, max_mismatch_kl=0.05)
    message.prompt_source.dataset = "letters"
    assert run_spec_to_pb(run_spec_from_pb(message)).max_mismatch_kl == 0.05
    ack = consumer_request_from_pb(pb.StreamSamplesRequest(ack=pb.Ack(group_ids=["g"], mismatch_kl=0.25)))
    assert isinstance(ack, Ack) and ack.mismatch_kl == 0.25
    assert consumer_request_from_pb(pb.StreamSamplesRequest(ack=pb.Ack(group_ids=["g"]))).mismatch_kl is None
    with pytest.raises(InvalidArgument, match=re.escape("ack.mismatch_kl is nan; send a finite KL >= 0")):
        consumer_request_from_pb(pb.StreamSamplesRequest(ack=pb.Ack(group_ids=["g"], mismatch_kl=float("nan"))))
