"""Evaluation runs: every prompt of a held-out set once, all at one known policy version.

An asynchronous run's rewards mix versions; an evaluation run waits until the servers hold
version N, holds it while it generates (weight updates wait, ``weights.version_holds``),
never trains, and reports its scores. It fails if the version is replaced before it starts,
or if a weight update waits ``weight_sync.eval_hold_timeout_s`` for it (its scores are kept).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rollout_service.errors import FailedPrecondition
from rollout_service.eval_tally import EvalTally
from rollout_service.runs import Run
from rollout_service.weights.version_holds import VersionHolds

if TYPE_CHECKING:
    from rollout_service.metrics import ServiceMetrics
    from rollout_service.types import ScoredGroup

logger = logging.getLogger(__name__)

KEPT_RESULTS = 100
"""The latest evaluation results GetStats reports, deleted runs' included."""


@dataclass(frozen=True)
class EvalResult:
    run_id: str
    display_name: str
    policy_version: int
    prompts: int
    groups_scored: int
    groups_dropped: int
    samples: int
    reward_mean: float
    reward_means: dict[str, float]
    complete: bool
    owner: str = ""
    """The run's creator: GetStats shows a caller only its own evaluations."""


def eval_result(run: Run) -> EvalResult:
    tally = run.eval
    assert tally is not None, f"run {run.run_id} is not an evaluation run"
    return EvalResult(
        run_id=run.run_id,
        display_name=run.spec.display_name,
        policy_version=tally.policy_version,
        prompts=tally.prompts,
        groups_scored=tally.groups_scored,
        groups_dropped=run.counters.groups_dropped,
        samples=tally.samples,
        reward_mean=tally.reward_mean,
        reward_means=tally.reward_means,
        complete=tally.complete,
        owner=run.owner,
    )


class Evaluations:
    def __init__(
        self,
        holds: VersionHolds,
        metrics: ServiceMetrics,
        pausing_update_pending: Callable[[], bool],
        stop_generation: Callable[[Run], None],
    ) -> None:
        self.holds = holds
        self.holds.on_overrun = self._overrun
        self._metrics = metrics
        self._pausing_update_pending = pausing_update_pending
        self._stop_generation = stop_generation
        self._waiting: dict[str, Run] = {}
        self._holding: dict[str, Run] = {}
        self._reported: OrderedDict[str, Run] = OrderedDict()

    def admit(self, run: Run, prompts: int, current_version: int) -> None:
        """Give a new evaluation run its tally; it starts at once if its version is live."""
        assert run.spec.eval is not None
        version = run.spec.eval.policy_version
        version = current_version if version is None else version
        if version < current_version:
            raise FailedPrecondition(
                f"eval.policy_version is {version} but the servers already hold version {current_version}; "
                f"evaluate version {current_version} or later (or leave policy_version unset for the current one)"
            )
        run.eval = EvalTally(version, prompts)
        self._waiting[run.run_id] = run
        self._reported[run.run_id] = run
        while len(self._reported) > KEPT_RESULTS:
            self._reported.popitem(last=False)
        self.version_changed(current_version)

    def version_changed(self, current_version: int) -> None:
        """Start the evaluations of this version, fail those whose version was replaced."""
        for run in list(self._waiting.values()):
            assert run.eval is not None
            if run.eval.policy_version < current_version:
                del self._waiting[run.run_id]
                run.state = "failed"
                run.error = (
                    f"policy version {run.eval.policy_version} was replaced by {current_version} before the "
                    "evaluation could start (a weight update that pauses the servers was under way); "
                    "create it again at a later version"
                )
                logger.warning("evaluation run %s: %s", run.run_id, run.error)
                self._stop_generation(run)
            elif run.eval.policy_version == current_version and not self._pausing_update_pending():
                del self._waiting[run.run_id]
                self._holding[run.run_id] = run
                self.holds.hold(run.run_id, current_version)
                run.eval.started.set()
                logger.info("evaluation run %s generating at policy version %d", run.run_id, current_version)

    def record(self, run: Run, group: ScoredGroup) -> None:
        assert run.eval is not None
        run.eval.record(group)
        self._export(run)

    def generation_done(self, run: Run) -> None:
        """Every prompt's group is scored or dropped: release the version."""
        assert run.eval is not None
        run.eval.complete = True
        if run.state == "running":
            run.state = "completed"
        self._release(run)
        self._export(run)
        result = eval_result(run)
        logger.info(
            "evaluation run %s at policy version %d: reward %.4f over %d samples (%d groups dropped)",
            run.run_id,
            result.policy_version,
            result.reward_mean,
            result.samples,
            result.groups_dropped,
        )

    def forget(self, run: Run) -> None:
        """The run was deleted: release its hold (its result stays)."""
        self._waiting.pop(run.run_id, None)
        self._release(run)

    def results(self) -> list[EvalResult]:
        return [eval_result(run) for run in self._reported.values()]

    def _release(self, run: Run) -> None:
        self._holding.pop(run.run_id, None)
        self.holds.release(run.run_id)

    def _overrun(self, holders: list[str]) -> None:
        """A weight update stopped waiting for these evaluations: stop them, keep their scores."""
        for run_id in holders:
            run = self._holding.pop(run_id, None)
            if run is None or run.eval is None:
                continue
            run.state = "failed"
            run.error = (
                f"stopped after {run.eval.groups_scored} of {run.eval.prompts} groups: a weight update waited "
                "weight_sync.eval_hold_timeout_s for this evaluation to release policy version "
                f"{run.eval.policy_version}; evaluate fewer prompts, or raise the setting"
            )
            logger.warning("evaluation run %s: %s", run_id, run.error)
            self._stop_generation(run)

    def _export(self, run: Run) -> None:
        assert run.eval is not None
        name = run.spec.display_name or run.run_id
        self._metrics.eval_reward_mean.labels(name).set(run.eval.reward_mean)
        self._metrics.eval_policy_version.labels(name).set(run.eval.policy_version)
        self._metrics.eval_samples.labels(name).set(run.eval.samples)
