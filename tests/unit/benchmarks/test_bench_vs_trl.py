"""The numbers ``benchmarks/bench_vs_trl.py`` reports, computed from known inputs.

Why: the speed issue is judged by this benchmark's figures (time and steps to the target,
steps/s against each side alone, the runs' work against the cores, a push's share of a step),
and each is read off logs and counters in a way that is easy to get subtly wrong (a rolling
mean one step off, a first step counted as steady, a log line that no longer matches).
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest

from rollout_api import rollout_pb2 as pb

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))  # as the benchmark scripts run

from vllm_push_log import PushLog, describe
from vs_trl.alone import together_seconds
from vs_trl.cpu_use import (
    core_seconds_per_step,
    engine_steps_per_step,
    parse_engine_steps,
    process_part,
    work_bound,
)
from vs_trl.outcomes import (
    CORRECTION_METRICS,
    ROLLING,
    RunResult,
    against_own_round,
    correction_over_run,
    learning_side,
    service_window,
    steady_fraction,
    steps_to_target,
    summarize,
    time_to_target_ratio,
)
from vs_trl.processes import leading_env_settings
from vs_trl.training_window import TrainingWindow

from trainer_client.train.step_callback import STEP_LINE


def run(contender: str, seed: int, rewards: list[float], step_s: float = 0.5, tokens: int = 100) -> RunResult:
    wall = [step_s * (i + 1) for i in range(len(rewards))]
    return RunResult(contender, seed, wall, rewards, 0.2, tokens * len(rewards), 0.1)


def test_time_to_target_is_the_first_step_whose_rolling_mean_reaches_it() -> None:
    assert ROLLING == 5
    # means of steps 1-5: 0.5; 2-6: 0.6; 3-7: 0.7 (the first at 0.7)
    result = run("project", 0, [0.5, 0.5, 0.5, 0.5, 0.5, 1.0, 1.0, 1.0], step_s=0.25)
    assert result.to_target(0.7) == (1.75, 7)
    assert result.to_target(0.5) == (1.25, 5)  # never before ROLLING steps, however high the first ones
    assert run("project", 0, [1.0, 1.0, 1.0, 1.0]).to_target(0.1) is None
    assert result.to_target(0.91) is None
    assert result.steps_per_s == pytest.approx(8 / 2.0)
    assert result.tokens_per_s == pytest.approx(800 / 2.0)


def test_steady_idle_leaves_the_first_step_out() -> None:
    # the first step waited 1.0 s of its 1.2 s (the first generation); later steps 0.1 of 0.4 each
    assert steady_fraction([1.0, 0.1, 0.1, 0.1], [1.2, 1.6, 2.0, 2.4]) == pytest.approx(0.25)
    assert math.isnan(steady_fraction([1.0], [1.2]))


def test_summary_takes_medians_and_the_project_against_the_fastest_trl_setting() -> None:
    fast, slow = [0.2] * 4 + [0.9] * 6, [0.2] * 6 + [0.9] * 6
    results = [
        run("trl-1t", 0, slow, step_s=1.0),
        run("trl-2t", 0, slow, step_s=0.5),  # the mean of steps 7-11 is the first at 0.8: 5.5 s
        run("project", 0, fast, step_s=0.2),  # steps 5-9: 1.8 s
        run("project", 1, slow, step_s=0.2),  # steps 7-11: 2.2 s
        run("project", 2, [0.1] * 12, step_s=0.2),  # never
    ]
    summary = summarize(results, target=0.8)
    assert list(summary) == ["trl-1t", "trl-2t", "project"]
    project = summary["project"]
    assert (project["runs"], project["reached"]) == (3, 2)
    assert project["time_to_target_all_s"] == pytest.approx([1.8, 2.2])
    assert project["time_to_target_s"] == pytest.approx(2.0)
    assert project["steps_to_target_all"] == [9, 11]
    assert summary["trl-2t"]["time_to_target_s"] == pytest.approx(5.5)
    assert time_to_target_ratio(summary) == pytest.approx(2.0 / 5.5)
    steps = steps_to_target(summary)
    assert steps is not None
    assert (steps.project_median, steps.trl_median) == (10, 11)  # TRL's settings pooled: 11 and 11
    assert steps.mean_ratio == pytest.approx(10 / 11)


def test_no_ratio_unless_both_sides_reached_the_target() -> None:
    summary = summarize([run("trl-2t", 0, [0.1] * 8), run("project", 0, [0.9] * 8)], target=0.8)
    assert time_to_target_ratio(summary) is None
    assert steps_to_target(summary) is None


def test_the_correction_is_averaged_over_a_runs_steps_and_its_medians_over_runs() -> None:
    def step(gap: float, ratio: float, masked: float) -> dict[str, float]:
        names = ("logp_gap", "ratio_mean", "masked_fraction")
        return {CORRECTION_METRICS[name]: value for name, value in zip(names, (gap, ratio, masked), strict=True)}

    records = [step(0.2, 0.5, 0.0), step(0.4, 0.3, 0.1)]
    assert correction_over_run(records) == pytest.approx({"logp_gap": 0.3, "ratio_mean": 0.4, "masked_fraction": 0.05})
    assert correction_over_run([*records, {"reward_mean": 0.5}]) == {}  # a step that did not log them
    assert correction_over_run([]) == {}

    late = [0.2] * 6 + [0.9] * 6  # steps 7-11 reach 0.8: 11 steps
    results = [
        run("trl-2t", 0, late),
        run("project", 1, [0.9] * 8),  # 5 steps
        run("project", 0, late),
        run("project", 2, [0.1] * 8),  # never
    ]
    for r, ratio in zip(results[1:], (0.9, 0.5, 0.7), strict=True):
        r.extra["correction"] = {"logp_gap": 0.2, "ratio_mean": ratio, "masked_fraction": 0.0}
    trl, project = learning_side(results, target=0.8)
    assert (trl.contender, trl.steps_by_seed, trl.correction, trl.mean_steps) == ("trl-2t", {0: 11}, {}, 11)
    assert list(project.steps_by_seed.items()) == [(0, 11), (1, 5), (2, None)]  # by seed, whatever the run order
    assert project.mean_steps == pytest.approx(8.0)  # over the runs that reached the target
    assert project.correction["ratio_mean"] == pytest.approx(0.7)


def test_each_run_is_judged_against_the_alone_round_just_before_it() -> None:
    runs = [run("project", seed, [0.5] * 10, step_s=0.2) for seed in range(3)]  # 5 steps/s each
    rounds = [{"ideal_steps_per_s": ideal} for ideal in (10.0, 5.0, 8.0)]
    assert against_own_round(runs, rounds, "ideal_steps_per_s") == pytest.approx(5 / 8)


VLLM_METRICS = """\
# HELP vllm:iteration_tokens_total Histogram of number of tokens per engine_step.
# TYPE vllm:iteration_tokens_total histogram
vllm:iteration_tokens_total_bucket{engine="0",le="1.0",model_name="m"} 3.0
vllm:iteration_tokens_total_count{engine="0",model_name="m"} 120.0
vllm:iteration_tokens_total_sum{engine="0",model_name="m"} 6000.0
vllm:iteration_tokens_total_count{engine="1",model_name="m"} 30.0
vllm:iteration_tokens_total_sum{engine="1",model_name="m"} 1500.0
vllm:num_requests_running{engine="0",model_name="m"} 4.0
"""


def test_engine_steps_are_summed_over_engines_and_counted_per_training_step() -> None:
    assert parse_engine_steps(VLLM_METRICS) == (150.0, 7500.0)
    assert parse_engine_steps("vllm:num_requests_running 4.0\n") == (0.0, 0.0)
    per_step = engine_steps_per_step((100.0, 4000.0), (150.0, 7500.0), steps=2)
    assert per_step == {"engine_steps_per_step": 25.0, "tokens_per_engine_step": 70.0}
    assert engine_steps_per_step((150.0, 7500.0), (150.0, 7500.0), steps=2) == {}  # --disable-log-stats


def test_processes_are_told_apart_by_name_and_command_line() -> None:
    api = "python -m vllm.entrypoints.openai.api_server --model m"
    assert process_part(11, "VLLM::EngineCor", "python -m vllm.entrypoints.openai.api_server", 99) == "vLLM engine core"
    assert process_part(12, "VLLM::Worker_TP", api, 99) == "vLLM worker"
    assert process_part(13, "python", api, 99) == "vLLM API server"
    assert process_part(14, "python", "python -m trainer_client.cli --target x", 99) == "trainer"
    assert process_part(99, "python", "python benchmarks/bench_vs_trl.py", 99) == "service"
    assert process_part(os.getpid(), "python", "pytest", 99) == "consumer"
    assert process_part(15, "bash", "bash", 99) == "other"


def test_work_per_step_and_the_steps_per_second_it_allows() -> None:
    before = {"trainer": 1.0, "vLLM engine core": 2.0}
    after = {"trainer": 3.0, "vLLM engine core": 4.5, "service": 0.5}  # the service started between
    assert core_seconds_per_step(before, after, steps=10) == pytest.approx(
        {"trainer": 0.2, "vLLM engine core": 0.25, "service": 0.05}
    )
    runs = [{"a": 0.2, "b": 0.1}, {"a": 0.25, "b": 0.15}, {"a": 0.3, "b": 0.2}]  # 0.3, 0.4, 0.5 in all
    work, bound = work_bound(runs, cores=2)
    assert (work, bound) == (pytest.approx(0.4), pytest.approx(5.0))


def test_the_trainers_step_line_is_the_one_the_cpu_readings_wait_for() -> None:
    line = "INFO trainer_client.train.step_callback: " + STEP_LINE % (7, 0.5, 6, 4, 0, 0.16, 0.03)
    match = TrainingWindow.STEP_LINE.search(line)
    assert match is not None and match.group(1) == "7"
    assert TrainingWindow.STEP_LINE.search("evaluation step 7 done") is None


def test_the_project_trains_with_the_benchmarks_settings_and_a_variants_flags_win(tmp_path: Path) -> None:
    from bench_vs_trl import parse_args
    from vs_trl.project_side import trainer_command

    from trainer_client.cli import TrainerArgumentParser

    args = parse_args(["--model-dir", str(tmp_path / "model"), "--group-size", "4", "--prompts-per-step", "3"])
    command = trainer_command(args, "127.0.0.1:1", tmp_path / "out")
    assert command[1:3] == ["-m", "trainer_client.cli"]
    run, config, model = TrainerArgumentParser().parse(command[3:])
    assert (run.dataset, run.rewards) == ("letters", {"vowel_share": 1.0})
    assert model.model_name_or_path == str(args.model_dir)
    # As TRL's side (trl_side.trl_worker): G, prompts per step, tokens, learning rate, loss, on the CPU.
    assert (config.num_generations, config.groups_per_step, config.max_completion_length) == (4, 3, 32)
    assert (config.learning_rate, config.lr_scheduler_type, config.loss_type) == (3e-3, "constant", "dapo")
    assert (config.max_steps, config.use_cpu, config.logging_steps, config.save_strategy) == (40, True, 1, "no")
    assert config.log_level == "info"  # the step lines TrainingWindow reads
    _, variant, _ = TrainerArgumentParser().parse([*command[3:], "--max-staleness", "1"])
    assert (config.max_staleness, variant.max_staleness) == (2, 1)


def test_variant_environment_settings_come_before_its_flags() -> None:
    words = ["OMP_NUM_THREADS=2", "X_Y=a=b", "--torch-threads", "2", "Z=1"]
    assert leading_env_settings(words) == ({"OMP_NUM_THREADS": "2", "X_Y": "a=b"}, ["--torch-threads", "2", "Z=1"])
    assert leading_env_settings(["--max-staleness", "1"]) == ({}, ["--max-staleness", "1"])
    assert leading_env_settings(["A=1"]) == ({"A": "1"}, [])


APPLY = (
    "(EngineCore pid=1) INFO 11-27 16:00:00 [plugin.py:268] applied 26 weight tensors directly (loader calls "
    "replayed) in {wall} ms ({apply} ms CPU), received them over shared memory in 0.9 ms ({receive} ms CPU)\n"
)


def test_push_cost_leaves_the_warm_up_pushes_out_and_reads_only_since_the_mark(tmp_path: Path) -> None:
    log = tmp_path / "vllm.log"
    log.write_text(APPLY.format(wall=50, apply=40.0, receive=9.0) * 3)  # an earlier run's pushes
    push_log = PushLog(log)
    push_log.mark()
    assert push_log.since_mark() is None
    lines = [APPLY.format(wall=30, apply=30.0, receive=5.0)] * 2  # this run's warm-up
    lines += [APPLY.format(wall=9, apply=a, receive=r) for a, r in ((6.0, 0.7), (7.0, 0.8), (6.5, 0.9))]
    with log.open("a") as out:
        out.write("unrelated line\n" + "".join(lines))
    cost = push_log.since_mark()
    assert cost is not None
    assert (cost.pushes, cost.transport) == (5, "shared memory")
    assert (cost.apply_cpu_ms, cost.receive_cpu_ms, cost.cpu_ms) == (6.5, 0.8, pytest.approx(7.4))
    line = describe("project", [cost.to_dict()], steps_per_s=5.0)  # a 200 ms step
    assert "7.4 ms of vLLM's CPU per push" in line and "= 3.7% of its step" in line


def stats(uptime: float, slot_seconds: float, paused: float, held: dict[str, float]) -> pb.GetStatsResponse:
    answer = pb.GetStatsResponse(
        uptime_seconds=uptime, slot_seconds_total=slot_seconds, weight_update_paused_seconds=paused
    )
    for run_id, seconds in held.items():
        answer.runs[run_id].admission_wait_seconds = seconds
    return answer


def test_the_service_is_measured_over_the_training_window() -> None:
    # 4 s of training: 192 slot-seconds (48 slots busy), 0.2 s paused, the run held back 1 s;
    # a run deleted before the window's end and one created within it do not count
    before = stats(10.0, 100.0, 1.0, {"run": 2.0, "gone": 5.0})
    after = stats(14.0, 292.0, 1.2, {"run": 3.0, "new": 0.5})
    assert service_window(before, after) == {
        "paused_fraction": pytest.approx(0.05),
        "slots_busy_average": pytest.approx(48.0),
        "admission_wait_fraction": pytest.approx(0.25),
    }


async def test_the_window_reads_at_the_first_and_last_step_only() -> None:
    reads: list[int] = []

    async def read() -> int:
        reads.append(len(reads))
        return len(reads)

    window = TrainingWindow(steps=3, readers={"counter": read})
    for step in (1, 2, 3):
        window.on_line("INFO trainer_client.train.step_callback: " + STEP_LINE % (step, 0.5, step, 4, 0, 0.16, 0.03))
    assert await window.readings("counter") == (1, 2)
    assert window.per_step() is not None and window.busy_fraction_by_cpu() is not None
    unfinished = TrainingWindow(steps=3, readers={"counter": read})
    unfinished.on_line(STEP_LINE % (1, 0.5, 1, 4, 0, 0.16, 0.03))
    assert await unfinished.readings("counter") is None
    assert unfinished.per_step() is None


def test_generation_outlasts_the_trainer_when_both_sides_run_at_once() -> None:
    # the small model's trainer (25 steps of 0.1 s: its 8 s minimum) keeps the shortest windows
    assert together_seconds(0.1) == {"generate-alone": 16.0, "train-alone": 8.0}
    # 25 steps of 0.35 s: 8.75 s, then 1.5x that beside generation after a 4 s start-up
    assert together_seconds(0.35)["generate-alone"] == pytest.approx(17.125)
    # the medium model: 25 steps of 1.2 s are 30 s, which a fixed 16 s of generation missed
    assert together_seconds(1.2) == {"generate-alone": pytest.approx(49.0), "train-alone": 8.0}
