"""Per-step time accounting: phases add up to the step's wall time, and the run's split."""

from __future__ import annotations

import threading
import time

import pytest

from rollout_api.client import final_run, paced_lookahead
from rollout_common.ports import free_port
from trainer_client.step_timing import (
    COMPUTE_CPU,
    PHASES,
    PhaseClock,
    format_split,
    step_seconds,
    summarize_seconds,
    with_lookahead,
)


def test_clock_accumulates_phases_from_several_threads_and_starts_afresh() -> None:
    clock = PhaseClock()
    clock.add("forward", 0.25)
    threads = [threading.Thread(target=clock.add, args=("push_transfer", 0.01)) for _ in range(50)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=5)
    with clock.measure("backward"):
        pass
    seconds = clock.take()
    assert seconds["forward"] == 0.25
    assert seconds["push_transfer"] == pytest.approx(0.5)
    assert 0 <= seconds["backward"] < 0.1
    assert clock.take() == {}


def test_other_is_the_wall_time_no_phase_explains() -> None:
    phases = {"wait_groups": 0.1, "forward": 0.2, "backward": 0.3, "push_begin": 0.05, "push_commit": 0.05}
    background = step_seconds(phases, wall_s=1.0, synchronous_push=False)
    assert set(PHASES) < set(background)
    assert background["other"] == pytest.approx(0.4)  # the push overlapped the next step
    synchronous = step_seconds(phases, wall_s=1.0, synchronous_push=True)
    assert synchronous["other"] == pytest.approx(0.3)  # the push was on the step's path


def record(wait: float, compute: float) -> dict:
    return {"seconds": step_seconds({"wait_groups": wait, "forward": compute}, wait + compute, False)}


def test_summary_skips_the_first_step_and_names_the_bound() -> None:
    records = [record(5.0, 0.1)] + [record(0.02, 0.23)] * 4  # a slow first step, then training-bound
    split = summarize_seconds(records)
    assert split["steps"] == 4
    assert split["steps_per_second"] == pytest.approx(4 / 1.0)
    assert split["fraction"]["wait_groups"] == pytest.approx(0.08)
    assert split["bound"] == "training"
    assert summarize_seconds([record(0.5, 0.1)] * 3)["bound"] == "generation"
    # waiting 38% of each step is generation-bound even though the math takes longer
    assert summarize_seconds([record(0.38, 0.62)] * 3)["bound"] == "generation"
    assert "training-bound" in format_split(split) and "forward 92%" in format_split(split)
    assert summarize_seconds([]) == {}


def test_a_trainer_that_waits_while_paced_admission_holds_generation_back_is_training_bound() -> None:
    waiting = summarize_seconds([record(0.15, 0.35)] * 3)
    assert waiting["bound"] == "generation"  # 30% waiting
    paced = with_lookahead(waiting, 1.4, max_staleness=2)
    assert paced["bound"] == "training" and paced["lookahead_versions"] == 1.4
    assert "1.40 of at most 2 versions ahead" in format_split(paced)
    at_most = with_lookahead(waiting, 2.0, max_staleness=2)  # generation could not get further ahead
    assert at_most["bound"] == "generation" and "paced admission" not in format_split(at_most)
    assert with_lookahead(waiting, None, max_staleness=2) == waiting  # a service without the field


def test_compute_cpu_counts_the_training_threads_cpu_not_its_waits() -> None:
    clock = PhaseClock()
    done = threading.Event()
    with clock.measure(COMPUTE_CPU, time.thread_time):
        done.wait(timeout=0.2)  # blocked: wall time, no CPU
        sum(i * i for i in range(200_000))  # on the CPU
    seconds = clock.take()
    assert 0 < seconds[COMPUTE_CPU] < 0.2
    assert not set(seconds) & set(PHASES)  # not a phase: it overlaps forward/backward/optimizer


def test_summary_reports_the_share_of_compute_time_the_training_thread_was_on_a_cpu() -> None:
    def shared(cpu: float) -> dict:
        phases = {"forward": 0.1, "backward": 0.2, "optimizer": 0.1}
        return {"seconds": step_seconds(phases, 0.5, False), "compute_cpu_seconds": cpu}

    split = summarize_seconds([shared(0.1)] + [shared(0.3)] * 4)  # 0.3 of every 0.4 s of compute
    assert split["compute_cpu_share"] == pytest.approx(0.75)
    assert "on a CPU 75% of its forward/backward/optimizer time" in format_split(split)
    # A run of one step (no steady state) reads its share from that step, like its phases.
    assert summarize_seconds([shared(0.2)])["compute_cpu_share"] == pytest.approx(0.5)
    # Records without the field (a trainer before it) leave the share out, not 0%.
    old = summarize_seconds([record(0.02, 0.23)] * 3)
    assert old["compute_cpu_share"] is None and "on a CPU" not in format_split(old)


async def test_a_service_gone_after_training_leaves_the_lookahead_unknown(caplog: pytest.LogCaptureFixture) -> None:
    """The verdict's lookahead and the ledger are read after the last step: a service no longer
    there costs the summary those figures (logged), not the summary."""
    run = await final_run(f"127.0.0.1:{free_port()}", "run-1", timeout_s=0.5)
    assert run is None and paced_lookahead(run) is None
    assert "the final state of run run-1 is unknown" in caplog.text
