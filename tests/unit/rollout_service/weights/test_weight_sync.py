"""Time accounting of the weight-update control plane, against scripted control endpoints
on a fake clock (the handshake itself is proven against real vLLM in the integration tests)."""

from __future__ import annotations

import asyncio

import pytest

from rollout_service.config import WeightSyncSettings
from rollout_service.edge.convert import update_times_to_pb
from rollout_service.engine.control import WeightSyncError
from rollout_service.errors import FailedPrecondition
from rollout_service.metrics import ServiceMetrics
from rollout_service.versions import PolicyVersion
from rollout_service.weights.weight_sync import WeightSyncCoordinator
from tests.support import listening_port, wait_until
from tests.unit.rollout_service.weights.scripted_control import TENSORS, Clock, ScriptedControl


def coordinator(server: ScriptedControl, clock: Clock, metrics: ServiceMetrics) -> WeightSyncCoordinator:
    settings = WeightSyncSettings(transfer_timeout_s=60, control_timeout_s=60)
    return WeightSyncCoordinator([server], settings, PolicyVersion(), metrics=metrics, clock=clock)


async def test_a_committed_update_records_its_phases_and_paused_seconds() -> None:
    clock, metrics = Clock(), ServiceMetrics()
    server = ScriptedControl(clock)
    sync = coordinator(server, clock, metrics)
    try:
        ticket = await sync.begin("run", "127.0.0.1", listening_port(), TENSORS, "keep")
        await asyncio.wait_for(server.received.wait(), 5)
        assert sync.paused_seconds() == pytest.approx(2 + 3 + 4)  # in progress: counted up to now
        assert await asyncio.wait_for(sync.commit(ticket.update_id), 5) == (1, pytest.approx(22))
    finally:
        await sync.close()
    times = sync.last_update
    assert times is not None and times.committed and times.update_id == ticket.update_id
    assert times.phases == {
        "join": 1.0,
        "pause": 2.0,
        "transfer": 7.0,
        "finish": 5.0,
        "resume": 7.0,
    }
    assert times.paused_seconds == pytest.approx(2 + 7 + 5 + 7)  # from the pause call to the resumed
    assert sync.paused_seconds() == pytest.approx(times.paused_seconds)
    sample = metrics.registry.get_sample_value
    assert sample("rollout_weight_update_paused_seconds_total") == pytest.approx(21)
    assert sample("rollout_weight_updates_total", {"outcome": "committed"}) == 1
    assert sample("rollout_weight_update_phase_seconds_sum", {"phase": "transfer"}) == 7.0
    assert sample("rollout_weight_update_phase_seconds_count", {"phase": "resume"}) == 1
    pb = update_times_to_pb(times)
    assert (pb.join_seconds, pb.transfer_seconds, pb.resume_seconds, pb.paused_seconds) == (1, 7, 7, 21)


