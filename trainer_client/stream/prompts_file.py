"""The user's prompts, in TRL's dataset format, as a run's prompts.

A source is a JSONL, Parquet or CSV file, a folder of them, a saved ``datasets`` dataset,
reasoning-gym's generated tasks (``reasoning_gym:...``), or rows in memory. The prompt column
is a string or a list of chat messages; every other column travels as metadata (strings as
they are, other values as JSON) and reaches the reward functions as a keyword argument, as TRL
passes dataset columns. ``PromptRows`` checks the whole source when made, so a bad row fails
before anything starts, and reads it again per iteration.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from rollout_api import rollout_pb2 as pb
from rollout_common import reasoning_gym_tasks

PROMPT_COLUMN = "prompt"
DATASETS_FORMATS = {".parquet": "parquet", ".csv": "csv"}
"""File suffixes read with ``datasets`` (JSONL is read here, without it)."""
JSONL_SUFFIXES = (".jsonl", ".json")

Row = tuple[str, Mapping[str, Any]]
"""Where a row came from (``file:line`` or ``file row N``), and the row."""


class PromptsFileError(ValueError):
    """The prompts cannot be used; the message names the line or row and what to change."""


def prompt_from_row(row: Mapping[str, Any], where: str, prompt_column: str) -> pb.Prompt:
    if not isinstance(row, Mapping) or prompt_column not in row:
        raise PromptsFileError(
            f"{where} has no {prompt_column!r} column; give a string or a list of chat messages "
            "(or name the column with --prompt-column)"
        )
    content = row[prompt_column]
    metadata = {
        str(key): value if isinstance(value, str) else json.dumps(value)
        for key, value in row.items()
        if key != prompt_column
    }
    prompt = pb.Prompt(metadata=metadata)
    if isinstance(content, str):
        prompt.text = content
    elif isinstance(content, list) and content and all(_is_message(m) for m in content):
        prompt.messages.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"]) for m in content)
    else:
        raise PromptsFileError(
            f"{where}: {prompt_column!r} must be a string or a non-empty list of "
            "{'role': ..., 'content': ...} messages"
        )
    return prompt


def _is_message(message: Any) -> bool:
    return (
        isinstance(message, Mapping)
        and isinstance(message.get("role"), str)
        and isinstance(message.get("content"), str)
    )


def _jsonl_rows(path: Path) -> Iterator[Row]:
    try:
        with path.open() as lines:
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                where = f"{path}:{number}"
                try:
                    yield where, json.loads(line)
                except json.JSONDecodeError as exc:
                    raise PromptsFileError(f"{where} is not JSON ({exc.msg}); write one JSON object per line") from None
    except OSError as exc:
        raise PromptsFileError(f"cannot read {path}: {exc}") from None


def _dataset_rows(path: Path) -> Iterator[Row]:
    try:
        import datasets
    except ImportError:
        raise PromptsFileError(
            "reading Parquet, CSV or a saved dataset needs the datasets package: pip install datasets "
            "(JSONL needs nothing)"
        ) from None
    if path.is_dir():
        rows = datasets.load_from_disk(str(path))
    else:
        kind = DATASETS_FORMATS[path.suffix.lower()]
        rows = datasets.load_dataset(kind, data_files=str(path), split="train", streaming=True)
    for number, row in enumerate(rows, 1):
        yield f"{path} row {number}", row


def file_rows(path: Path) -> Callable[[], Iterator[Row]]:
    """A function that reads ``path``'s rows afresh each call."""
    if (path / "dataset_info.json").is_file() or (path / "state.json").is_file():  # a saved dataset
        return lambda: _dataset_rows(path)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix.lower() in (*JSONL_SUFFIXES, *DATASETS_FORMATS))
        if not files:
            raise PromptsFileError(f"{path} holds no .jsonl, .parquet or .csv file and is not a saved dataset")
        readers = [file_rows(file) for file in files]
        return lambda: (row for read in readers for row in read())
    if not path.exists():
        raise PromptsFileError(f"cannot read {path}: no such file or folder")
    if path.suffix.lower() in JSONL_SUFFIXES:
        return lambda: _jsonl_rows(path)
    if path.suffix.lower() in DATASETS_FORMATS:
        return lambda: _dataset_rows(path)
    raise PromptsFileError(
        f"{path}: give a .jsonl, .parquet or .csv file, a folder of them, or a folder saved with save_to_disk"
    )


class PromptRows:
    """Prompts read from a source each time they are iterated, checked whole once."""

    def __init__(self, read: Callable[[], Iterator[Row]], prompt_column: str, name: str) -> None:
        self._read = read
        self.prompt_column = prompt_column
        self.name = name
        self.count = 0
        self.bytes = 0
        for prompt in self:
            self.count += 1
            self.bytes += prompt.ByteSize()
        if not self.count:
            raise PromptsFileError(f"{name} has no prompts; give rows with a {prompt_column!r} column")

    @classmethod
    def from_source(cls, source: str, prompt_column: str = PROMPT_COLUMN) -> PromptRows:
        """``--prompts``: a path, or ``reasoning_gym:...`` for reasoning-gym's generated tasks."""
        if not source.startswith(reasoning_gym_tasks.PREFIX):
            return cls(file_rows(Path(source)), prompt_column, source)
        spec = reasoning_gym_tasks.parse_spec(source)
        tasks = reasoning_gym_tasks.task_rows
        return cls(lambda: ((f"{source} entry {i}", row) for i, row in enumerate(tasks(spec))), PROMPT_COLUMN, source)

    @classmethod
    def from_rows(cls, rows: Iterable[Mapping[str, Any]], prompt_column: str = PROMPT_COLUMN) -> PromptRows:
        """Rows in memory (a ``datasets.Dataset``, dicts); a one-shot iterator is kept in a list."""
        if iter(rows) is rows:
            rows = list(rows)
        return cls(lambda: ((f"row {i}", row) for i, row in enumerate(rows, 1)), prompt_column, "the rows")

    def __iter__(self) -> Iterator[pb.Prompt]:
        for where, row in self._read():
            yield prompt_from_row(row, where, self.prompt_column)
