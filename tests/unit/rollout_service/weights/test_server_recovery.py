"""A restarted vLLM server takes no request until it holds the runs' policy, and the run's
trainer is asked for its weights over its stream (once per request)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from rollout_service.config import EngineSettings, WeightSyncSettings
from rollout_service.delivery.consumer import ConsumerSession, WeightsWanted
from rollout_service.engine.control import WeightControl, WeightSyncError
from rollout_service.engine.pool import EnginePool
from rollout_service.engine.vllm_client import VLLMServerClient
from rollout_service.metrics import ServiceMetrics
from rollout_service.runs import RunTable
from rollout_service.versions import PolicyVersion
from rollout_service.weights.push_routes import PushRoutes
from rollout_service.weights.server_recovery import ServerRecovery
from rollout_service.weights.weight_sync import WeightSyncCoordinator
from tests.unit.rollout_service.builders import one_prompt_spec as spec
from tests.unit.rollout_service.weights.recovery_setup import commit
from tests.unit.scripted import ScriptedEngine, make_service

URL = "http://s0"


def recovery_on_one_server(sync_servers: Sequence[WeightControl] = ()):  # type: ignore[no-untyped-def]
    """As the app builds it; with a weight sync over ``sync_servers``, if any."""
    runs, versions = RunTable(), PolicyVersion()
    sync = WeightSyncCoordinator(sync_servers, WeightSyncSettings(), versions) if sync_servers else None
    weights = PushRoutes(runs, weight_sync=sync)
    service = make_service(ScriptedEngine(), runs=runs, versions=versions, weights=weights)
    client = VLLMServerClient(URL, "m", EngineSettings(urls=[URL]), ServiceMetrics(), max_connections=1)
    pool = EnginePool([client])
    return service, pool, ServerRecovery(weights, pool, versions)


async def next_message(session: ConsumerSession):  # type: ignore[no-untyped-def]
    return await asyncio.wait_for(session.next_message(), 5)


async def test_before_any_push_a_restarted_server_serves_at_once() -> None:
    """Policy version 0 is the checkpoint the server reloads: nothing to wait for."""
    _service, pool, recovery = recovery_on_one_server()
    recovery.server_down(URL)
    assert URL in pool.held
    await recovery.server_restarted(URL)
    assert not pool.held


async def test_after_a_push_it_waits_for_the_next_one_which_the_trainer_is_asked_for() -> None:
    service, pool, recovery = recovery_on_one_server()
    run = await service.create_run(spec())
    service.weights.base_weights_run = run.run_id  # its trainer pushes the base weights
    commit(service, 3)
    run.broker.subscribe("trainer", 0)  # no credits: only control messages can come
    session = ConsumerSession(service, run.run_id, "trainer", 0)
    run.admission.watch(session.wake)
    waiting = asyncio.ensure_future(session.next_message())

    recovery.server_down(URL)
    await recovery.server_restarted(URL)
    assert "restarted with the checkpoint's weights" in pool.held[URL]
    message = await asyncio.wait_for(waiting, 5)  # the waiting stream was woken
    assert isinstance(message, WeightsWanted)
    assert message.policy_version == 3
    assert "policy version 3 is pushed" in message.reason

    late = ConsumerSession(service, run.run_id, "late", 0)  # subscribes before the push commits
    assert isinstance(await next_message(late), WeightsWanted)
    again = asyncio.ensure_future(session.next_message())
    done, _ = await asyncio.wait({again}, timeout=0.2)  # bounded: one message per request
    assert not done

    commit(service, 4)  # the push answered: the restarted server holds version 4
    assert not pool.held
    assert run.policy_version == 4 and not run.admission.weights_wanted
    after = ConsumerSession(service, run.run_id, "after", 0)
    first = asyncio.ensure_future(after.next_message())
    done, _ = await asyncio.wait({first}, timeout=0.2)
    assert not done  # nothing is wanted any more
    for task in (again, first):
        task.cancel()
    await service.delete_run(run.run_id)


async def test_without_a_pushing_run_the_server_waits_for_the_next_push() -> None:
    service, pool, recovery = recovery_on_one_server()
    commit(service, 2)
    recovery.server_down(URL)
    await recovery.server_restarted(URL)
    assert URL in pool.held
    commit(service, 3)
    assert not pool.held


async def test_a_resend_of_the_current_version_brings_the_server_back_at_that_version() -> None:
    """The trainer's weights had not changed since version 3: it sends them again, and the
    commit says version 3 once more. The server takes requests, the request is answered
    (no stream sends it again), and the run's version stays."""
    service, pool, recovery = recovery_on_one_server()
    run = await service.create_run(spec())
    service.weights.base_weights_run = run.run_id
    commit(service, 3)
    recovery.server_down(URL)
    await recovery.server_restarted(URL)
    assert run.admission.weights_wanted

    commit(service, 3)  # the resend committed
    assert not pool.held
    assert run.policy_version == 3 and run.admission.trainer_version == 3
    assert not run.admission.weights_wanted
    late = ConsumerSession(service, run.run_id, "late", 0)
    first = asyncio.ensure_future(late.next_message())
    done, _ = await asyncio.wait({first}, timeout=0.2)
    assert not done  # nothing is wanted any more
    first.cancel()
    await service.delete_run(run.run_id)


class LabelledControl:
    """The one control call start-up makes: the label of the weights a server serves."""

    base_url = URL

    def __init__(self, label: str | None) -> None:
        self.label = label

    async def weight_version(self, timeout_s: float) -> str:
        if self.label is None:
            raise WeightSyncError(URL, "/weight_info", "connection refused")
        return self.label


async def restarted_at(version: int, label: str | None):  # type: ignore[no-untyped-def]
    """A service restored at policy version ``version`` (a run pushes its base weights) over
    one server whose weights are labelled ``label`` (None: it does not answer)."""
    service, pool, recovery = recovery_on_one_server([LabelledControl(label)])
    recovery.hold_until_checked()
    run = await service.create_run(spec())
    service.set_policy_version(version)
    service.weights.base_weights_run = run.run_id
    await recovery.check_restored(timeout_s=1)
    return service, pool, recovery, run


@pytest.mark.parametrize("label", ["default", "11", None])
async def test_a_restored_service_holds_a_server_that_does_not_serve_the_restored_version(label) -> None:
    """A fresh managed server (labelled "default"), one an older commit labelled, or one that
    cannot say: none takes a request under version 12 until version 12 is pushed, asked for now."""
    service, pool, _recovery, run = await restarted_at(12, label)
    assert "policy version 12 is pushed" in pool.held[URL]
    assert run.admission.weights_requests == 1 and run.admission.weights_wanted
    commit(service, 12)  # the trainer's resend committed
    assert not pool.held and not run.admission.weights_wanted
    await service.delete_run(run.run_id)


async def test_a_restored_service_routes_to_a_server_labelled_with_the_restored_version() -> None:
    service, pool, _recovery, run = await restarted_at(12, "12")
    assert not pool.held and run.admission.weights_requests == 0
    await service.delete_run(run.run_id)


async def test_before_any_push_the_checkpoint_is_the_policy_whatever_the_label() -> None:
    service, pool, _recovery, run = await restarted_at(0, "default")
    assert not pool.held and run.admission.weights_requests == 0
    await service.delete_run(run.run_id)