async def test_the_paused_window_spans_a_pause_whose_call_runs_late(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a busy event loop the pause's call gets its turn milliseconds after its phase's clock
    starts. The paused window opens with that clock, so it still spans every phase it holds."""
    clock, metrics = Clock(), ServiceMetrics()
    server = ScriptedControl(clock)
    sync = coordinator(server, clock, metrics)
    pause = sync._steps._pause

    async def late_pause(*args: object) -> None:
        clock.now += 1.0  # the loop ran other callbacks first
        await pause(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(sync._steps, "_pause", late_pause)
    try:
        ticket = await sync.begin("run", "127.0.0.1", listening_port(), TENSORS, "keep")
        assert (await asyncio.wait_for(sync.commit(ticket.update_id), 5))[0] == 1
    finally:
        await sync.close()
    times = sync.last_update
    assert times is not None and times.phases["pause"] == pytest.approx(1 + 2)
    assert times.paused_seconds == pytest.approx(1 + 2 + 7 + 5 + 7)  # pause, transfer, finish, resume


async def test_an_update_without_pause_never_pauses_or_resumes_the_server() -> None:
    """pause_mode none: generation goes on while the weights change; nothing counts as paused."""
    clock, metrics = Clock(), ServiceMetrics()
    server = ScriptedControl(clock)
    sync = coordinator(server, clock, metrics)
    try:
        ticket = await sync.begin("run", "127.0.0.1", listening_port(), TENSORS, "none")
        assert await asyncio.wait_for(sync.commit(ticket.update_id), 5) == (1, pytest.approx(1 + 3 + 4 + 5))
        # vLLM's label of the weights is set after the commit, off its path: the commit's
        # seconds above hold nothing after the finish.
        await wait_until(lambda: server.labels == ["1"], 5, lambda: f"labels {server.labels}")
    finally:
        await sync.close()
    # No prefix-cache reset: requests are salted by version, and vLLM refuses it while
    # requests run.
    assert server.calls == ["init_weight_transfer", "start_weight_update", "update_weights", "finish_weight_update"]
    times = sync.last_update
    assert times is not None and times.committed and "pause" not in times.phases
    assert times.paused_seconds == 0 and sync.paused_seconds() == 0


async def test_a_resend_applies_the_weights_and_keeps_the_version() -> None:
    """The trainer sends the current version's weights again (a restarted server asked for
    them): vLLM gets the whole handshake, but neither the servers' nor the trainer's version
    moves, so groups sampled before are no staler than they were."""
    clock, metrics = Clock(), ServiceMetrics()
    server = ScriptedControl(clock)
    committed: list[int] = []
    trainer_versions: list[int] = []
    settings = WeightSyncSettings(transfer_timeout_s=60, control_timeout_s=60)
    versions = PolicyVersion(3)
    versions.watch(lambda change: trainer_versions.append(versions.trainer) if not change.committed else None)
    versions.watch(lambda change: committed.append(versions.served) if change.committed else None)
    sync = WeightSyncCoordinator([server], settings, versions, metrics=metrics, clock=clock)
    try:
        ticket = await sync.begin("run", "127.0.0.1", listening_port(), TENSORS, "keep", resend=True)
        assert ticket.policy_version == 3
        assert await asyncio.wait_for(sync.commit(ticket.update_id), 5) == (3, pytest.approx(1 + 2 + 7 + 5 + 7))
        ticket = await sync.begin("run", "127.0.0.1", listening_port(), TENSORS, "keep")  # the next step's push
        assert (await asyncio.wait_for(sync.commit(ticket.update_id), 5))[0] == 4
        await wait_until(lambda: server.labels == ["3", "4"], 5, lambda: f"labels {server.labels}")
    finally:
        await sync.close()
    assert server.calls.count("finish_weight_update") == 2  # the resend was applied too
    assert committed == [3, 4]  # the resend's commit says the servers hold version 3 (a held server goes)
    assert trainer_versions == [3, 4]  # a resend's begin leaves the trainer's version where it was
    assert (sync.updates_committed, sync.updates_resent, sync.version) == (1, 1, 4)
    sample = metrics.registry.get_sample_value
    assert sample("rollout_weight_updates_total", {"outcome": "resent"}) == 1
    assert sample("rollout_weight_updates_total", {"outcome": "committed"}) == 1


async def test_a_join_closes_an_update_a_dead_service_left_open() -> None:
    """After a server restart the next update is a join; a server that still has an update
    open (a service died between its transfer and its commit) has it closed first."""
    server = ScriptedControl(Clock())
    sync = WeightSyncCoordinator([server], WeightSyncSettings(), PolicyVersion())
    try:
        ticket = await sync.begin("run", "127.0.0.1", listening_port(), TENSORS, "none")
        await asyncio.wait_for(sync.commit(ticket.update_id), 5)
        sync.server_restarted()
        server.calls.clear()
        server.fail_once["start_weight_update"] = WeightSyncError(
            server.base_url, "/start_weight_update", "HTTP 500: weight update is already active"
        )
        ticket = await sync.begin("run", "127.0.0.1", listening_port(), TENSORS, "none")
        assert (await asyncio.wait_for(sync.commit(ticket.update_id), 5))[0] == 2
    finally:
        await sync.close()
    assert server.calls[:6] == [
        "init_weight_transfer",
        "start_weight_update",  # already active: the dead service's
        "finish_weight_update",
        "start_weight_update",
        "update_weights",
        "finish_weight_update",
    ]


async def test_an_aborted_update_counts_its_pause_too() -> None:
    clock, metrics = Clock(), ServiceMetrics()
    server = ScriptedControl(clock, fail="update_weights")  # the trainer died mid-broadcast
    sync = coordinator(server, clock, metrics)
    try:
        ticket = await sync.begin("run", "127.0.0.1", listening_port(), TENSORS, "keep")
        with pytest.raises(FailedPrecondition, match="aborted"):
            await asyncio.wait_for(sync.commit(ticket.update_id), 5)
    finally:
        await sync.close()
    times = sync.last_update
    assert times is not None and not times.committed
    assert "finish" not in times.phases and times.phases["transfer"] == 7.0
    assert times.paused_seconds == pytest.approx(2 + 7 + 7)  # pause, transfer, resume
    assert sync.updates_aborted == 1 and sync.paused_seconds() == pytest.approx(16)
    sample = metrics.registry.get_sample_value
    assert sample("rollout_weight_updates_total", {"outcome": "aborted"}) == 1
    assert sample("rollout_weight_update_paused_seconds_total") == pytest.approx(16)
    assert update_times_to_pb(times).finish_seconds == 0


async def test_a_failed_resume_is_retried_until_the_server_generates_again() -> None:
    """Logged and forgotten, a failed resume left the server paused for ever."""
    clock, metrics = Clock(), ServiceMetrics()
    server = ScriptedControl(clock, resume_failures=2)
    sync = coordinator(server, clock, metrics)
    try:
        ticket = await sync.begin("run", "127.0.0.1", listening_port(), TENSORS, "keep")
        await asyncio.wait_for(sync.commit(ticket.update_id), 5)
        assert server.resumes == 3 and not sync.repair.stuck_paused  # two failures, then resumed

        server.resume_failures = 5  # more than the retries: the background keeps trying
        ticket = await sync.begin("run", "127.0.0.1", listening_port(), TENSORS, "keep")
        await asyncio.wait_for(sync.commit(ticket.update_id), 5)
        assert sync.repair.stuck_paused == {server.base_url}
        await wait_until(lambda: not sync.repair.stuck_paused, 5, "the background resume")
        assert server.resume_failures == 0
    finally:
        await sync.close()


async def test_an_abort_whose_resume_raises_anything_ends_the_update() -> None:
    clock, metrics = Clock(), ServiceMetrics()
    server = ScriptedControl(clock, resume_failures=-1)
    server.resume_error = RuntimeError("unexpected")
    sync = coordinator(server, clock, metrics)
    try:
        ticket = await sync.begin("run", "127.0.0.1", listening_port(), TENSORS, "keep")
        await asyncio.wait_for(server.received.wait(), 5)
        await sync.abort(ticket.update_id, "trainer gave up")
        assert sync.updates_aborted == 1 and sync.repair.stuck_paused == {server.base_url}
        server.resume_failures = 0  # the server recovers; a new update may begin
        await wait_until(lambda: not sync.repair.stuck_paused, 5, "the background resume")
        ticket = await sync.begin("run", "127.0.0.1", listening_port(), TENSORS, "keep")
        # 28 s less the scripted prefix-cache reset's 6 s, which is off by default
        assert await asyncio.wait_for(sync.commit(ticket.update_id), 5) == (1, pytest.approx(28 - 6))
    finally:
        await sync.close()


async def test_servers_left_paused_by_a_dead_service_are_resumed_at_start() -> None:
    clock = Clock()
    left, running = ScriptedControl(clock), ScriptedControl(clock)
    left.paused, left.base_url = True, "http://left"
    settings = WeightSyncSettings()
    sync = WeightSyncCoordinator([left, running], settings, PolicyVersion())
    try:
        assert await sync.repair.resume_left_paused() == ["http://left"]
        assert not left.paused and running.resumes == 0
    finally:
        await sync.close()


async def test_a_transfer_group_a_dead_service_left_open_is_released_at_start() -> None:
    """Its trainer's broadcast waits on that group. On gloo a leave-only init drops the group
    and anything received, then an update left open is finished (applying nothing); a server
    with none open says so, one that cannot answer is skipped. Other backends get vLLM's own
    release."""
    clock = Clock()
    idle, mid_update, down = ScriptedControl(clock), ScriptedControl(clock), ScriptedControl(clock)
    idle.base_url, mid_update.base_url, down.base_url = "http://idle", "http://mid-update", "http://down"
    idle.fail_once["finish_weight_update"] = WeightSyncError(
        idle.base_url, "/finish_weight_update",
        "HTTP 500: finish_weight_update called without a matching start_weight_update.",
    )  # fmt: skip
    down.fail = "init_weight_transfer"
    sync = WeightSyncCoordinator([idle, mid_update, down], WeightSyncSettings(), PolicyVersion())
    try:
        assert await sync.repair.release_left_transfer() == ["http://idle", "http://mid-update"]
    finally:
        await sync.close()
    assert idle.calls == mid_update.calls == ["init_weight_transfer", "finish_weight_update"]
    assert down.calls == ["init_weight_transfer"]

    just_started = ScriptedControl(clock)
    just_started.base_url = "http://just-started"
    sync = WeightSyncCoordinator([just_started, idle], WeightSyncSettings(), PolicyVersion())
    try:  # a server the service started itself holds nothing to release
        assert await sync.repair.release_left_transfer(skip=frozenset(["http://just-started"])) == ["http://idle"]
    finally:
        await sync.close()
    assert just_started.calls == []

    nccl_server = ScriptedControl(clock)
    sync = WeightSyncCoordinator([nccl_server], WeightSyncSettings(backend="nccl"), PolicyVersion())
    try:
        assert await sync.repair.release_left_transfer() == [nccl_server.base_url]
    finally:
        await sync.close()
    assert nccl_server.calls == ["shutdown_weight_transfer"]


async def test_an_update_without_pause_is_refused_where_the_engine_reloads_from_start() -> None:
    clock = Clock()
    server = ScriptedControl(clock)
    sync = WeightSyncCoordinator([server], WeightSyncSettings(backend="nccl"), PolicyVersion())
    try:
        with pytest.raises(FailedPrecondition, match="generation must pause"):
            await sync.begin("run", "127.0.0.1", listening_port(), TENSORS, "none")
        assert server.calls == []
    finally:
        await sync.close()


class SlowFirstLabel(ScriptedControl):
    """The first label's call hangs until ``gate`` is set, as a slow HTTP request would."""

    def __init__(self, clock: Clock) -> None:
        super().__init__(clock)
        self.gate = asyncio.Event()

    async def set_weight_version(self, version: str, timeout_s: float) -> None:
        if not self.labels and version == "1":
            await self.gate.wait()
        await super().set_weight_version(version, timeout_s)


