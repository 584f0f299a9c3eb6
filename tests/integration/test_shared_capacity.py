"""Shared rollout capacity: runs share slots by weight, consumers that die lose nothing,
and staleness-aware admission keeps generation from outrunning training."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from pathlib import Path

import grpc
import pytest

from rollout_api import rollout_pb2 as pb
from rollout_api.client import RolloutClient, dataset_run_spec
from rollout_common.tiny_model import tiny_model_flags
from tests.integration.conftest import restore_base_weights, serving
from tests.support import wait_until

pytestmark = pytest.mark.integration


async def consume(client: RolloutClient, run_id: str, consumer_id: str) -> None:
    """A consumer that acks every group at once, until cancelled."""
    stream = client.stream(run_id, consumer_id, credits=8)
    try:
        async for group in stream:
            stream.ack([group.group_id])
    finally:
        await stream.aclose()


async def slot_seconds(client: RolloutClient, *run_ids: str) -> list[float]:
    runs = (await client.stats()).runs
    return [runs[run_id].slot_seconds for run_id in run_ids]


async def scored(client: RolloutClient, run_id: str) -> int:
    return (await client.get_run(run_id)).stats.groups_scored


async def test_runs_share_slots_by_weight_and_a_stalled_run_does_not_stall_the_other(client: RolloutClient) -> None:
    def spec(weight: float, buffer: int) -> pb.RunSpec:
        # Runs with live consumers must always wait for slots, never for room: a deep buffer (no
        # push happens, so admission bounds nothing else).
        return dataset_run_spec("letters", {"char_fraction": 1.0}, group_size=2, max_tokens=16, weight=weight,
                                max_buffered_groups=buffer)  # fmt: skip

    heavy, light = await client.create_run(spec(3, 1000)), await client.create_run(spec(1, 64))
    consumers = {run.run_id: asyncio.ensure_future(consume(client, run.run_id, "c")) for run in (heavy, light)}
    try:
        # Warm up, then measure each run's slot-seconds over a steady window.
        await wait_until(lambda: _at_least(client, light.run_id, 4), 120, "both runs to produce")
        before = await slot_seconds(client, heavy.run_id, light.run_id)
        target = await scored(client, heavy.run_id) + 150
        await wait_until(lambda: _at_least(client, heavy.run_id, target), 180, "a steady window")
        after = await slot_seconds(client, heavy.run_id, light.run_id)
        used = [a - b for a, b in zip(after, before, strict=True)]
        share = used[0] / sum(used)
        assert share == pytest.approx(0.75, rel=0.10), f"weight 3:1 gave the heavy run {share:.3f} of the slots"

        # The light run's consumer stops: its buffer fills and it stops taking slots, and
        # the heavy run goes on with (nearly) all of them.
        consumers.pop(light.run_id).cancel()
        await wait_until(lambda: _buffer_full(client, light.run_id), 120, "the stalled run's buffer to fill")
        before = await slot_seconds(client, heavy.run_id, light.run_id)
        target = await scored(client, heavy.run_id) + 30
        await wait_until(lambda: _at_least(client, heavy.run_id, target), 120, "the heavy run to go on")
        after = await slot_seconds(client, heavy.run_id, light.run_id)
        used = [a - b for a, b in zip(after, before, strict=True)]
        assert used[0] / sum(used) > 0.95
    finally:
        for task in consumers.values():
            task.cancel()
        await asyncio.gather(*consumers.values(), return_exceptions=True)
        for run in (heavy, light):
            await client.delete_run(run.run_id)


async def _at_least(client: RolloutClient, run_id: str, groups: int) -> bool:
    return await scored(client, run_id) >= groups


async def _buffer_full(client: RolloutClient, run_id: str) -> bool:
    run = await client.get_run(run_id)
    return run.stats.groups_buffered >= run.max_buffered_groups and run.stats.slots_busy == 0


TRAINER_GROUP_SIZE = 4
"""The group size ``trainer_command`` trains with."""


def groups_per_step(groups: int) -> tuple[str, str]:
    """``trainer_command``'s flags for a step of ``groups`` groups."""
    return ("--per-device-train-batch-size", str(TRAINER_GROUP_SIZE * groups))


def trainer_command(target: str, model: Path, out: Path, *options: str) -> list[str]:
    command = [sys.executable, "-m", "trainer_client.cli", "--target", target, "--model", str(model)]
    command += tiny_model_flags(num_generations=TRAINER_GROUP_SIZE, max_completion_length=16, output_dir=out)
    command += options
    # One thread, unpinned: the session's vLLM is unpinned too (conftest), so pinning the
    # trainer to "its" core would only crowd it under the suite's load.
    command += ["--torch-threads", "1"]
    return command


async def start(command: list[str], log: Path, env: dict[str, str] | None = None) -> asyncio.subprocess.Process:
    with log.open("wb") as out:
        return await asyncio.create_subprocess_exec(*command, stdout=out, stderr=out, start_new_session=True, env=env)


def kill_if_running(trainer: asyncio.subprocess.Process) -> None:
    """Cleanup for a trainer ``start`` made: SIGKILL its process group unless it has exited."""
    if trainer.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(trainer.pid, signal.SIGKILL)


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


