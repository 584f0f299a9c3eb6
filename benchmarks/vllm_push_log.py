"""What each weight push cost vLLM, read from a managed server's log.

Why: a push costs the trainer under 1% of a step, since it runs beside the next step. Its
cost to vLLM lands on the core that generates. The gloo engine
(``vllm_gloo_transfer.plugin``) logs every apply with the CPU it took and what receiving the
tensors took before it. A benchmark marks the log before a run and reads the run's lines
after it, so each run reports its own pushes.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

APPLY_LINE = re.compile(
    r"applied \d+ weight tensors .* in [\d.]+ ms \((?P<apply>[\d.]+) ms CPU\), "
    r"received them over (?P<transport>.+?) in [\d.]+ ms \((?P<receive>[\d.]+) ms CPU\)"
)
WARM_UP_PUSHES = 2
"""Left out of each run: the first pushes pay for the join and for cold caches."""


@dataclass(frozen=True)
class PushCost:
    """Medians over one run's pushes after the warm-up, in milliseconds of vLLM's CPU."""

    pushes: int
    transport: str
    apply_cpu_ms: float
    receive_cpu_ms: float
    cpu_ms: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class PushLog:
    """A managed vLLM server's log, read from a mark on."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0

    def mark(self) -> None:
        """Start the next reading here: at the end of the log as it is now."""
        self._offset = self.path.stat().st_size if self.path.exists() else 0

    def since_mark(self) -> PushCost | None:
        """The pushes logged since the mark; None when too few were (or the log is gone)."""
        if not self.path.exists():
            return None
        with self.path.open("rb") as log:
            log.seek(self._offset)
            text = log.read().decode(errors="replace")
        matches = [m for line in text.splitlines() if (m := APPLY_LINE.search(line))]
        steady = matches[WARM_UP_PUSHES:]
        if not steady:
            return None
        apply = [float(m["apply"]) for m in steady]
        receive = [float(m["receive"]) for m in steady]
        return PushCost(
            pushes=len(matches),
            transport=steady[-1]["transport"],
            apply_cpu_ms=statistics.median(apply),
            receive_cpu_ms=statistics.median(receive),
            cpu_ms=statistics.median(a + r for a, r in zip(apply, receive, strict=True)),
        )


def describe(name: str, costs: list[dict[str, Any]], steps_per_s: float) -> str:
    """One contender's line: the median over its runs, and its share of the contender's step."""
    cpu = statistics.median(c["cpu_ms"] for c in costs)
    apply = statistics.median(c["apply_cpu_ms"] for c in costs)
    receive = statistics.median(c["receive_cpu_ms"] for c in costs)
    transports = "/".join(sorted({c["transport"] for c in costs}))
    share = cpu / (1000 / steps_per_s)
    return (
        f"{name}: {cpu:.1f} ms of vLLM's CPU per push (apply {apply:.1f}, receive {receive:.1f}, over "
        f"{transports}) = {100 * share:.1f}% of its step"
    )
