"""A JSONL of prompts in TRL's format: text or chat prompts, the other columns as metadata
(the reward functions' keyword arguments), and bad lines named with what to change."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer_client.prompts_file import PromptsFileError, load_prompts_file


def write(path: Path, *lines: str) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def test_text_and_chat_prompts_keep_their_columns_as_metadata(tmp_path: Path) -> None:
    rows = [
        {"prompt": "2+3=", "answer": "5"},
        {"prompt": [{"role": "user", "content": "4+4?"}], "answer": 8, "tags": ["easy"]},
    ]
    prompts = load_prompts_file(write(tmp_path / "p.jsonl", *(json.dumps(r) for r in rows), ""))
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
        load_prompts_file(write(tmp_path / "p.jsonl", '{"prompt": "ok"}', line))


def test_an_empty_or_missing_file_says_so(tmp_path: Path) -> None:
    with pytest.raises(PromptsFileError, match="has no prompts"):
        load_prompts_file(write(tmp_path / "p.jsonl", ""))
    with pytest.raises(PromptsFileError, match="cannot read"):
        load_prompts_file(tmp_path / "missing.jsonl")
