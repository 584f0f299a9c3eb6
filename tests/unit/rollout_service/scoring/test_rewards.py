import asyncio
import math

import pytest

from rollout_service.errors import InvalidArgument, RewardError
from rollout_service.scoring.rewards import RewardInputs, RewardRegistry, call_reward, char_fraction, exact_answer


def test_char_fraction_counts_non_space_characters() -> None:
    assert char_fraction(["p"] * 3, ["a a b", "", "xyz"], [[1], [], [2]], target_char=["a", "a", "x"]) == [
        pytest.approx(2 / 3),
        0.0,
        pytest.approx(1 / 3),
    ]


def test_exact_answer_reads_the_first_number() -> None:
    assert exact_answer(["p"] * 3, ["it is 42.", "7 or 42", "none"], [[], [], []], answer=["42", "42", "1"]) == [
        1.0,
        0.0,
        0.0,
    ]


def test_unknown_reward_lists_the_registered_ones() -> None:
    with pytest.raises(InvalidArgument, match=r"unknown reward function 'nope'; registered: char_fraction"):
        RewardRegistry().get("nope")


async def _call(function, timeout_s: float = 5.0) -> list[float]:
    return await call_reward("f", function, RewardInputs(["p", "q"], ["a", "b"], [[1], [2]], {}), timeout_s)


async def test_sync_and_async_functions_and_none_as_nan() -> None:
    def sync_fn(prompts, completions, completion_ids, **kw):
        return [1, None]

    async def async_fn(prompts, completions, completion_ids, **kw):
        return [0.5, 0.25]

    values = await _call(sync_fn)
    assert values[0] == 1.0 and math.isnan(values[1])
    assert await _call(async_fn) == [0.5, 0.25]


@pytest.mark.parametrize(
    ("function", "message"),
    [
        (lambda prompts, completions, completion_ids, **kw: 1 / 0, "raised ZeroDivisionError"),
        (lambda prompts, completions, completion_ids, **kw: [1.0], "expected a list of 2"),
        (lambda prompts, completions, completion_ids, **kw: ["x", 1.0], "non-number"),
        # NaN means "no reward" inside the service; a NaN or inf a function returns is its bug.
        (lambda prompts, completions, completion_ids, **kw: [float("nan"), 1.0], "returned nan for completion 0"),
        (lambda prompts, completions, completion_ids, **kw: [1.0, float("-inf")], "returned -inf for completion 1"),
        (lambda prompts, completions, completion_ids, **kw: [10**400, 1.0], "non-number"),
    ],
)
async def test_bad_reward_functions_raise_reward_error(function, message: str) -> None:
    with pytest.raises(RewardError, match=message):
        await _call(function)


async def test_hanging_reward_times_out() -> None:
    release = asyncio.Event()

    async def hangs(prompts, completions, completion_ids, **kw):
        await release.wait()
        return [0.0, 0.0]

    with pytest.raises(RewardError, match="took longer than"):
        await _call(hangs, timeout_s=0.05)


def test_load_module_requires_reward_functions_dict() -> None:
    with pytest.raises(ValueError, match="REWARD_FUNCTIONS"):
        RewardRegistry().load_module("json")


def test_a_module_function_is_registered_under_that_name() -> None:
    registry = RewardRegistry()
    registry.load_module("statistics:fmean")
    assert registry.get("statistics:fmean")([1.0, 3.0]) == 2.0
    with pytest.raises(ValueError, match="module statistics has no function 'no_such'"):
        registry.load_module("statistics:no_such")
