"""Pin this process to some cores, lower its priority, then exec a command in its place.

``python place_and_exec.py CORES NICE -- COMMAND...`` (CORES: comma-separated, or "" for
all; NICE: 0 leaves the priority as is). The managed vLLM server starts through it, so that
its engine and worker processes inherit both.

Why a process of its own and not ``subprocess.Popen(preexec_fn=...)``: a ``preexec_fn``
runs Python in the forked child of a multi-threaded parent (the service), together with
every library's at-fork hooks; one of them (fsspec's) crashed the test suite with a
segmentation fault there. This script starts single-threaded and imports only the standard
library. It is run by path, so it does not import the ``rollout_service`` package.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path


def place(cores: tuple[int, ...], nice: int) -> None:
    """Pin to ``cores`` (none: leave as is) and lower the priority by ``nice``, for this process
    and for its session's autogroup (with the kernel's autogroup on, sessions share a core by
    the autogroup's niceness, whatever their threads' own)."""
    if cores:
        os.sched_setaffinity(0, cores)
    if nice:
        os.nice(nice)
        with contextlib.suppress(OSError):  # no autogroup in this kernel
            Path("/proc/self/autogroup").write_text(str(nice))


def launcher(cores: tuple[int, ...] | None, nice: int, command: list[str]) -> list[str]:
    """``command`` started through this script with that placement."""
    return [sys.executable, __file__, ",".join(map(str, cores or ())), str(nice), "--", *command]


def main(argv: list[str]) -> None:
    cores, nice, separator, *command = argv
    if separator != "--" or not command:
        sys.exit(f"usage: {Path(__file__).name} CORES NICE -- COMMAND...")
    place(tuple(int(core) for core in cores.split(",") if core), int(nice))
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
