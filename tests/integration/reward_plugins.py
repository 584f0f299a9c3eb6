"""Reward functions loaded through the ``reward_modules`` setting by the failure tests."""

import asyncio


def always_raises(prompts, completions, completion_ids, **kwargs):
    raise RuntimeError("this reward is broken on purpose")


async def hangs(prompts, completions, completion_ids, **kwargs):
    await asyncio.Event().wait()


def constant(prompts, completions, completion_ids, **kwargs):
    return [1.0 for _ in completions]


REWARD_FUNCTIONS = {"always_raises": always_raises, "hangs": hangs, "constant": constant}
