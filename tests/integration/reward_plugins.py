"""Reward functions loaded through the ``reward_modules`` setting by the integration tests:
broken ones (faults/test_failures.py), and TRL's own, unchanged, beside a recorder of what reward
functions are given (test_trl_rewards.py)."""

import asyncio
import os
import threading
from pathlib import Path

from trl.rewards import get_repetition_penalty_reward, get_soft_overlong_punishment, think_format_reward


def always_raises(prompts, completions, completion_ids, **kwargs):
    raise RuntimeError("this reward is broken on purpose")


def fails_on_marked(prompts, completions, completion_ids, **kwargs):
    """Raises for prompts that say FAIL, scores the rest: some groups of a run fail, the others go on."""
    if "FAIL" in str(prompts):
        raise RuntimeError("this prompt's reward is broken on purpose")
    return [1.0 for _ in completions]


def returns_nan(prompts, completions, completion_ids, **kwargs):
    return [float("nan") for _ in completions]


async def hangs(prompts, completions, completion_ids, **kwargs):
    await asyncio.Event().wait()


def hangs_in_a_thread(prompts, completions, completion_ids, **kwargs):
    """A sync reward that never returns: it holds its worker thread (say where it is first)."""
    marker = os.environ.get("HANGING_REWARD_MARKER")
    if marker:
        Path(marker).touch()
    threading.Event().wait()


def constant(prompts, completions, completion_ids, **kwargs):
    return [1.0 for _ in completions]


def exact_match(completions, answer, **kwargs):
    """TRL style: 1.0 when the completion's text is exactly the prompt's ``answer``."""
    return [float(c[0]["content"] == a) for c, a in zip(completions, answer, strict=True)]


RECORDED: list[dict] = []
"""Every call of ``record_inputs``: its keyword arguments (the service runs in the test's process)."""
_RECORDED_LOCK = threading.Lock()


def record_inputs(**kwargs):
    with _RECORDED_LOCK:
        RECORDED.append(kwargs)
    return [0.0 for _ in kwargs["completions"]]


TRL_REWARDS = {
    "trl_think_format": think_format_reward,
    "trl_repetition_penalty": get_repetition_penalty_reward(ngram_size=2),
    "trl_soft_overlong": get_soft_overlong_punishment(max_completion_len=16, soft_punish_cache=8),
}
"""TRL's reward functions as ``trl.rewards`` ships them (accuracy_reward needs math_verify)."""

REWARD_FUNCTIONS = {
    "always_raises": always_raises,
    "fails_on_marked": fails_on_marked,
    "returns_nan": returns_nan,
    "hangs": hangs,
    "hangs_in_a_thread": hangs_in_a_thread,
    "constant": constant,
    "exact_match": exact_match,
    "record_inputs": record_inputs,
    **TRL_REWARDS,
}
