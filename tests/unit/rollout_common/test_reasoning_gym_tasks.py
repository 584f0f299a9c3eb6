"""reasoning-gym's tasks: the spec's forms and errors, the prompts generated, and the service's
``reasoning_gym`` reward against reasoning-gym's own ``score_answer`` (parity)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from reasoning_gym.utils import extract_answer

from rollout_common.reasoning_gym_tasks import (
    ENTRY_COLUMN,
    ReasoningGymSpec,
    TaskSpecError,
    make_dataset,
    parse_spec,
    task_rows,
)
from rollout_service.scoring.rewards import RewardInputs, call_reward, reasoning_gym
from trainer_client.stream.prompts_file import PromptRows

pytestmark = pytest.mark.timeout(120)

MIXED = "reasoning_gym:basic_arithmetic=2,leg_counting,spell_backward,chain_sum?size=40&seed=3"


def test_the_spec_names_datasets_weights_size_and_seed() -> None:
    spec = parse_spec(MIXED)
    assert spec.weights == {"basic_arithmetic": 2.0, "leg_counting": 1.0, "spell_backward": 1.0, "chain_sum": 1.0}
    assert (spec.size, spec.seed) == (40, 3)
    assert parse_spec("reasoning_gym:leg_counting") == ReasoningGymSpec({"leg_counting": 1.0}, size=1000, seed=0)


def test_a_spec_file_gives_each_dataset_its_config(tmp_path: Path) -> None:
    path = tmp_path / "tasks.yaml"
    datasets = "datasets:\n  leg_counting: 2\n  basic_arithmetic:\n    config: {min_terms: 2, max_terms: 2}\n"
    path.write_text(f"size: 5\nseed: 1\n{datasets}")
    spec = parse_spec(f"reasoning_gym:{path}")
    assert spec.weights == {"leg_counting": 2, "basic_arithmetic": 1}
    assert spec.configs["basic_arithmetic"] == {"min_terms": 2, "max_terms": 2}
    entries = list(make_dataset(spec))
    arithmetic = [e for e in entries if e["metadata"]["source_dataset"] == "basic_arithmetic"]
    assert len(entries) == 5 and arithmetic and all(e["metadata"]["num_terms"] == 2 for e in arithmetic)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("reasoning_gym:", "name at least one"),
        ("reasoning_gym:leg_counting=0", "positive number"),
        ("reasoning_gym:leg_counting=x", "not a number"),
        ("reasoning_gym:leg_counting?size=0", "at least 1"),
        ("reasoning_gym:leg_counting?sise=5", "unknown option sise"),
        ("reasoning_gym:no_such_set", "no dataset 'no_such_set'; it has "),
        ("reasoning_gym:missing.yaml", "cannot read the reasoning-gym spec"),
    ],
)
def test_a_bad_spec_says_what_to_change(text: str, says: str) -> None:
    with pytest.raises(TaskSpecError, match=says):
        PromptRows.from_source(text)


def test_the_prompts_are_reasoning_gyms_questions_in_chat_form_with_their_entries() -> None:
    spec = parse_spec(MIXED)
    rows = PromptRows.from_source(MIXED)
    entries = list(make_dataset(spec))
    assert rows.count == 40
    prompts = list(rows)
    assert [p.messages.messages[1].content for p in prompts] == [e["question"] for e in entries]
    assert "<answer>" in prompts[0].messages.messages[0].content  # reasoning-gym's system prompt
    assert {e["metadata"]["source_dataset"] for e in entries} == set(spec.weights)  # every dataset is in the mix
    assert [json.loads(p.metadata[ENTRY_COLUMN])["answer"] for p in prompts] == [e["answer"] for e in entries]


async def test_the_reward_equals_reasoning_gyms_own_score_answer() -> None:
    """Right, wrong, untagged and padded answers, over four datasets, scored as the service calls a
    reward (chat completions, the entry column as a keyword), against the generating dataset."""
    dataset = make_dataset(parse_spec(MIXED))
    rows = list(task_rows(parse_spec(MIXED)))
    checked = 0
    for entry, row in zip(dataset, rows, strict=True):
        answer = entry["answer"]
        texts = [
            f"<answer>{answer}</answer>",
            f"Let me think.\n<answer> {answer} </answer>",
            f"<answer>{answer}0</answer>",
            str(answer),
            "",
        ]
        completions = [[{"role": "assistant", "content": text}] for text in texts]
        size = len(texts)
        inputs = RewardInputs(
            [row["prompt"]] * size, completions, [[1]] * size, {ENTRY_COLUMN: [row[ENTRY_COLUMN]] * size}
        )
        ours = await call_reward("reasoning_gym", reasoning_gym, inputs, timeout_s=30)
        theirs = [dataset.score_answer(extract_answer(text), entry) for text in texts]
        assert ours == pytest.approx(theirs), (entry["metadata"]["source_dataset"], texts)
        assert ours[0] == 1.0
        checked += 1
    assert checked == 40


def test_the_reward_refuses_prompts_that_are_not_reasoning_gyms() -> None:
    with pytest.raises(ValueError, match="no reasoning_gym_entry column"):
        reasoning_gym(["q"], ["a"], [[1]])
