"""The guard takes vLLM's whole process group down with the service that started it, even
when the service is SIGKILLed, and exits as the command it runs does. Real processes
(``python``, ``sleep``) stand in for vLLM's API server and engine core."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest

from rollout_service.engine import vllm_guard
from tests.support import started, wait_until

# An API server with an engine core: a child that starts a grandchild and waits on it.
CHILD_WITH_GRANDCHILD = [sys.executable, "-c", "import subprocess; subprocess.Popen(['sleep', '600']).wait()"]

# A service: starts the guard in a session of its own, as ManagedVLLMServer does, and lives until killed.
SERVICE = """
import os, subprocess, sys
sys.path.insert(0, os.path.dirname(sys.argv[1]))
import vllm_guard
subprocess.Popen(vllm_guard.launcher(os.getpid(), None, 0, sys.argv[2:]), start_new_session=True)
sys.stdin.read()
"""


def children(pid: int) -> list[int]:
    return [child for child, state, parent, _, _ in vllm_guard.processes() if parent == pid and state != "Z"]


def start_service(command: list[str]) -> subprocess.Popen[bytes]:
    """A stand-in service whose guard runs ``command``."""
    return subprocess.Popen([sys.executable, "-c", SERVICE, vllm_guard.__file__, *command], stdin=subprocess.PIPE)


def guarded(command: list[str]) -> contextlib.AbstractContextManager[subprocess.Popen[bytes]]:
    """The guard running ``command`` for this process; its group is killed at the end whatever happened."""
    return started(vllm_guard.launcher(os.getpid(), None, 0, command))


async def whole_group_up(pgid: int) -> None:
    """The guard, its child and grandchild (its handlers are set once the child runs)."""
    await wait_until(lambda: len(vllm_guard.group_members(pgid)) == 3, 10, "the guard, its child and grandchild")


@pytest.mark.timeout(60)
async def test_the_whole_group_dies_when_the_service_is_sigkilled() -> None:
    service = start_service(CHILD_WITH_GRANDCHILD)
    pgid = None
    try:
        await wait_until(lambda: children(service.pid), 10, "the service to start the guard")
        (pgid,) = children(service.pid)
        await whole_group_up(pgid)
        os.kill(service.pid, signal.SIGKILL)
        service.wait(timeout=10)
        # The child dies at the guard's SIGTERM; the grace period is for a vLLM shutting down.
        await wait_until(lambda: not vllm_guard.group_members(pgid), 5, "the guard's group to be gone")
    finally:
        if service.poll() is None:
            service.kill()
            service.wait(timeout=10)
        if pgid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)


@pytest.mark.timeout(60)
async def test_the_guard_exits_with_its_childs_code_and_takes_the_rest_of_the_group_with_it() -> None:
    exits_3 = "import subprocess, sys; subprocess.Popen(['sleep', '600']); sys.exit(3)"
    with guarded([sys.executable, "-c", exits_3]) as guard:
        assert guard.wait(timeout=10) == 3
        await wait_until(lambda: not vllm_guard.group_members(guard.pid), 5, "the orphaned grandchild to die")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("to_the_group", [True, False], ids=["killpg", "guard-only"])
async def test_sigterm_to_the_group_or_to_the_guard_alone_ends_everything(to_the_group: bool) -> None:
    with guarded(CHILD_WITH_GRANDCHILD) as guard:
        await whole_group_up(guard.pid)
        (os.killpg if to_the_group else os.kill)(guard.pid, signal.SIGTERM)
        assert guard.wait(timeout=10) == 128 + signal.SIGTERM  # as the child ended
        await wait_until(lambda: not vllm_guard.group_members(guard.pid), 5, "the guard's group to be gone")


@pytest.mark.timeout(60)
def test_a_guard_whose_service_died_before_it_watched_stops_its_child_at_once() -> None:
    dead = subprocess.Popen(["true"])
    dead.wait(timeout=10)
    command = vllm_guard.launcher(dead.pid, None, 0, ["sleep", "600"])
    started = time.monotonic()
    guard = subprocess.Popen(command, start_new_session=True)
    try:
        assert guard.wait(timeout=10) == -signal.SIGKILL  # the guard ends its group, itself included
        assert time.monotonic() - started < vllm_guard.GRACE_S  # sleep died at the SIGTERM
        assert not vllm_guard.group_members(guard.pid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(guard.pid, signal.SIGKILL)