async def test_labels_land_in_the_order_of_their_commits() -> None:
    """A slow label of version 1 is not overtaken by version 2's: vLLM's /weight_info
    ends on the version it serves."""
    clock, metrics = Clock(), ServiceMetrics()
    server = SlowFirstLabel(clock)
    sync = coordinator(server, clock, metrics)
    try:
        for expected in (1, 2):
            ticket = await sync.begin("run", "127.0.0.1", listening_port(), TENSORS, "none")
            assert (await asyncio.wait_for(sync.commit(ticket.update_id), 5))[0] == expected
        server.gate.set()
        await wait_until(lambda: len(server.labels) == 2, 5, lambda: f"labels {server.labels}")
    finally:
        await sync.close()
    assert server.labels == ["1", "2"]


class SlowTransfer(ScriptedControl):
    """A transfer that takes real time (a large model), during which nothing else happens."""

    transfer_s = 1.5

    async def update_weights(self, info, timeout_s: float) -> None:  # type: ignore[no-untyped-def]
        await asyncio.sleep(self.transfer_s)  # stands for a long broadcast
        await super().update_weights(info, timeout_s)


async def test_the_watchdog_counts_from_the_last_progress_not_from_begin() -> None:
    """Limit 2 s; the transfer takes 1.5 s and the trainer commits 1 s after it: 2.5 s after
    begin, which a watchdog counting from begin would have aborted."""
    clock = Clock()
    server = SlowTransfer(clock)
    settings = WeightSyncSettings(transfer_timeout_s=1.0, control_timeout_s=0.5)
    sync = WeightSyncCoordinator([server], settings, PolicyVersion(), clock=clock)
    try:
        ticket = await sync.begin("run", "127.0.0.1", listening_port(), TENSORS, "keep")
        await asyncio.wait_for(server.received.wait(), 5)
        await asyncio.sleep(1.0)  # the trainer takes its time to commit, within the limit
        version, _ = await asyncio.wait_for(sync.commit(ticket.update_id), 5)
        assert version == 1 and sync.updates_aborted == 0

        server.transfer_s = 0.0  # and an update that stalls after its transfer is still aborted
        ticket = await sync.begin("run", "127.0.0.1", listening_port(), TENSORS, "keep")
        await asyncio.wait_for(server.received.wait(), 5)
        await wait_until(lambda: sync.updates_aborted == 1, 10, "the watchdog to abort the stalled update")
        assert "no progress for 2s after transfer" in (sync._last_aborted.aborted or "")
    finally:
        await sync.close()


