"""Tools and an environment loaded through the ``tool_modules`` / ``environment_modules`` settings."""

from __future__ import annotations

from rollout_service.generation.environments import GuessNumber


def shout(text: str) -> str:
    """Upper-case a text.

    Args:
        text: what to shout
    """
    return text.upper()


TOOL_FUNCTIONS = {"shout": shout}
ENVIRONMENTS = {"guess_again": GuessNumber}
