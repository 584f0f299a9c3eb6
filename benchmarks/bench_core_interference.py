"""Does work on one core slow work on another? A fixed single-thread workload timed on the
first core alone, then while the same workload runs on the second.

Why: ``bench_vs_trl.py`` measures the trainer and generation each alone with the thread split
of a run, and the ideal it reports assumes that running them side by side costs each nothing.
On a virtual machine two "cores" may share an SMT core, caches or memory bandwidth. This says
which of three kinds of work (arithmetic, memory streaming, plain Python) pays for that, so a
run's extra core-seconds over each side alone can be read against it.

Usage::

    python benchmarks/bench_core_interference.py            # the first two available cores
    python benchmarks/bench_core_interference.py --rounds 5
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Callable

import torch
from rich.console import Console
from rich.table import Table

WORKLOADS: dict[str, int] = {"matmul": 4000, "memory copy": 400, "python": 3000}
"""Each workload and the repetitions one timing runs (about half a second to four alone)."""


def workload(kind: str) -> Callable[[], object]:
    """One repetition of ``kind``: a 384x384 fp32 matmul (in cache), a 32 MB tensor copy
    (streams memory), or a Python loop (the interpreter's own work)."""
    if kind == "matmul":
        a, b = torch.randn(384, 384), torch.randn(384, 384)
        return lambda: torch.mm(a, b)
    if kind == "memory copy":
        source = torch.randn(8_000_000)
        target = torch.empty_like(source)
        return lambda: target.copy_(source)
    return lambda: sum(range(20_000))


def run(kind: str, core: int, repetitions: int, result: mp.Queue | None) -> None:
    """Run ``kind`` on ``core`` with one torch thread: ``repetitions`` times, putting the
    seconds they took on ``result``; or, without ``result``, until killed (the neighbour)."""
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    step = workload(kind)
    for _ in range(20):  # warm-up
        step()
    if result is None:
        while True:
            step()
    started = time.perf_counter()
    for _ in range(repetitions):
        step()
    result.put(time.perf_counter() - started)


def timed(kind: str, cores: tuple[int, int], repetitions: int, neighbour: bool) -> float:
    """Seconds of ``kind`` on the first core, with the same workload looping on the second or not."""
    busy = None
    if neighbour:
        busy = mp.Process(target=run, args=(kind, cores[1], 0, None), daemon=True)
        busy.start()
    result: mp.Queue = mp.Queue()
    timing = mp.Process(target=run, args=(kind, cores[0], repetitions, result))
    timing.start()
    try:
        return result.get(timeout=300)
    finally:
        timing.join(30)
        if busy is not None:
            busy.kill()
            busy.join(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="alternated timings of each; the median is shown")
    args = parser.parse_args()
    available = sorted(os.sched_getaffinity(0))
    if len(available) < 2:
        raise SystemExit("needs two cores; this process may run on one")
    cores = (available[0], available[1])
    table = Table(title=f"one thread on core {cores[0]}, alone and with core {cores[1]} busy (median of {args.rounds})")
    for column in ("workload", "alone s", "neighbour busy s", "slowdown"):
        table.add_column(column, justify="right")
    for kind, repetitions in WORKLOADS.items():
        alone, beside = [], []
        for _ in range(args.rounds):
            alone.append(timed(kind, cores, repetitions, neighbour=False))
            beside.append(timed(kind, cores, repetitions, neighbour=True))
        a, b = statistics.median(alone), statistics.median(beside)
        table.add_row(kind, f"{a:.3f}", f"{b:.3f}", f"{b / a:.2f}x")
    Console().print(table)


if __name__ == "__main__":
    main()
