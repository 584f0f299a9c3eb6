"""What happens between optimizer steps: ack the step's groups, push weights when due, log
the step's record with the run's goodput ledger (``SyncAndAck``)."""

from __future__ import annotations

import json
import logging
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from accelerate.utils import broadcast_object_list
from transformers import TrainerCallback

from rollout_api.client import books_now
from trainer_client.grpo_config import AsyncGRPOConfig
from trainer_client.step_timing import COMPUTE_CPU, step_seconds
from trainer_client.train import fsdp
from trainer_client.train.trainer import StepBook, StreamGRPOTrainer
from trainer_client.weights.policy_weights import policy_weights
from trainer_client.weights.push import WeightPusher

logger = logging.getLogger(__name__)

PUSH_ATTEMPTS = 3
"""Failed pushes in a row a trainer lives through (a server that died mid-push fails one)."""
PUSH_RETRY_DELAY_S = 2.0
STEP_LINE = "step %d: reward %.3f, policy v%d, %d groups, dropped stale %d, %.3fs (waiting for groups %.3fs)"
"""The INFO line at the end of each step; benchmarks parse it."""


def scalar_metrics(record: dict[str, Any]) -> dict[str, float]:
    """A step record's numbers for Trainer's log (``reward`` as TRL names it, ``seconds/<phase>``)."""
    metrics: dict[str, float] = {}
    for name, value in record.items():
        if name == "seconds":
            metrics.update({f"seconds/{phase}": float(s) for phase, s in value.items()})
        elif name not in ("step", "group_ids") and isinstance(value, int | float):
            metrics["reward" if name == "reward_mean" else name] = float(value)
    return metrics


