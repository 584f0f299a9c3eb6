"""Which checkpoint ``--resume_from_checkpoint`` names, and what it says when it names none."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer_client.train.checkpoints import RUN_FILE, CheckpointError, find_checkpoint


def write_checkpoint(folder: Path, step: int, run_id: str) -> None:
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    (folder / RUN_FILE).write_text(json.dumps({"run_id": run_id, "step": step}))


def test_latest_is_the_newest_checkpoint_of_the_output_dir_with_its_run(tmp_path: Path) -> None:
    write_checkpoint(tmp_path / "checkpoint-5", 5, "run-a")
    write_checkpoint(tmp_path / "checkpoint-10", 10, "run-a")
    found = find_checkpoint("latest", tmp_path)
    assert (found.path, found.step, found.run_id) == (tmp_path / "checkpoint-10", 10, "run-a")
    assert find_checkpoint(str(tmp_path / "checkpoint-5"), None).step == 5  # a folder needs no --output_dir


def test_latest_without_an_output_dir_says_where_it_looks(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"looks in --output_dir: give the folder the run wrote"):
        find_checkpoint("latest", None)
    with pytest.raises(CheckpointError, match="no checkpoint-N folder"):
        find_checkpoint("latest", tmp_path)
