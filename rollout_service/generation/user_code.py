"""Calling user code (tools, environments) from the event loop without blocking it."""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any


async def call_user_function(function: Callable[..., Any], executor: Executor | None, *args: Any, **kwargs: Any) -> Any:
    """Await an ``async def`` on the loop, run a sync one in ``executor`` (awaiting what it returns)."""
    if inspect.iscoroutinefunction(function):
        return await function(*args, **kwargs)
    call = functools.partial(function, *args, **kwargs)
    result = await asyncio.get_running_loop().run_in_executor(executor, call)
    if inspect.isawaitable(result):
        result = await result
    return result