class SyncAndAck(TrainerCallback):
    """At the end of each optimizer step: ack its groups, push weights when due, log a record.
    At most one background push is in flight, so vLLM is never more than one push behind."""

    def __init__(self, trainer: StreamGRPOTrainer) -> None:
        self.trainer = trainer
        self._push_in_flight: Future[int] | None = None
        self._in_flight_step = 0
        """The optimizer step whose weights the push in flight carries."""
        self._served_step: int | None = None
        """The optimizer step whose weights vLLM serves (the last committed push); None before the first."""
        self._step_started = time.perf_counter()
        self._failed_pushes = 0  # background pushes failed in a row

    def on_train_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        # vLLM may serve other weights than this trainer's: push first.
        self._push(state)
        if self.trainer.pusher is not None and state.is_world_process_zero and not self.trainer.is_fsdp_enabled:
            # (a sharded model's push is a collective: it waits for the next step's)
            self.trainer.feed.on_weights_wanted = self._push_on_request
        self.trainer.feed.min_version = self.trainer.feed.current_version
        self.trainer.clock.take()  # the first step's clock starts now
        self._step_started = time.perf_counter()
        return control

    def on_pre_optimizer_step(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self._optimizer_started = time.perf_counter()
        self._optimizer_cpu_started = time.thread_time()
        return control

    def on_optimizer_step(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self.trainer.clock.add("optimizer", time.perf_counter() - self._optimizer_started)
        self.trainer.clock.add(COMPUTE_CPU, time.thread_time() - self._optimizer_cpu_started)
        return control

    def _push(self, state) -> None:  # type: ignore[no-untyped-def]
        """Rank 0 pushes; every rank then trains against the version the push produced. A follower
        (no pusher) takes the run's version from the service."""
        trainer = self.trainer
        if trainer.pusher is None:
            run = trainer.feed.call(trainer.feed.client.get_run(trainer.feed.run_id))
            trainer.feed.current_version = run.policy_version
            return
        version = None
        if trainer.is_fsdp_enabled:  # every rank gathers its shards; rank 0 receives and pushes them
            weights = fsdp.gathered_weights(trainer.model)
            if state.is_world_process_zero:
                assert isinstance(trainer.pusher, WeightPusher)
                version = trainer.feed.call(trainer.pusher.push(weights), timeout_s=self._push_timeout_s())
        elif state.is_world_process_zero:
            model = trainer.accelerator.unwrap_model(trainer.model)
            version = trainer.feed.call(trainer.pusher.push_policy(model), timeout_s=self._push_timeout_s())
        if trainer.args.world_size > 1:
            version = broadcast_object_list([version], from_process=0)[0]
        self._pushed(version, state.global_step)

    def _pushed(self, version: int, step: int) -> None:
        """A push of ``step``'s weights committed ``version``; the evaluator may evaluate it."""
        self.trainer.feed.current_version, self.trainer.feed.pushes_owed = version, 0
        self._served_step = step
        if self.trainer.evaluator is not None:
            self.trainer.evaluator.pushed(version)

    def _push_timeout_s(self) -> float:
        """The transfer bound plus the RPCs'."""
        return self.trainer.pusher.timeout_s + 120  # type: ignore[union-attr]

    def _push_in_background(self) -> None:
        """Snapshot the weights and start their push; the trainer goes on at once."""
        trainer = self.trainer
        assert isinstance(trainer.pusher, WeightPusher)
        self._wait_for_push()
        trainer.feed.pushes_owed = 1  # the weights are ahead of vLLM's until a push carries them
        if not trainer.feed.connected:  # the service restarts: the push after it reconnects sends these weights
            logger.warning("the service is unreachable; this step's weights are pushed once it is back")
            return
        with trainer.clock.measure("push_snapshot"):
            model = trainer.accelerator.unwrap_model(trainer.model)
            snapshot = [(name, tensor.detach().clone()) for name, tensor in policy_weights(model)]
        self._in_flight_step = trainer.state.global_step
        self._push_in_flight = trainer.feed.submit(trainer.pusher.push(snapshot))

    def _push_on_request(self, reason: str) -> None:
        """The service asked for the weights (a restarted vLLM server waits for them): push now,
        between groups, on rank 0 only. If vLLM already serves this step's weights it is a
        resend and the version stays."""
        self._wait_for_push()
        trainer = self.trainer
        assert trainer.pusher is not None
        step = trainer.state.global_step
        resend = self._served_step == step
        logger.warning(
            "pushing the weights now, as the service asks%s: %s",
            " (a resend of the version vLLM serves)" if resend else "",
            reason,
        )
        model = trainer.accelerator.unwrap_model(trainer.model)
        for attempt in range(1, PUSH_ATTEMPTS + 1):
            try:
                version = trainer.feed.call(trainer.pusher.push_policy(model, resend), timeout_s=self._push_timeout_s())
                self._pushed(version, step)
                return
            except Exception as exc:
                if attempt == PUSH_ATTEMPTS:
                    raise
                logger.warning("push %d of %d failed (%s); trying again", attempt, PUSH_ATTEMPTS, exc)
                time.sleep(PUSH_RETRY_DELAY_S)  # backoff before retrying a push, not synchronisation

    def _wait_for_push(self) -> None:
        """Wait for the push in flight, if any, and train against the version it produced. A
        failed push leaves vLLM's version and training goes on, up to ``PUSH_ATTEMPTS`` in a row."""
        future, self._push_in_flight = self._push_in_flight, None
        if future is None:
            return
        trainer = self.trainer
        try:
            with trainer.clock.measure("push_wait"):
                version = future.result(timeout=self._push_timeout_s())
        except Exception as exc:
            if not future.done():  # still running: two pushes at once must never happen
                future.cancel()
                raise
            self._failed_pushes += 1  # the weights stay owed: the next push carries them
            if self._failed_pushes >= PUSH_ATTEMPTS:
                raise
            logger.warning(
                "weight push failed (%s); vLLM keeps policy version %d and the next push re-joins",
                exc, trainer.feed.current_version,
            )  # fmt: skip
            return
        self._failed_pushes = 0
        self._pushed(version, self._in_flight_step)

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        trainer = self.trainer
        book, trainer.book = trainer.book, StepBook()
        trained_at = trainer.feed.training_version
        config: AsyncGRPOConfig = trainer.args
        background = trainer.pushes_in_background
        due = state.global_step % config.weight_sync_steps == 0
        if due and not background:
            # Push before acking: an ack frees admission for groups that must sample the new weights.
            self._push(state)
        trainer.feed.ack_trained(list(book.group_ids), trained_at, book.mismatch_kl)
        trainer.feed.ack_dropped_stale(list(book.stale_group_ids))
        trainer.feed.flush_acks()
        record = trainer.step_record(state.global_step, book, trained_at)
        if trainer.evaluator is not None:
            for result in trainer.evaluator.finished():  # the latest lands in this step's record
                if "reward_mean" in result:
                    record["eval_reward_mean"] = result["reward_mean"]
                    record["eval_policy_version"] = result["policy_version"]
        if due and background:
            self._push_in_background()
        now = time.perf_counter()
        phases = trainer.clock.take()
        record["seconds"] = step_seconds(phases, now - self._step_started, not background)
        record["compute_cpu_seconds"] = round(phases.get(COMPUTE_CPU, 0.0), 6)
        if isinstance(pusher := trainer.pusher, WeightPusher):  # so far: a push in flight lands in a later record
            record["push_bytes"], record["delta_repairs"] = pusher.bytes_pushed, pusher.delta_repairs
        self._step_started = now
        if state.is_world_process_zero:
            # as the service has it now: this step's acks may still be on their way
            record.update(trainer.feed.call(books_now(trainer.feed.client, trainer.feed.run_id)))
        trainer.step_metrics = scalar_metrics(record)
        if state.is_world_process_zero:
            path = Path(args.output_dir) / "metrics.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a") as out:
                out.write(json.dumps(record) + "\n")
        logger.info(
            STEP_LINE,
            record["step"],
            record["reward_mean"],
            record["policy_version"],
            record["groups"],
            record["dropped_stale"],
            record["seconds"]["step"],
            record["seconds"]["wait_groups"],
        )
        return control

    def on_train_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self._wait_for_push()  # the last push lands before the run reports its version
        if self.trainer.evaluator is not None:
            self.trainer.evaluator.wait()
        return control