async def test_a_first_update_closes_one_a_dead_service_left_open_in_vllm() -> None:
    """Killed between a transfer and its commit, a service leaves vLLM's update active; the
    next service's first update (a join) finishes it, which applies nothing, and starts its own."""
    clock, metrics = Clock(), ServiceMetrics()
    server = ScriptedControl(clock)
    server.fail_once["start_weight_update"] = WeightSyncError(
        server.base_url, "/start_weight_update", "HTTP 500: weight update is already active"
    )
    sync = coordinator(server, clock, metrics)
    try:
        ticket = await sync.begin("run", "127.0.0.1", listening_port(), TENSORS, "none")
        await asyncio.wait_for(server.received.wait(), 5)
        assert (await asyncio.wait_for(sync.commit(ticket.update_id), 5))[0] == 1
    finally:
        await sync.close()
    assert server.calls[:5] == [
        "init_weight_transfer",
        "start_weight_update",
        "finish_weight_update",  # closes the dead service's update
        "start_weight_update",
        "update_weights",
    ]


class EngineBusyControl(ScriptedControl):
    """vLLM's engine runs one control call at a time, and a call the service stops waiting
    for goes on there: the join hangs (no trainer listens) until ``join_ends`` is set, and
    every later call waits for it, as behind the engine core's queue."""

    def __init__(self, clock: Clock) -> None:
        super().__init__(clock)
        self.join_ends = asyncio.Event()
        self.joins = 0

    async def init_weight_transfer(self, info, timeout_s: float) -> None:  # type: ignore[no-untyped-def]
        if not info.get("leave"):
            self.joins += 1
            if self.joins == 1:
                await self.join_ends.wait()  # cancelling the service's wait does not end vLLM's
        await self.join_ends.wait()
        await super().init_weight_transfer(info, timeout_s)


