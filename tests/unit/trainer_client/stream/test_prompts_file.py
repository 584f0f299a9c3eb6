"""A JSONL of prompts in TRL's format: text or chat prompts, the other columns as metadata
(the reward functions' keyword arguments), and bad lines named with what to change."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer_client.stream.prompts_file import PromptRows, PromptsFileError


def write(path: Path, *lines: str) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def test_text_and_chat_prompts_keep_their_columns_as_metadata(tmp_path: Path) -> None:
    rows = [
        {"prompt": "2+3=", "answer": "5"},
        {"prompt": [{"role": "user", "content": "4+4?"}], "answer": 8, "tags": ["easy"]},
    ]
    prompts = list(PromptRows.from_source(str(write(tmp_path / "p.jsonl", *(json.dumps(r) for r in rows), ""))))
    assert prompts[0].text == "2+3=" and dict(prompts[0].metadata) == {"answer": "5"}
    assert [(m.role, m.content) for m in prompts[1].messages.messages] == [("user", "4+4?")]
    assert dict(prompts[1].metadata) == {"answer": "8", "tags": '["easy"]'}  # non-strings as JSON


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", r"p.jsonl:2 is not JSON"),
        ('{"question": "x"}', r"p.jsonl:2 has no 'prompt' column"),
        ('{"prompt": [{"role": "user"}]}', r"p.jsonl:2: 'prompt' must be a string or a non-empty list"),
        ('{"prompt": 3}', r"p.jsonl:2: 'prompt' must be a string"),
    ],
)
def test_a_bad_line_is_named_with_what_to_change(tmp_path: Path, line: str, message: str) -> None:
    with pytest.raises(PromptsFileError, match=message):
        PromptRows.from_source(str(write(tmp_path / "p.jsonl", '{"prompt": "ok"}', line)))


def test_an_empty_or_missing_file_says_so(tmp_path: Path) -> None:
    with pytest.raises(PromptsFileError, match="has no prompts"):
        PromptRows.from_source(str(write(tmp_path / "p.jsonl", "")))
    with pytest.raises(PromptsFileError, match="cannot read"):
        PromptRows.from_source(str(tmp_path / "missing.jsonl"))


ROWS = [
    {"question": "2+3=", "answer": "5"},
    {"question": "4+4=", "answer": "8"},
    {"question": "1+6=", "answer": "7"},
]


def expect_rows(prompts: list) -> None:
    assert [p.text for p in prompts] == [r["question"] for r in ROWS]
    assert [dict(p.metadata) for p in prompts] == [{"answer": r["answer"]} for r in ROWS]


def test_parquet_csv_a_saved_dataset_and_a_folder_read_alike(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    table = datasets.Dataset.from_list(ROWS)
    table.to_parquet(str(tmp_path / "p.parquet"))
    table.to_csv(str(tmp_path / "p.csv"), index=False)
    table.save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "folder").mkdir()
    write(tmp_path / "folder" / "a.jsonl", *(json.dumps(r) for r in ROWS[:2]))
    write(tmp_path / "folder" / "b.jsonl", json.dumps(ROWS[2]))
    for source in ("p.parquet", "p.csv", "saved", "folder"):
        rows = PromptRows.from_source(str(tmp_path / source), prompt_column="question")
        assert rows.count == 3, source
        expect_rows(list(rows))
        expect_rows(list(rows))  # read again, not kept


def test_rows_in_memory_a_datasets_dataset_or_dicts(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    expect_rows(list(PromptRows.from_rows(datasets.Dataset.from_list(ROWS), "question")))
    once = PromptRows.from_rows(iter(ROWS), "question")  # a one-shot iterator is kept
    expect_rows(list(once))
    expect_rows(list(once))


def test_a_bad_row_of_any_format_is_named_before_anything_starts(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(ROWS).to_parquet(str(tmp_path / "p.parquet"))
    with pytest.raises(PromptsFileError, match=r"p.parquet row 1 has no 'prompt' column.*--prompt-column"):
        PromptRows.from_source(str(tmp_path / "p.parquet"))
    with pytest.raises(PromptsFileError, match=r"give a .jsonl, .parquet or .csv file"):
        PromptRows.from_source(str(write(tmp_path / "p.txt", "2+3=")))
