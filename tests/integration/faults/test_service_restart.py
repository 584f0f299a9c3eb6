"""The service is SIGKILLed mid-run, with groups buffered and leased, and started again on
the same SQLite state store and port: the trainer process reconnects and finishes its
steps, no group is lost, none is trained twice, and the policy versions go on."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pickle
import signal
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollout_api.client import RolloutClient
from rollout_common.ports import free_port
from tests.integration.conftest import restore_base_weights, serving
from tests.integration.faults.test_service_killed_mid_update import service_process
from tests.integration.test_shared_capacity import groups_per_step, kill_if_running, records, start, trainer_command
from tests.support import wait_until

pytestmark = pytest.mark.integration

STEPS, GROUPS_PER_STEP = 60, 2


@contextlib.contextmanager
def durable_service(vllm_url: str, tiny_model: Path, port: int, store: Path, log: Path) -> Iterator[subprocess.Popen]:
    """``rollout-service serve --state-store`` on the session's vLLM server and a fixed port."""
    with service_process(vllm_url, tiny_model, log, port, "--state-store", str(store)) as (_, process):
        yield process


def stored(store: Path) -> tuple[set[str], set[str], int]:
    """What the store holds: unacked group ids, acked ids, the servers' policy version."""
    db = sqlite3.connect(store)
    try:
        unacked = {row[0] for row in db.execute("SELECT group_id FROM groups")}
        acked = {row[0] for row in db.execute("SELECT group_id FROM acked")}
        row = db.execute("SELECT value FROM meta WHERE key = 'policy_version'").fetchone()
        return unacked, acked, pickle.loads(row[0]) if row else 0
    finally:
        db.close()


def tails(directory: Path, chars: int = 3000) -> str:
    """The ends of the trainer's and both services' logs, for a failure's message."""
    return "\n".join(
        f"--- {name}:\n{(directory / name).read_text(errors='replace')[-chars:]}"
        for name in ("trainer.log", "first.log", "second.log")
        if (directory / name).exists()
    )


@pytest.mark.timeout(600)
async def test_a_service_killed_mid_run_restarts_on_its_store_and_the_trainer_goes_on(
    vllm_server, tiny_model: Path, tmp_path: Path
) -> None:
    store, port = tmp_path / "state.db", free_port()
    target = f"127.0.0.1:{port}"
    out = tmp_path / "trainer"
    options = (*groups_per_step(GROUPS_PER_STEP), "--max-steps", str(STEPS), "--max-buffered-groups", "6")
    with durable_service(vllm_server.url, tiny_model, port, store, tmp_path / "first.log") as first:
        await wait_until(lambda: serving(target), 60, "the first service to serve")
        trainer = await start(trainer_command(target, tiny_model, out, *options), tmp_path / "trainer.log")
        try:
            async with RolloutClient(target) as client:

                async def mid_run() -> bool:
                    """A few groups trained, some held (buffered or leased), and most of the run
                    still to go: on a quiet machine the tiny model trains 7 steps/s, and a
                    moment with a full buffer came only once the trainer had finished."""
                    assert trainer.returncode is None, "the trainer finished before the service could be killed"
                    runs = await client.list_runs()
                    stats = runs[0].stats if runs else None
                    return (
                        stats is not None
                        and 4 <= stats.groups_trained <= STEPS * GROUPS_PER_STEP // 2
                        and stats.groups_buffered + stats.groups_leased >= 1
                    )

                await wait_until(mid_run, 120, "the trainer to train a few groups with more buffered")
                # Frozen, the trainer acks nothing more: the groups held now are still unacked at
                # the kill. (Between a check and a kill a running trainer could ack them all.)
                os.kill(trainer.pid, signal.SIGSTOP)

                async def holds_groups() -> bool:
                    stats = (await client.list_runs())[0].stats
                    return stats.groups_buffered + stats.groups_leased >= 1

                await wait_until(holds_groups, 60, "groups buffered or leased while the trainer is stopped")
                run_id = (await client.list_runs())[0].run_id
            os.killpg(first.pid, signal.SIGKILL)
            await asyncio.to_thread(first.wait, 30)
            os.kill(trainer.pid, signal.SIGCONT)  # it finds the service gone, and reconnects
            unacked_at_kill, acked_at_kill, version_at_kill = stored(store)
            assert unacked_at_kill and acked_at_kill and version_at_kill >= 1

            with durable_service(vllm_server.url, tiny_model, port, store, tmp_path / "second.log"):
                try:
                    try:  # it reconnects to the restarted service
                        await asyncio.wait_for(trainer.wait(), 300)
                    except TimeoutError:
                        raise AssertionError(f"the trainer did not finish:\n{tails(tmp_path)}") from None
                    assert trainer.returncode == 0, tails(tmp_path)
                    assert "reconnected to" in (tmp_path / "trainer.log").read_text()
                    summary = json.loads((out / "summary.json").read_text())
                    assert summary["run_id"] == run_id  # the same run, restored
                    trained = json.loads((out / "rank0.json").read_text())["trained_group_ids"]
                    assert len(trained) == len(set(trained)) == STEPS * GROUPS_PER_STEP  # none twice
                    unacked_now, acked_now, version_now = stored(store)
                    # No group lost: every group that was unacked at the kill was trained, or acked
                    # (dropped as stale), or is still buffered.
                    assert unacked_at_kill <= set(trained) | acked_now | unacked_now
                    versions = [r["policy_version"] for r in records(out / "metrics.jsonl")]
                    assert versions == sorted(versions) and version_now > version_at_kill  # pushes went on
                    async with RolloutClient(target) as client:
                        assert (await client.get_run(run_id)).policy_version == version_now
                finally:  # pass or fail, the tests after this one sample from the base weights
                    kill_if_running(trainer)
                    async with RolloutClient(target) as client:
                        await restore_base_weights(client, run_id, tiny_model)
        finally:
            kill_if_running(trainer)