async def test_an_update_aborted_mid_join_holds_the_busy_server_until_vllm_lets_go() -> None:
    clock = Clock()
    server = EngineBusyControl(clock)
    stuck: list[tuple[str, str | None]] = []
    settings = WeightSyncSettings(transfer_timeout_s=60, control_timeout_s=60, join_timeout_s=5)
    sync = WeightSyncCoordinator(
        [server], settings, PolicyVersion(), clock=clock, on_stuck=lambda url, why: stuck.append((url, why))
    )
    try:
        ticket = await sync.begin("run", "127.0.0.1", listening_port(), TENSORS, "none")
        await wait_until(lambda: server.joins == 1, 5, "the join to reach vLLM")
        assert await asyncio.wait_for(sync.abort(ticket.update_id, "trainer gone"), 5) == 0  # answers at once
        ((url, why),) = stuck
        assert url == server.base_url and "join of aborted weight update" in str(why)
        assert "weight_sync.join_timeout_s" in str(why)

        # A begin now waits for the server instead of queueing a second join behind the first.
        second = asyncio.ensure_future(sync.begin("run", "127.0.0.1", listening_port(), TENSORS, "none"))
        done, _ = await asyncio.wait({second}, timeout=0.1)
        assert not done and server.joins == 1
        server.join_ends.set()  # vLLM's join gave up (join_timeout_s): the leave behind it answers
        ticket = await asyncio.wait_for(second, 5)
        assert stuck[-1] == (server.base_url, None)  # routable again
        await asyncio.wait_for(server.received.wait(), 5)
        assert (await asyncio.wait_for(sync.commit(ticket.update_id), 5))[0] == 1
    finally:
        await sync.close()


