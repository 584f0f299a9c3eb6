"""Evaluation runs against a scripted engine and scripted weight-sync controls: each prompt
once, at one held version, with weight updates waiting for them (the real-vLLM proof is
``tests/integration/test_evaluation.py``)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from rollout_api import rollout_pb2 as pb
from rollout_service.config import WeightSyncSettings
from rollout_service.edge.convert import run_spec_from_pb, run_spec_to_pb, run_to_pb, stats_to_pb
from rollout_service.errors import FailedPrecondition, InvalidArgument
from rollout_service.eval_tally import EvalSpec
from rollout_service.generation.prompts import PromptSpec
from rollout_service.generation.scheduler import REFUSED_BEFORE_FAILING
from rollout_service.runs import RunSpec, RunTable
from rollout_service.types import SamplingParams
from rollout_service.versions import PolicyVersion
from rollout_service.weights.push_routes import PushRoutes
from rollout_service.weights.version_holds import VersionHolds
from rollout_service.weights.weight_sync import WeightSyncCoordinator
from tests.support import listening_port, wait_until
from tests.unit.rollout_service.weights.scripted_control import TENSORS, Clock, ScriptedControl
from tests.unit.scripted import REFUSE_TOKEN, ScriptedEngine, make_service

PROMPTS = ([1, 2], [3], [4, 5, 6])


def eval_spec(version: int | None = None, source_kind: str = "prompts", **kw) -> RunSpec:
    return RunSpec(
        source_kind=source_kind,  # type: ignore[arg-type]
        prompts=tuple(PromptSpec(token_ids=list(p)) for p in PROMPTS) if source_kind == "prompts" else (),
        sampling=SamplingParams(max_tokens=4),
        group_size=2,
        rewards=(("completion_length", 1.0),),
        display_name="held-out",
        eval=EvalSpec(version),
        **kw,
    )


def wired_service(engine, metrics=None, timeout_s: float = 60.0):  # type: ignore[no-untyped-def]
    """A service with a weight sync over one scripted server, as the app builds it."""
    clock = Clock()
    server = ScriptedControl(clock)
    settings = WeightSyncSettings(transfer_timeout_s=60, control_timeout_s=60, eval_hold_timeout_s=timeout_s)
    runs, versions, holds = RunTable(), PolicyVersion(), VersionHolds()
    sync = WeightSyncCoordinator([server], settings, versions, metrics=metrics, clock=clock, holds=holds)
    weights = PushRoutes(runs, weight_sync=sync)
    service = make_service(engine, max_inflight=8, runs=runs, versions=versions, holds=holds, weights=weights)
    return service, sync, server


async def test_an_eval_run_samples_each_prompt_once_at_its_version_and_completes() -> None:
    service = make_service(ScriptedEngine(), max_buffered=1)  # the service default must not bound the set
    service.set_policy_version(3)
    run = await service.create_run(eval_spec())
    await wait_until(lambda: run.state == "completed", 5, "the evaluation to complete")
    assert run.broker.max_buffered == len(PROMPTS)
    run.broker.subscribe("evaluator")
    groups = [await asyncio.wait_for(run.broker.take("evaluator"), 5) for _ in PROMPTS]
    assert sorted(g.prompt.index for g in groups) == [0, 1, 2]  # each prompt once
    assert {e.policy_version_first for g in groups for e in g.episodes} == {3}
    assert {e.policy_version_last for g in groups for e in g.episodes} == {3}
    assert not run.broker.exhausted  # delivered, not yet acked
    run.broker.ack("evaluator", [g.group_id for g in groups], "trained")
    assert run.broker.exhausted
    assert await asyncio.wait_for(run.broker.take("evaluator"), 5) is None  # the stream ends
    assert run.eval is not None and run.eval.complete
    [result] = service.stats().evals
    assert (result.run_id, result.policy_version, result.prompts) == (run.run_id, 3, 3)
    assert (result.groups_scored, result.samples, result.groups_dropped) == (3, 6, 0)
    rewards = [r for g in groups for r in g.rewards]
    assert result.reward_mean == pytest.approx(sum(rewards) / len(rewards))
    assert result.reward_means == {"completion_length": pytest.approx(result.reward_mean)}
    assert service.holds.holders == {}  # released once generated
    sample = service.metrics.registry.get_sample_value
    assert sample("rollout_eval_reward_mean", {"eval": "held-out"}) == pytest.approx(result.reward_mean)
    assert sample("rollout_eval_policy_version", {"eval": "held-out"}) == 3
    assert sample("rollout_eval_samples", {"eval": "held-out"}) == 6
    message = run_to_pb(run)
    assert message.state == pb.RUN_STATE_COMPLETED
    assert (message.eval_result.policy_version, message.eval_result.complete) == (3, True)
    assert stats_to_pb(service.stats(), [run]).evals[0].samples == 6


async def test_an_eval_run_waits_for_its_version_then_holds_it_while_it_generates() -> None:
    engine = ScriptedEngine(hold=True)
    service = make_service(engine, max_inflight=8)
    run = await service.create_run(eval_spec(version=1))
    for _ in range(20):
        await asyncio.sleep(0)  # yields: the feeder would have started a request by now
    assert engine.calls == 0 and service.holds.holders == {}
    service.set_policy_version(1)
    await engine.wait_for(lambda: engine.active == 2 * len(PROMPTS))
    assert service.holds.holders == {run.run_id: 1}
    engine.release()
    await wait_until(lambda: run.state == "completed", 5, "the evaluation to complete")
    assert service.holds.holders == {}
    assert engine.calls == 2 * len(PROMPTS)  # nothing more once the set is done


async def test_a_weight_update_commits_only_after_the_evaluation_released_its_version() -> None:
    engine = ScriptedEngine(hold=True)
    service, sync, server = wired_service(engine)
    try:
        run = await service.create_run(eval_spec())
        await engine.wait_for(lambda: engine.active == 2 * len(PROMPTS))
        ticket = await sync.begin("trainer-run", "127.0.0.1", listening_port(), TENSORS, "none")
        await asyncio.wait_for(server.received.wait(), 5)  # the transfer goes on meanwhile
        commit = asyncio.ensure_future(sync.commit(ticket.update_id))
        for _ in range(20):
            await asyncio.sleep(0)
        assert not commit.done() and sync.version == 0
        engine.release()
        assert (await asyncio.wait_for(commit, 5))[0] == 1
        episodes = [e for g in run.broker.buffered for e in g.episodes]
        assert len(episodes) == 2 * len(PROMPTS)
        assert {(e.policy_version_first, e.policy_version_last) for e in episodes} == {(0, 0)}
        assert sync.last_update is not None and sync.last_update.phases["eval_hold"] > 0
    finally:
        await sync.close()


async def test_a_pausing_update_waits_at_begin_and_no_evaluation_starts_under_it() -> None:
    engine = ScriptedEngine(hold=True)
    service, sync, server = wired_service(engine)
    try:
        first = await service.create_run(eval_spec())
        await engine.wait_for(lambda: engine.active == 2 * len(PROMPTS))
        begin = asyncio.ensure_future(sync.begin("trainer-run", "127.0.0.1", listening_port(), TENSORS, "keep"))
        for _ in range(20):
            await asyncio.sleep(0)
        assert not begin.done() and not server.received.is_set()  # nothing paused under the evaluation
        second = await service.create_run(eval_spec())  # at version 0, while the pausing update waits
        engine.release()
        ticket = await asyncio.wait_for(begin, 5)
        assert first.state == "completed"
        assert engine.calls == 2 * len(PROMPTS)  # the second never started: the servers are pausing
        await asyncio.wait_for(sync.commit(ticket.update_id), 5)
        assert second.state == "failed" and "replaced by 1" in second.error
    finally:
        await sync.close()


async def test_an_evaluation_that_overruns_the_hold_is_stopped_and_the_update_goes_on() -> None:
    engine = ScriptedEngine(hold=True)
    service, sync, _ = wired_service(engine, timeout_s=0.05)
    try:
        run = await service.create_run(eval_spec())
        await engine.wait_for(lambda: engine.active == 2 * len(PROMPTS))
        engine.release(affinity=engine.pending[0][0])  # one group finishes, the others hang
        await wait_until(lambda: run.eval is not None and run.eval.groups_scored == 1, 5, "one group scored")
        ticket = await sync.begin("trainer-run", "127.0.0.1", listening_port(), TENSORS, "none")
        assert (await asyncio.wait_for(sync.commit(ticket.update_id), 5))[0] == 1
        assert run.state == "failed"
        assert "eval_hold_timeout_s" in run.error and "1 of 3 groups" in run.error
        await engine.wait_for(lambda: engine.active == 0)  # its requests were cancelled
        assert run.eval is not None and not run.eval.complete and run.eval.groups_scored == 1
        assert service.holds.holders == {}
        run.broker.subscribe("evaluator")
        group = await asyncio.wait_for(run.broker.take("evaluator"), 5)  # what it scored is kept
        run.broker.ack("evaluator", [group.group_id], "trained")
        assert await asyncio.wait_for(run.broker.take("evaluator"), 5) is None
    finally:
        await sync.close()


async def test_deleting_an_evaluation_releases_its_version() -> None:
    engine = ScriptedEngine(hold=True)
    service = make_service(engine, max_inflight=8)
    run = await service.create_run(eval_spec())
    await engine.wait_for(lambda: engine.active == 2 * len(PROMPTS))
    assert service.holds.holders == {run.run_id: 0}
    await service.delete_run(run.run_id)
    assert service.holds.holders == {}
    assert service.stats().evals[0].run_id == run.run_id  # its result outlives it


async def test_an_evaluation_vllm_refuses_fails_and_releases_its_version() -> None:
    service = make_service(ScriptedEngine(), max_inflight=8)
    refused = tuple(PromptSpec(token_ids=[REFUSE_TOKEN, i]) for i in range(2 * REFUSED_BEFORE_FAILING))
    run = await service.create_run(dataclasses.replace(eval_spec(), prompts=refused))
    await wait_until(lambda: run.state == "failed", 10, "the evaluation to fail")
    assert run.state == "failed" and "vLLM refused" in run.error
    assert service.holds.holders == {}  # a weight update need not wait for it
    await service.delete_run(run.run_id)


async def test_an_evaluation_of_a_replaced_version_is_refused_with_the_current_one() -> None:
    service = make_service(ScriptedEngine())
    service.set_policy_version(2)
    with pytest.raises(FailedPrecondition, match="already hold version 2; evaluate version 2 or later"):
        await service.create_run(eval_spec(version=1))
    assert service.runs == {}


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (eval_spec(source_kind="submitted"), "needs a finite prompt set"),
        (eval_spec(serve_adapter=True), "serve_adapter runs cannot be evaluated"),
        (eval_spec(version=-1), "eval.policy_version is -1"),
    ],
)
def test_evaluation_specs_that_cannot_work_are_refused(spec: RunSpec, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        spec.validate()


async def test_an_evaluation_run_cannot_push_weights() -> None:
    service, _, _ = wired_service(ScriptedEngine(hold=True))
    run = await service.create_run(eval_spec())
    with pytest.raises(FailedPrecondition, match="evaluation run, which never trains"):
        service.weights.for_push(run.run_id)
    await service.delete_run(run.run_id)


def test_the_eval_spec_survives_the_wire() -> None:
    pinned, current = eval_spec(version=5), eval_spec()
    assert run_spec_from_pb(run_spec_to_pb(pinned)).eval == EvalSpec(5)
    assert run_spec_from_pb(run_spec_to_pb(current)).eval == EvalSpec(None)
    plain = dataclasses.replace(current, eval=None)
    assert run_spec_from_pb(run_spec_to_pb(plain)).eval is None


async def test_holds_wait_for_every_holder_and_hand_overruns_over() -> None:
    overrun: list[list[str]] = []
    holds = VersionHolds(on_overrun=overrun.append)
    assert await holds.wait_released(1.0) == 0.0
    holds.hold("a", 1)
    holds.hold("b", 1)
    waiting = asyncio.ensure_future(holds.wait_released(5.0))
    holds.release("a")
    await asyncio.sleep(0)
    assert not waiting.done()
    holds.release("b")
    assert await asyncio.wait_for(waiting, 5) >= 0.0
    holds.hold("c", 2)
    await holds.wait_released(0.01)
    assert overrun == [["c"]] and holds.holders == {}
