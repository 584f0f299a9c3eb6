"""Place vLLM on its cores, run it as a child, and take its whole process group down with the
service that started it.

``python vllm_guard.py SERVICE_PID CORES NICE -- COMMAND...`` (CORES: comma-separated, or ""
for all; NICE: 0 leaves the priority as is). The guard leads vLLM's process group: when the
service dies (even by SIGKILL; PR_SET_PDEATHSIG would reach only the direct child) it stops
the group; when the command exits it kills the rest and exits with its code; SIGTERM or
SIGINT is passed on once. A separate process, not a ``preexec_fn``, because at-fork hooks
in a multi-threaded parent can crash; it is run by path and imports only the standard library.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger("vllm_guard")

GRACE_S = 10.0
"""How long vLLM may take to shut down after the service died."""

PARENT_POLL_S = 1.0
"""How often the parent is checked where there are no pidfds to wait on."""


def launcher(service_pid: int, cores: tuple[int, ...] | None, nice: int, command: list[str]) -> list[str]:
    return [sys.executable, __file__, str(service_pid), ",".join(map(str, cores or ())), str(nice), "--", *command]


def place(cores: tuple[int, ...], nice: int) -> None:
    """Pin to ``cores`` (none: as is) and lower the priority by ``nice``, also of the session's
    autogroup (which the kernel schedules by)."""
    if cores:
        os.sched_setaffinity(0, cores)
    if nice:
        os.nice(nice)
        with contextlib.suppress(OSError):  # no autogroup in this kernel
            Path("/proc/self/autogroup").write_text(str(nice))


def _stat(pid: int | str) -> list[str] | None:
    """/proc/PID/stat's fields from the state on (field 3), or None for no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()  # the name may hold spaces and parentheses


def start_time(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot): with the pid, it names one process for good."""
    fields = _stat(pid)
    return None if fields is None else int(fields[19])


def processes() -> Iterator[tuple[int, str, int, int, int]]:
    """(pid, state, parent pid, process group, start time) of every process in /proc."""
    with contextlib.suppress(FileNotFoundError):  # no /proc: nothing to list
        for entry in os.listdir("/proc"):
            fields = _stat(entry) if entry.isdigit() else None
            if fields is not None:
                yield int(entry), fields[0], int(fields[1]), int(fields[2]), int(fields[19])


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes in process group ``pgid``."""
    return [pid for pid, state, _, group, _ in processes() if group == pgid and state not in ("Z", "X")]


def pidfd(pid: int) -> list[int]:
    """A pidfd of ``pid`` to select on, or none where this OS has none."""
    try:
        return [os.pidfd_open(pid)]
    except (AttributeError, OSError):
        return []


def wait_for_child_or_parent(child: subprocess.Popen[bytes], parent: int) -> None:
    """Return once ``child`` has exited or ``parent`` has died (this process re-parented)."""
    fds = pidfd(child.pid) + pidfd(parent)
    timeout = None if len(fds) == 2 else PARENT_POLL_S
    while child.poll() is None and os.getppid() == parent:
        select.select(fds, [], [], timeout)  # a signal's handler runs, then it waits on


def pass_on(signum: int, _frame: object = None) -> None:
    """Send ``signum`` to the group once; further ones to the guard are ignored (its own copy too)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.killpg(os.getpid(), signum)


def stop_group(child: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the group, SIGKILL after the grace period (this process too)."""
    pass_on(signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        child.wait(GRACE_S)
    os.killpg(os.getpid(), signal.SIGKILL)


def kill_the_rest() -> None:
    """SIGKILL every other process of this group: with the API server gone, its engine serves no one."""
    for pid in group_members(os.getpid()):
        if pid != os.getpid():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def main(argv: list[str]) -> None:
    service_pid, cores, nice, separator, *command = argv
    if separator != "--" or not command:
        sys.exit(f"usage: {Path(__file__).name} SERVICE_PID CORES NICE -- COMMAND...")
    logging.basicConfig(format="%(asctime)s vllm_guard %(levelname)s %(message)s")
    if os.getpgrp() != os.getpid():  # signals go to this process's group: it must be vLLM's alone
        os.setpgid(0, 0)
    place(tuple(int(core) for core in cores.split(",") if core), int(nice))
    child = subprocess.Popen(command)
    signal.signal(signal.SIGTERM, pass_on)
    signal.signal(signal.SIGINT, pass_on)
    wait_for_child_or_parent(child, int(service_pid))
    if child.returncode is None:
        logger.warning("the service (pid %s) died; stopping vLLM's process group %d", service_pid, os.getpid())
        stop_group(child)
    kill_the_rest()
    code = child.returncode
    sys.exit(128 - code if code < 0 else code)


if __name__ == "__main__":
    main(sys.argv[1:])
