"""Trainer checkpoints that re-join their run: transformers' Trainer saves the model, optimizer
and step; ``RunInCheckpoint`` adds the run id, so a resumed trainer consumes the same run.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

logger = logging.getLogger(__name__)

RUN_FILE = "rollout_run.json"
LATEST = ("latest", "true", "True")
"""``resume_from_checkpoint`` values that mean the newest checkpoint in ``output_dir``."""


class CheckpointError(ValueError):
    """The checkpoint cannot be resumed; the message says what to change."""


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int
    run_id: str | None
    """The run it trained on; None for a checkpoint written by another tool."""


def find_checkpoint(resume_from: str, output_dir: Path | None) -> Checkpoint:
    """``resume_from``: a checkpoint folder, or ``latest`` for the newest in ``output_dir``
    (None: not given, so the run's own folder is not known yet)."""
    if resume_from in LATEST:
        if output_dir is None:
            raise CheckpointError(
                f"--resume_from_checkpoint {resume_from} looks in --output_dir: give the folder the run wrote "
                "(outputs/<run id>), or the checkpoint-N folder itself"
            )
        found = get_last_checkpoint(str(output_dir)) if output_dir.is_dir() else None
        if found is None:
            raise CheckpointError(f"no {PREFIX_CHECKPOINT_DIR}-N folder in {output_dir} to resume from")
        path = Path(found)
    else:
        path = Path(resume_from)
    state = path / "trainer_state.json"
    if not state.is_file():
        raise CheckpointError(f"{path} is not a trainer checkpoint (no trainer_state.json); give a checkpoint-N folder")
    step = int(json.loads(state.read_text())["global_step"])
    run_file = path / RUN_FILE
    run_id = json.loads(run_file.read_text())["run_id"] if run_file.is_file() else None
    return Checkpoint(path, step, run_id)


def drop_records_after(metrics: Path, step: int) -> None:
    """Forget the metrics of steps after the checkpoint: they are trained again."""
    if not metrics.is_file():
        return
    kept = [line for line in metrics.read_text().splitlines() if line and json.loads(line)["step"] <= step]
    metrics.write_text("".join(f"{line}\n" for line in kept))


class RunInCheckpoint(TrainerCallback):
    """Write the run id into every checkpoint (rank 0), for ``find_checkpoint``."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id

    def on_save(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if state.is_world_process_zero:
            folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / RUN_FILE).write_text(json.dumps({"run_id": self.run_id, "step": state.global_step}))
            logger.info("checkpoint %s (run %s)", folder, self.run_id)
        return control