async def test_a_killed_trainer_loses_no_group_and_none_is_trained_twice(
    service_process: str, tiny_model: Path, tmp_path: Path
) -> None:
    """Two trainer processes on one run; the second is SIGKILLed while it holds leases."""
    await wait_until(lambda: serving(service_process), 60, "the service process to serve")
    async with RolloutClient(service_process) as client:
        spec = dataset_run_spec("letters", {"char_fraction": 1.0}, group_size=4, max_tokens=16, max_staleness=2,
                                max_buffered_groups=4)  # fmt: skip
        run_id = (await client.create_run(spec)).run_id
        common = ("--run-id", run_id, *groups_per_step(2), "--max-staleness", "2")
        main = await start(
            trainer_command(service_process, tiny_model, tmp_path / "main", *common, "--max-steps", "10"),
            tmp_path / "main.log",
        )
        doomed = await start(
            trainer_command(service_process, tiny_model, tmp_path / "doomed", *common, "--max-steps", "1000",
                            "--no-push"),
            tmp_path / "doomed.log",
        )  # fmt: skip
        try:
            await wait_until(lambda: _trained_steps(tmp_path / "doomed", 2), 180, "the second trainer to train")
            os.killpg(doomed.pid, signal.SIGKILL)
            await asyncio.wait_for(doomed.wait(), 30)
            await asyncio.wait_for(main.wait(), 300)
        finally:
            for process in (main, doomed):
                if process.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(process.pid, signal.SIGKILL)
        assert main.returncode == 0, (tmp_path / "main.log").read_text()[-3000:]

        stats = (await client.get_run(run_id)).stats
        main_ids = json.loads((tmp_path / "main" / "rank0.json").read_text())["trained_group_ids"]
        doomed_ids = [i for r in records(tmp_path / "doomed" / "metrics.jsonl") for i in r["group_ids"]]
        assert len(set(main_ids)) == len(main_ids) == 20 and len(set(doomed_ids)) == len(doomed_ids) >= 4
        assert not set(main_ids) & set(doomed_ids)  # no group trained twice
        # The killed trainer's stream broke; any unacked groups went back to the run (whether
        # it held one at the kill is timing; test_api_errors covers the return itself), and
        # nothing is lost: every scored group is trained, dropped as stale, or still held.
        doomed_acked = stats.groups_trained - len(main_ids)
        assert len(doomed_ids) <= doomed_acked <= len(doomed_ids) + 2  # at most its last step unrecorded
        assert stats.groups_leased == 0
        assert stats.groups_scored == stats.groups_trained + stats.groups_dropped_stale + stats.groups_buffered
        await restore_base_weights(client, run_id, tiny_model)


async def _trained_steps(out: Path, steps: int) -> bool:
    return len(await asyncio.to_thread(records, out / "metrics.jsonl")) >= steps


async def test_admission_keeps_stale_drops_within_one_step(
    service_process: str, tiny_model: Path, tmp_path: Path
) -> None:
    """A real trainer with max_staleness 1: admission lets through only what it trains in time."""
    await wait_until(lambda: serving(service_process), 60, "the service process to serve")
    out = tmp_path / "train"
    options = ("--max-steps", "12", *groups_per_step(4), "--max-staleness", "1")
    options += ("--max-buffered-groups", "8")
    trainer = await start(trainer_command(service_process, tiny_model, out, *options), tmp_path / "trainer.log")
    try:
        await asyncio.wait_for(trainer.wait(), 300)
    finally:
        kill_if_running(trainer)
    assert trainer.returncode == 0, (tmp_path / "trainer.log").read_text()[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    async with RolloutClient(service_process) as client:
        stats = (await client.get_run(summary["run_id"])).stats
        assert stats.groups_trained == 48
        # At most one step's worth (4 of about 60). Zero in most runs; in about 1 full-suite run in 10
        # one step's groups went stale at once (their step's records show the fresh groups trained at
        # staleness 0 beside them). The likely cause, not yet proven: under the suite's load, groups of
        # one version finish behind the next one's (issue 16: oldest-first admission). A broken
        # admission drops far more (counting drops into C once dropped 32 of 91).
        assert stats.groups_dropped_stale <= 4, stats
        assert stats.groups_per_version == pytest.approx(4, abs=1)  # admission learned the consumption rate
        await restore_base_weights(client, summary["run_id"], tiny_model)


async def test_a_lease_that_times_out_goes_to_another_consumer(client: RolloutClient) -> None:
    spec = dataset_run_spec("letters", {"char_fraction": 1.0}, group_size=2, max_tokens=4, lease_timeout_seconds=1.0,
                            max_buffered_groups=1)  # fmt: skip
    run = await client.create_run(spec)
    hung, healthy = client.stream(run.run_id, "hung", credits=1), client.stream(run.run_id, "healthy", credits=1)
    try:
        async with asyncio.timeout(60):
            held = await anext(aiter(hung))  # taken, never acked in time
            async for redelivered in healthy:  # fresh groups, until the held one's lease expires
                healthy.ack([redelivered.group_id])
                if redelivered.group_id == held.group_id:
                    break
        hung.ack([held.group_id])  # too late: refused, and the stream says why
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async with asyncio.timeout(30):
                await anext(aiter(hung))
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "expired" in info.value.details()
        stats = (await client.get_run(run.run_id)).stats
        assert stats.leases_expired >= 1 and stats.groups_trained >= 1
    finally:
        await hung.aclose()
        await healthy.aclose()
        await client.delete_run(run.run_id)
