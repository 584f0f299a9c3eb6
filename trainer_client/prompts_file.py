"""A JSONL file of prompts, in TRL's dataset format, as the run's prompts.

One JSON object per line. ``prompt`` is the prompt: a string (TRL's standard format, sent
as plain text) or a list of ``{"role", "content"}`` messages (TRL's conversational format,
rendered with the model's chat template). Every other column rides along as prompt metadata
and reaches the reward functions as a keyword argument of the same name, as TRL passes
dataset columns: ``{"prompt": "2+3=", "answer": "5"}`` gives each call ``answer=[...]``.
Metadata travels as text: strings as they are, other values as JSON.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rollout_api import rollout_pb2 as pb

PROMPT_COLUMN = "prompt"


class PromptsFileError(ValueError):
    """The file cannot be used; the message names the line and what to change."""


def load_prompts_file(path: Path) -> list[pb.Prompt]:
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise PromptsFileError(f"cannot read {path}: {exc}") from None
    prompts = [_prompt(path, number, line) for number, line in enumerate(lines, 1) if line.strip()]
    if not prompts:
        raise PromptsFileError(f"{path} has no prompts; write one JSON object per line with a 'prompt' column")
    return prompts


def _prompt(path: Path, number: int, line: str) -> pb.Prompt:
    where = f"{path}:{number}"
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise PromptsFileError(f"{where} is not JSON ({exc.msg}); write one JSON object per line") from None
    if not isinstance(row, dict) or PROMPT_COLUMN not in row:
        raise PromptsFileError(f"{where} has no 'prompt' column; give a string or a list of chat messages")
    content = row.pop(PROMPT_COLUMN)
    metadata = {str(key): value if isinstance(value, str) else json.dumps(value) for key, value in row.items()}
    prompt = pb.Prompt(metadata=metadata)
    if isinstance(content, str):
        prompt.text = content
    elif isinstance(content, list) and content and all(_is_message(m) for m in content):
        prompt.messages.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"]) for m in content)
    else:
        raise PromptsFileError(
            f"{where}: 'prompt' must be a string or a non-empty list of {{'role': ..., 'content': ...}} messages"
        )
    return prompt


def _is_message(message: Any) -> bool:
    return (
        isinstance(message, dict) and isinstance(message.get("role"), str) and isinstance(message.get("content"), str)
    )
