"""What the benchmark prints: the contenders' table, then the project's lines (its push cost,
its steps to the target against TRL's, its steps/s against each side alone, and where the
cores went). The numbers come from ``outcomes`` and ``cpu_use``; this module only shows them.
"""

from __future__ import annotations

import os
import statistics
from typing import Any

from vllm_push_log import describe

from vs_trl.alone import median_alone
from vs_trl.cpu_use import work_bound
from vs_trl.outcomes import (
    ROLLING,
    RunResult,
    against_own_round,
    learning_side,
    steps_to_target,
    summarize,
    time_to_target_ratio,
)


def report(results: list[RunResult], target: float, alone_rounds: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Print everything; return ``outcomes.summarize``'s summary for ``results.json``."""
    from rich.console import Console
    from rich.table import Table

    from trainer_client.step_timing import format_split

    table = Table(title=f"time to a rolling-{ROLLING} mean reward of {target} (medians over seeds)")
    for column in ("contender", "runs", "reached", "time to target s", "steps to target", "steps/s", "gen tok/s"):
        table.add_column(column, justify="right")
    table.add_column("trainer idle", justify="right")
    table.add_column("idle, steady", justify="right")
    summary = summarize(results, target)
    for name, row in summary.items():
        table.add_row(
            name, str(row["runs"]), str(row["reached"]),
            "-" if row["time_to_target_s"] is None else f"{row['time_to_target_s']:.1f}",
            "-" if row["steps_to_target"] is None else f"{row['steps_to_target']:.0f}",
            f"{row['steps_per_s']:.2f}", f"{row['generated_tokens_per_s']:.0f}", f"{100 * row['idle_fraction']:.0f}%",
            f"{100 * row['steady_idle_fraction']:.0f}%",
        )  # fmt: skip
    console = Console(width=max(Console().width, 110))  # the table's nine columns, unclipped
    console.print(table)
    for r in results:
        if "service" in r.extra:
            service, split = r.extra["service"], r.extra["time_split"]
            window = (
                f"from its first step to its last: vLLM paused {100 * service['paused_fraction']:.0f}%, "
                f"{service['slots_busy_average']:.1f} slots busy on average, admission held it back "
                f"{100 * service['admission_wait_fraction']:.0f}%; "
                if "slots_busy_average" in service
                else ""
            )
            console.print(
                f"{r.contender}#{r.seed}: {window}{r.extra['dropped_stale']} groups dropped stale; "
                f"{staleness_line(r.extra)}last push {service['last_update']}; trainer: {format_split(split)}"
            )
    if (ratio := time_to_target_ratio(summary)) is not None:
        console.print(f"project time to target / fastest TRL setting: {ratio:.2f}")
    report_steps_to_target(console, summary)
    report_learning_side(console, results, target)
    report_push_cost(console, results, summary)
    report_alone(console, results, alone_rounds)
    return summary


def report_push_cost(console: Any, results: list[RunResult], summary: dict[str, dict[str, Any]]) -> None:
    """What a push cost vLLM's CPU, per contender, against the contender's step."""
    for name, row in summary.items():
        costs = [cost for r in results if r.contender == name and (cost := r.extra.get("vllm_push"))]
        if costs:
            console.print(describe(name, costs, row["steps_per_s"]))


def report_steps_to_target(console: Any, summary: dict[str, dict[str, Any]]) -> None:
    """The project's steps to the target against TRL's (``outcomes.StepsToTarget``)."""
    if (steps := steps_to_target(summary)) is None:
        return
    console.print(
        f"project steps to target / TRL's: median {steps.project_median:g} / {steps.trl_median:g} = "
        f"{steps.median_ratio:.2f}x, mean {steps.project_mean:.1f} / {steps.trl_mean:.1f} = {steps.mean_ratio:.2f}x"
    )


def report_learning_side(console: Any, results: list[RunResult], target: float) -> None:
    """Each contender's steps to the target seed by seed, and the project's correction beside
    them (``outcomes.learning_side``): how staleness and the correction cost learning."""
    console.print(
        "steps to the target by seed (mean over the runs that reached it); the project's correction, "
        "means over a run's steps (medians over runs):"
    )
    labels = {
        "logp_gap": "|log-prob - vLLM's| {:.3f}",
        "ratio_mean": "ratio {:.2f}",
        "masked_fraction": "masked {:.1%}",
    }
    for row in learning_side(results, target):
        seeds = ", ".join("-" if steps is None else str(steps) for steps in row.steps_by_seed.values())
        mean = "-" if row.mean_steps is None else f"{row.mean_steps:.1f}"
        shown = [label.format(row.correction[key]) for key, label in labels.items() if key in row.correction]
        correction = "; " + ", ".join(shown) if shown else ""
        console.print(f"  {row.contender}: {seeds} (mean {mean}){correction}")


def report_alone(console: Any, results: list[RunResult], alone_rounds: list[dict[str, Any]]) -> None:
    """The project's steps/s against each side alone. Each run is set against the round
    measured just before it (round i before seed i), and the ratio is the median of those."""
    alone = median_alone(alone_rounds)
    project = [r for r in results if r.contender == "project"]
    if not project:
        return
    achieved = statistics.median(r.steps_per_s for r in project)

    def ratio(key: str) -> float:
        return against_own_round(project, alone_rounds, key)

    per_round = ", ".join(f"{r['ideal_steps_per_s']:.2f}" for r in alone_rounds)
    console.print(
        f"alone, same thread split (median of {len(alone_rounds)} rounds, one before each seed's runs): "
        f"T_train {alone['train_step_s']:.3f}s ({'bf16 autocast' if alone.get('train_bf16') else 'float32'}), "
        f"T_generate {alone['generate_step_s']:.3f}s per step -> ideal "
        f"{per_round} steps/s by round; project achieved {ratio('ideal_steps_per_s'):.2f}x (median over runs, "
        "each against its round)"
    )
    console.print(
        f"busy core-seconds per step alone: training {alone['train_core_s']:.3f}, generation "
        f"{alone['generate_core_s']:.3f} -> on {os.cpu_count()} cores at most {alone['core_bound_steps_per_s']:.2f} "
        f"steps/s; project achieved {ratio('core_bound_steps_per_s'):.2f}x of that"
    )
    if "together_train_step_s" in alone:
        overlaps = ", ".join(f"{r['together_overlap']:.0%}" for r in alone_rounds)
        train, generate = alone["together_train_step_s"], alone["together_generate_step_s"]
        console.print(
            "both at once, each as fast as it goes (no staleness bound, no pushes; generation ran through "
            f"{overlaps} of the trainer's window by round): T_train {train:.3f}s "
            f"({train / alone['train_step_s']:.2f}x alone), T_generate {generate:.3f}s "
            f"({generate / alone['generate_step_s']:.2f}x alone) per step"
        )
    if one_step := alone.get("generate_one_step_in_flight_s"):
        slowest_one_step = max(one_step, alone["train_step_s"])
        console.print(
            f"T_generate with at most one step's groups in flight (as max_staleness 1 runs): {one_step:.3f}s "
            f"-> {1 / slowest_one_step:.2f} steps/s at most; "
            f"project achieved {achieved * slowest_one_step:.2f}x of that"
        )
    engine_in_runs = [engine for r in project if (engine := r.extra.get("engine"))]
    if engine_in_runs and (engine_alone := alone.get("generate_engine")):
        console.print(
            "vLLM engine steps per training step (tokens per engine step), in the project's runs (median) against "
            + "generation alone: "
            + f"{statistics.median(e['engine_steps_per_step'] for e in engine_in_runs):.1f} "
            + f"({statistics.median(e['tokens_per_engine_step'] for e in engine_in_runs):.1f}) against "
            + f"{engine_alone['engine_steps_per_step']:.1f} ({engine_alone['tokens_per_engine_step']:.1f})"
        )
    else:
        console.print("vLLM engine steps: not counted (vLLM's /metrics had no vllm:iteration_tokens_total)")
    alone_parts = alone["generate_core_s_by_process"]
    in_runs = [parts for r in project if (parts := r.extra.get("core_s_per_step_by_process"))]
    if not in_runs:  # no run logged its first and last step: generation alone, as before
        split = ", ".join(f"{part} {seconds:.3f}" for part, seconds in sorted(alone_parts.items(), key=lambda p: -p[1]))
        console.print(f"generation's core-seconds per step alone, by process: {split}")
        return
    by_cpu = [cpus for r in project if (cpus := r.extra.get("busy_fraction_by_cpu"))]
    if by_cpu:
        console.print(
            "each CPU busy from the trainer's first step to its last (median over the project's runs): "
            + ", ".join(f"{cpu} {statistics.median(c[cpu] for c in by_cpu):.0%}" for cpu in by_cpu[0])
        )
    in_run = {part: statistics.median(p.get(part, 0.0) for p in in_runs) for part in in_runs[0]}
    shown = sorted(in_run, key=lambda part: -in_run[part])
    console.print(
        "core-seconds per step by process, in the project's runs (median) against generation alone: "
        + ", ".join(
            f"{part} {in_run[part]:.3f}" + (f" (alone {alone_parts[part]:.3f})" if part in alone_parts else "")
            for part in shown
            if in_run[part] >= 0.001
        )
    )
    report_capacity(console, achieved, in_runs, alone)


def report_capacity(console: Any, achieved: float, in_runs: list[dict[str, float]], alone: dict[str, Any]) -> None:
    """The bound the runs' own work sets: every process's core-seconds per step in a run, spread
    over every core. A run near it has no idle core left to win back; only less work per step
    makes it faster, and the line says how much less 0.9x of the ideal would take."""
    cores = os.cpu_count() or 1
    work, bound = work_bound(in_runs, cores)
    wanted = 0.9 * alone["ideal_steps_per_s"]
    console.print(
        f"the runs' own work: {work:.3f} core-seconds per step in all (each side alone "
        f"{alone['train_core_s'] + alone['generate_core_s']:.3f}) -> on {cores} cores at most {bound:.2f} steps/s; "
        f"project achieved {achieved / bound:.2f}x of that. 0.9x the ideal ({wanted:.2f} steps/s) needs at most "
        f"{cores / wanted:.3f} core-seconds per step"
    )


def staleness_line(extra: dict[str, Any]) -> str:
    """How stale the trained samples were (per sample, after the first step) and the lookahead
    admission ended at (below max_staleness only under paced admission)."""
    if "staleness_trained" not in extra:
        return ""  # a results.json written before these were recorded
    return (
        f"staleness trained {extra['staleness_trained']:.2f} versions (mean), "
        f"lookahead at the end {extra['lookahead_versions']:.2f} versions; "
    )
