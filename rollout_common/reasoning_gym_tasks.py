"""reasoning-gym's procedural tasks as a run's prompts, scored by each dataset's own scorer.

``reasoning_gym:NAME[=WEIGHT][,NAME[=WEIGHT]...][?size=N&seed=S]`` (or ``reasoning_gym:FILE.yaml``
for per-dataset configs) names the tasks. The trainer generates the prompts here, with no
download; each prompt carries its entry as JSON in the ``reasoning_gym_entry`` column, so the
service's ``reasoning_gym`` reward scores a completion exactly as reasoning-gym would: the
answer between ``<answer>`` tags, given to ``score_answer`` with the entry.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import parse_qsl

import yaml

PREFIX = "reasoning_gym:"
ENTRY_COLUMN = "reasoning_gym_entry"
INSTALL = "pip install 'rollout-service[reasoning-gym]'"
FORMAT = "reasoning_gym:NAME[=WEIGHT][,NAME[=WEIGHT]...][?size=N&seed=S], or reasoning_gym:FILE.yaml"


class TaskSpecError(ValueError):
    """The tasks cannot be made; the message says what to change."""


@dataclass(frozen=True)
class ReasoningGymSpec:
    """Which datasets, mixed by weight, and how many entries from which seed."""

    weights: Mapping[str, float]
    size: int = 1000
    seed: int = 0
    configs: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """Each dataset's own config (its ``*Config`` fields), by name."""

    def __post_init__(self) -> None:
        if not self.weights:
            raise TaskSpecError(f"name at least one reasoning-gym dataset: {FORMAT}")
        for name, weight in self.weights.items():
            if not (isinstance(weight, int | float) and math.isfinite(weight) and weight > 0):
                raise TaskSpecError(f"dataset {name!r} has weight {weight!r}; give a positive number")
        if not (isinstance(self.size, int) and self.size > 0):
            raise TaskSpecError(f"size is {self.size!r}; give the number of prompts, at least 1")


def parse_spec(text: str) -> ReasoningGymSpec:
    body = text.removeprefix(PREFIX)
    if body.endswith((".yaml", ".yml", ".json")):
        return _spec_file(Path(body))
    names, _, query = body.partition("?")
    weights: dict[str, float] = {}
    for part in filter(None, names.split(",")):
        name, _, weight = part.partition("=")
        weights[name.strip()] = _number(weight or "1", f"the weight of {name!r}", float)
    options = dict(parse_qsl(query, strict_parsing=bool(query))) if query else {}
    unknown = set(options) - {"size", "seed"}
    if unknown:
        raise TaskSpecError(f"unknown option {', '.join(sorted(unknown))} in {text!r}; the options are size and seed")
    size = _number(options.get("size", "1000"), "size", int)
    seed = _number(options.get("seed", "0"), "seed", int)
    return ReasoningGymSpec(weights, size=size, seed=seed)


def _number(text: str, what: str, kind: Callable[[str], Any]) -> Any:
    try:
        return kind(text)
    except ValueError:
        raise TaskSpecError(f"{what} is {text!r}, not a number; write {FORMAT}") from None


def _spec_file(path: Path) -> ReasoningGymSpec:
    """``{size, seed, datasets: {NAME: {weight, config}}}``; a dataset may be given as just its weight."""
    try:
        document = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise TaskSpecError(f"cannot read the reasoning-gym spec {path}: {exc}") from None
    if not isinstance(document, dict) or not isinstance(document.get("datasets"), dict):
        raise TaskSpecError(f"{path} needs a 'datasets' mapping of NAME: {{weight, config}} (size and seed optional)")
    weights, configs = {}, {}
    for name, entry in document["datasets"].items():
        entry = entry if isinstance(entry, dict) else {"weight": entry if entry is not None else 1}
        unknown = set(entry) - {"weight", "config"}
        if unknown:
            raise TaskSpecError(f"{path}: dataset {name!r} has {', '.join(sorted(unknown))}; give weight and config")
        weights[str(name)] = entry.get("weight", 1)
        configs[str(name)] = entry.get("config") or {}
    unknown = set(document) - {"datasets", "size", "seed"}
    if unknown:
        raise TaskSpecError(f"{path} has {', '.join(sorted(unknown))}; the keys are datasets, size and seed")
    return ReasoningGymSpec(weights, size=document.get("size", 1000), seed=document.get("seed", 0), configs=configs)


def _library() -> ModuleType:
    try:
        import reasoning_gym
    except ImportError:
        raise TaskSpecError(f"reasoning-gym tasks need the reasoning-gym package: {INSTALL}") from None
    return reasoning_gym


def make_dataset(spec: ReasoningGymSpec) -> Any:
    """reasoning-gym's own dataset: the one named, or its ``composite`` of several, by weight."""
    rg = _library()
    from reasoning_gym.composite import DatasetSpec

    known = set(rg.factory.DATASETS)
    unknown = [name for name in spec.weights if name not in known]
    if unknown:
        raise TaskSpecError(
            f"reasoning-gym has no dataset {', '.join(map(repr, unknown))}; it has {', '.join(sorted(known))}"
        )
    try:
        if len(spec.weights) == 1:
            [name] = spec.weights
            return rg.create_dataset(name, size=spec.size, seed=spec.seed, **spec.configs.get(name, {}))
        parts = [
            DatasetSpec(name=name, weight=weight, config=dict(spec.configs.get(name, {})))
            for name, weight in spec.weights.items()
        ]
        return rg.create_dataset("composite", size=spec.size, seed=spec.seed, datasets=parts)
    except (TypeError, ValueError, AssertionError) as exc:
        raise TaskSpecError(f"reasoning-gym refused the spec: {exc}") from None


def task_rows(spec: ReasoningGymSpec) -> Iterator[dict[str, Any]]:
    """The prompts in TRL's format: reasoning-gym's system prompt and the question, and the entry."""
    _library()
    from reasoning_gym.utils import SYSTEM_PROMPTS

    for entry in make_dataset(spec):
        messages = [
            {"role": "system", "content": SYSTEM_PROMPTS["default"]},
            {"role": "user", "content": entry["question"]},
        ]
        yield {"prompt": messages, ENTRY_COLUMN: json.dumps(entry, default=_jsonable)}


def _jsonable(value: Any) -> Any:
    if isinstance(value, set | frozenset):
        return sorted(value, key=repr)
    if hasattr(value, "tolist"):  # numpy scalars and arrays
        return value.tolist()
    return repr(value)


def score(completion_text: str, entry_json: str) -> float:
    """reasoning-gym's score of a completion: the answer in its ``<answer>`` tags, by the entry's dataset."""
    entry = json.loads(entry_json)
    answer = _extract_answer()(completion_text)
    return float(_scorer(entry["metadata"]["source_dataset"])(answer, entry))


@functools.cache
def _scorer(name: str) -> Callable[[str | None, dict[str, Any]], float]:
    return _library().get_score_answer_fn(name)


@functools.cache
def _extract_answer() -> Callable[[str], str | None]:
    _library()
    from reasoning_gym.utils import extract_answer

    return extract_answer
