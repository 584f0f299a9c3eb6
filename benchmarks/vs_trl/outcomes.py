"""A run's curve and what the benchmark reads off it: time and steps to the target reward.

Why a module of its own: these are the numbers the speed issue is judged by (time to target,
steps to target against TRL's, steps/s, the trainer's idle fraction), so they are computed in
one place, without a service or a trainer, and tested (``tests/unit/benchmarks/test_bench_vs_trl.py``).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

ROLLING = 5
"""Steps in the rolling mean that must reach the target."""


@dataclass
class RunResult:
    contender: str
    seed: int
    wall_s: list[float]
    """Seconds since the start of training at the end of each step."""
    rewards: list[float]
    idle_fraction: float
    generated_tokens: int
    steady_idle_fraction: float
    """The idle fraction after the first step, whose wait is the first generation on either side
    (the steady state that the trainer's own time split, and the speed issue's target, speak of)."""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def steps(self) -> int:
        return len(self.rewards)

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.wall_s[-1] if self.wall_s else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s[-1] if self.wall_s else 0.0

    def to_target(self, target: float) -> tuple[float, int] | None:
        """(wall seconds, steps) when the rolling mean of ``ROLLING`` steps first reaches ``target``."""
        for i in range(ROLLING - 1, len(self.rewards)):
            if statistics.fmean(self.rewards[i - ROLLING + 1 : i + 1]) >= target:
                return self.wall_s[i], i + 1
        return None


def steady_fraction(idle_s: list[float], wall_s: list[float]) -> float:
    """Idle seconds over wall seconds of every step after the first (``wall_s`` cumulative)."""
    if len(wall_s) < 2:
        return float("nan")
    return sum(idle_s[1:]) / (wall_s[-1] - wall_s[0])


def summarize(results: list[RunResult], target: float) -> dict[str, dict[str, Any]]:
    """Per contender, in the order they first ran: medians over its runs (time and steps to
    the target over the runs that reached it), and every reaching run's figures."""
    summary: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(r.contender for r in results):
        mine = [r for r in results if r.contender == name]
        reached = [hit for r in mine if (hit := r.to_target(target)) is not None]
        summary[name] = {
            "runs": len(mine),
            "reached": len(reached),
            "time_to_target_s": statistics.median(h[0] for h in reached) if reached else None,
            "time_to_target_all_s": [h[0] for h in reached],
            "steps_to_target": statistics.median(h[1] for h in reached) if reached else None,
            "steps_to_target_all": [h[1] for h in reached],
            "steps_per_s": statistics.median(r.steps_per_s for r in mine),
            "generated_tokens_per_s": statistics.median(r.tokens_per_s for r in mine),
            "idle_fraction": statistics.median(r.idle_fraction for r in mine),
            "steady_idle_fraction": statistics.median(r.steady_idle_fraction for r in mine),
        }
    return summary


def time_to_target_ratio(summary: dict[str, dict[str, Any]]) -> float | None:
    """The project's median time to the target over the fastest TRL setting's (the issue's
    headline); None unless both reached it."""
    trl = [s["time_to_target_s"] for n, s in summary.items() if n.startswith("trl-") and s["time_to_target_s"]]
    project = summary.get("project", {}).get("time_to_target_s")
    return project / min(trl) if trl and project else None


@dataclass(frozen=True)
class StepsToTarget:
    """The project's steps to the target against TRL's, every TRL setting's runs pooled (TRL's
    learning does not depend on its thread count). Both the median and the mean: with three or
    four seeds one run's luck moves a median by a step or two."""

    project_median: float
    trl_median: float
    project_mean: float
    trl_mean: float

    @property
    def median_ratio(self) -> float:
        return self.project_median / self.trl_median

    @property
    def mean_ratio(self) -> float:
        return self.project_mean / self.trl_mean


