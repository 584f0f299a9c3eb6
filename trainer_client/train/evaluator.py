"""Evaluation every N weight pushes, at the version just pushed.

The training reward mixes several policy versions, so it cannot rate one. After every N-th
push an evaluation run (``RunSpec.eval``) generates each held-out prompt once at that version;
its result lands in the step record, ``evals.jsonl`` and the summary. A failed evaluation is
recorded with its error and training goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollout_api import rollout_pb2 as pb

if TYPE_CHECKING:
    from trainer_client.stream.feed import GroupFeed

logger = logging.getLogger(__name__)

POLL_S = 0.2
"""How often an evaluation's state is read back (GetRun)."""
TIMEOUT_S = 600.0


class PinnedEvaluator:
    """Starts an evaluation run after every ``every``-th push and collects the results."""

    def __init__(self, feed: GroupFeed, spec: pb.RunSpec, every: int, output: Path) -> None:
        if every <= 0:
            raise ValueError(f"eval every {every} pushes: give a positive number")
        self.feed = feed
        self.spec = spec
        """The evaluation run's spec; its ``eval.policy_version`` is set per evaluation."""
        self.every = every
        self.output = output
        """``evals.jsonl``: one line per evaluation, as it finishes."""
        self.pushes = 0
        self.results: list[dict[str, Any]] = []
        self._running: list[Future[dict[str, Any]]] = []

    def pushed(self, version: int) -> None:
        """A push committed ``version``: evaluate it if it is an N-th push.

        The run is created here, before the next push can begin, because the service refuses
        to evaluate a version its servers no longer hold; the rest runs beside training."""
        self.pushes += 1
        if self.pushes % self.every != 0:
            return
        spec = pb.RunSpec()
        spec.CopyFrom(self.spec)
        spec.eval.policy_version = version
        try:
            run = self.feed.call(self.feed.client.create_run(spec))
        except Exception as exc:  # recorded with its error by ``_collect``; training goes on
            failed: Future[dict[str, Any]] = Future()
            failed.set_exception(exc)
            self._running.append(failed)
            return
        self._running.append(self.feed.submit(self._evaluate(run, version)))

    def finished(self) -> list[dict[str, Any]]:
        """The evaluations that finished since the last call, in the order they were started."""
        done = [future for future in self._running if future.done()]
        self._running = [future for future in self._running if future not in done]
        return [self._collect(future) for future in done]

    def wait(self) -> list[dict[str, Any]]:
        """At the end of training: wait for the evaluations still running."""
        running, self._running = self._running, []
        for future in running:
            with contextlib.suppress(Exception):  # collected with its error below
                future.result(TIMEOUT_S + 30)
        return [self._collect(future) for future in running]

    def _collect(self, future: Future[dict[str, Any]]) -> dict[str, Any]:
        try:
            result = future.result(0)
        except Exception as exc:
            logger.warning("evaluation failed: %s", exc)
            result = {"error": f"{type(exc).__name__}: {exc}"}
        self.results.append(result)
        self.output.parent.mkdir(parents=True, exist_ok=True)
        with self.output.open("a") as out:
            out.write(json.dumps(result) + "\n")
        return result

    async def _evaluate(self, run: pb.Run, version: int) -> dict[str, Any]:
        client = self.feed.client
        try:
            async with asyncio.timeout(TIMEOUT_S):
                while run.state == pb.RUN_STATE_RUNNING:
                    await asyncio.sleep(POLL_S)  # a polling period: GetRun has no push form
                    run = await client.get_run(run.run_id)
        finally:
            await client.delete_run(run.run_id)
        result = run.eval_result
        record = {
            "policy_version": result.policy_version,
            "reward_mean": result.reward_mean,
            "reward_means": dict(result.reward_means),
            "samples": result.samples,
            "groups_scored": result.groups_scored,
            "groups_dropped": result.groups_dropped,
            "prompts": result.prompts,
            "complete": result.complete,
        }
        if run.error:
            record["error"] = run.error
        logger.info(
            "eval at policy version %d: reward %.4f over %d samples", version, result.reward_mean, result.samples
        )
        return record