async def test_a_begin_is_refused_while_a_server_stays_busy_with_an_aborted_call() -> None:
    clock = Clock()
    server = EngineBusyControl(clock)
    settings = WeightSyncSettings(transfer_timeout_s=60, control_timeout_s=0.05, join_timeout_s=5)
    sync = WeightSyncCoordinator([server], settings, PolicyVersion(), clock=clock)
    try:
        ticket = await sync.begin("run", "127.0.0.1", listening_port(), TENSORS, "none")
        await wait_until(lambda: server.joins == 1, 5, "the join to reach vLLM")
        await sync.abort(ticket.update_id, "trainer gone")
        with pytest.raises(FailedPrecondition, match="still run a call of an aborted weight update"):
            await asyncio.wait_for(sync.begin("run", "127.0.0.1", listening_port(), TENSORS, "none"), 5)
        assert server.joins == 1
    finally:
        server.join_ends.set()
        await sync.close()


async def test_an_answered_failure_leaves_no_server_busy() -> None:
    """A join vLLM answered with an error is over there: nothing to free, nothing held."""
    clock = Clock()
    server = ScriptedControl(clock, fail="init_weight_transfer")
    stuck: list[tuple[str, str | None]] = []
    settings = WeightSyncSettings(transfer_timeout_s=60, control_timeout_s=60)
    sync = WeightSyncCoordinator(
        [server], settings, PolicyVersion(), clock=clock, on_stuck=lambda url, why: stuck.append((url, why))
    )
    server.fail_once["init_weight_transfer"] = WeightSyncError(server.base_url, "/init", "HTTP 500", answered=True)
    try:
        ticket = await sync.begin("run", "127.0.0.1", listening_port(), TENSORS, "none")
        with pytest.raises(FailedPrecondition, match="aborted"):
            await asyncio.wait_for(sync.commit(ticket.update_id), 5)
        assert not stuck
    finally:
        await sync.close()


async def test_a_trainer_without_a_group_is_joined_at_the_last_groups_address_and_port() -> None:
    """A trainer restarted on its fixed ``--vllm_group_port`` comes back at the same address
    and port as the group the servers hold, but without that group: it says so, and the
    servers join a fresh one; a trainer that holds its group is not joined again."""
    server = ScriptedControl(Clock())
    sync = WeightSyncCoordinator([server], WeightSyncSettings(), PolicyVersion())
    port = listening_port()
    joins = []
    try:
        for join in (False, False, True):
            ticket = await sync.begin("run", "127.0.0.1", port, TENSORS, "none", join=join)
            joins.append(ticket.join_group)
            await asyncio.wait_for(sync.commit(ticket.update_id), 5)
    finally:
        await sync.close()
    assert joins == [True, False, True]
    assert server.calls.count("init_weight_transfer") == 2