def steps_to_target(summary: dict[str, dict[str, Any]]) -> StepsToTarget | None:
    """``StepsToTarget`` from a ``summarize``; None unless both sides reached the target."""
    trl = [n for name, s in summary.items() if name.startswith("trl-") for n in s["steps_to_target_all"]]
    project = summary.get("project", {}).get("steps_to_target_all") or []
    if not trl or not project:
        return None
    return StepsToTarget(
        statistics.median(project), statistics.median(trl), statistics.fmean(project), statistics.fmean(trl)
    )


CORRECTION_METRICS = {
    "logp_gap": "sampling/sampling_logp_difference/mean",
    "ratio_mean": "sampling/importance_sampling_ratio/mean",
    "masked_fraction": "sampling/importance_sampling_masked_fraction",
}
"""The trainer's vLLM-mismatch metrics (TRL's ``sampling/*`` names in ``metrics.jsonl``) that a
run's correction is summed up by: how far its log-probs were from vLLM's, the importance-sampling
ratio it trained with, and the share of that ratio it masked."""


def correction_over_run(records: list[dict[str, Any]]) -> dict[str, float]:
    """``CORRECTION_METRICS``' means over a run's steps (those every step logged). Why: a
    correction that shrinks the updates costs steps to the target, not seconds a step, so the
    benchmark shows it beside the steps (s67-learning: ``sequence_mask``'s ratio averaged 0.4-0.5
    and took half again as many steps)."""
    return {
        name: statistics.fmean(record[key] for record in records)
        for name, key in CORRECTION_METRICS.items()
        if records and all(key in record for record in records)
    }


@dataclass(frozen=True)
class LearningRow:
    """One contender's learning side: its steps to the target seed by seed (None where a run
    did not reach it) and its correction's figures (medians over its runs; none for TRL)."""

    contender: str
    steps_by_seed: dict[int, int | None]
    correction: dict[str, float]

    @property
    def mean_steps(self) -> float | None:
        reached = [steps for steps in self.steps_by_seed.values() if steps is not None]
        return statistics.fmean(reached) if reached else None


def learning_side(results: list[RunResult], target: float) -> list[LearningRow]:
    """A ``LearningRow`` per contender, in the order they first ran: staleness and the
    correction are judged by steps to the target over many seeds (the issue's learning side),
    and a median of three hides a seed's luck."""
    rows = []
    for name in dict.fromkeys(r.contender for r in results):
        mine = sorted((r for r in results if r.contender == name), key=lambda r: r.seed)
        steps = {r.seed: hit[1] if (hit := r.to_target(target)) is not None else None for r in mine}
        corrections = [c for r in mine if (c := r.extra.get("correction"))]
        shared = set.intersection(*(set(c) for c in corrections)) if corrections else set()
        medians = {key: statistics.median(c[key] for c in corrections) for key in CORRECTION_METRICS if key in shared}
        rows.append(LearningRow(name, steps, medians))
    return rows


def against_own_round(runs: list[RunResult], rounds: list[dict[str, Any]], key: str) -> float:
    """The median over ``runs`` of each run's steps/s over the steps/s ``key`` of the alone
    round measured just before it (round i before seed i): the machine's speed drifts between
    rounds, and a run is judged against the bound of its own minutes."""
    return statistics.median(r.steps_per_s / rounds[r.seed][key] for r in runs)


def service_window(before: Any, after: Any) -> dict[str, float]:
    """The service's side of a run between two ``GetStats`` answers: the share of the time
    generation was paused for pushes, the slots busy on average, and the share of the time
    staleness admission held the run's groups back (summed over the runs in both answers)."""
    seconds = after.uptime_seconds - before.uptime_seconds
    held = sum(
        stats.admission_wait_seconds - before.runs[run_id].admission_wait_seconds
        for run_id, stats in after.runs.items()
        if run_id in before.runs
    )
    return {
        "paused_fraction": (after.weight_update_paused_seconds - before.weight_update_paused_seconds) / seconds,
        "slots_busy_average": (after.slot_seconds_total - before.slot_seconds_total) / seconds,
        "admission_wait_fraction": held / seconds,
    }
