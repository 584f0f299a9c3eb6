"""``rollout-service top``: a live view of a running service, read from ``GetStats`` and
``ListRuns`` (the caller's own runs; every run for an admin token).

Why: Prometheus answers "what happened", but a user watching a run wants one screen that
says whether the pool is busy, where the groups are (buffered, leased, trained, dropped),
which policy version each run is at, and what share of its tokens it trained on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import grpc
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from rollout_api import rollout_pb2 as pb
from rollout_api.client import RolloutClient, rpc_reason

RUN_COLUMNS = (
    "run",
    "state",
    "version",
    "slots",
    "tokens",
    "started",
    "buffered",
    "leased",
    "trained",
    "dropped stale",
    "dropped other",
    "returned",
    "lookahead",
)

LEDGER_COLUMNS = (
    "run",
    "goodput",
    "goodput (engine s)",
    "trained",
    "dropped stale",
    "aborted",
    "failed",
    "filtered",
    "in flight",
    "held",
    "drift",
)
"""The goodput ledger in tokens: where each run's generated tokens went; and what the bias audit
flags (trained groups unlike the started ones)."""


def render(stats: pb.GetStatsResponse, runs: Mapping[str, pb.Run]) -> Group:
    """One screen: the pool's line, then a row per run the caller may see."""
    pool = Text.assemble(
        ("slots ", "bold"),
        f"{stats.slots_busy}/{stats.max_inflight} (average {stats.slots_busy_time_average:.1f})  ",
        ("tokens/s ", "bold"),
        f"{stats.recent_tokens_per_second:.0f}  ",
        ("weight updates ", "bold"),
        f"{stats.weight_updates_committed} committed, {stats.weight_updates_aborted} aborted  ",
        ("uptime ", "bold"),
        f"{stats.uptime_seconds:.0f}s",
    )
    table = Table(*RUN_COLUMNS, box=None, header_style="bold")
    for run_id in sorted(stats.runs):
        counters, run = stats.runs[run_id], runs.get(run_id)
        table.add_row(
            run_id,
            _state(run) if run else "?",
            str(run.policy_version) if run else "?",
            str(counters.slots_busy),
            str(counters.tokens_generated),
            str(counters.groups_started),
            str(counters.groups_buffered),
            str(counters.groups_leased),
            str(counters.groups_trained),
            str(counters.groups_dropped_stale),
            str(counters.groups_dropped),
            str(counters.groups_returned),
            f"{counters.lookahead_versions:.2f}",
        )
    if not stats.runs:
        table.add_row("(no runs this caller may see)", *[""] * (len(RUN_COLUMNS) - 1))
    return Group(pool, table, Text(""), ledger_table(stats))


def ledger_table(stats: pb.GetStatsResponse) -> Table:
    table = Table(*LEDGER_COLUMNS, box=None, header_style="bold", title="tokens", title_justify="left")
    for run_id in sorted(stats.runs):
        ledger = stats.runs[run_id].ledger
        settled = (ledger.trained, ledger.dropped_stale, ledger.aborted, ledger.failed, ledger.filtered)
        table.add_row(
            run_id,
            f"{ledger.goodput:.1%}",
            f"{ledger.goodput_seconds:.1%}",
            *(str(entry.tokens) for entry in settled),
            str(ledger.in_flight.tokens),
            str(ledger.buffered.tokens + ledger.leased.tokens),
            ",".join(stats.runs[run_id].audit.flagged) or "-",
        )
    return table


def _state(run: pb.Run) -> str:
    """running, stopped or failed; a stalled run says which side stopped (GetRun has why)."""
    state = pb.RunState.Name(run.state).removeprefix("RUN_STATE_").lower()
    if run.HasField("stall"):
        state += f" (stalled: {pb.StallKind.Name(run.stall.kind).removeprefix('STALL_KIND_').lower()})"
    return state


async def snapshot(target: str, timeout_s: float) -> Group:
    async with RolloutClient(target, timeout_s=timeout_s) as client:
        return await screen(client)


async def screen(client: RolloutClient) -> Group:
    """The current screen: GetStats and the runs this caller may see."""
    stats = await client.stats()
    runs = {run.run_id: run for run in await client.list_runs()}
    return render(stats, runs)


async def watch(target: str, interval_s: float, timeout_s: float) -> None:
    """Refresh every ``interval_s`` until interrupted."""
    async with RolloutClient(target, timeout_s=timeout_s) as client:
        with Live(auto_refresh=False) as live:
            while True:
                live.update(await screen(client), refresh=True)
                await asyncio.sleep(interval_s)  # the refresh period, not synchronisation


class ServiceUnreachable(Exception):
    """No answer, or an error status; the message says what to check."""


def show(target: str, interval_s: float, once: bool, timeout_s: float) -> None:
    """Print one snapshot (``once``) or refresh until Ctrl-C."""
    try:
        if once:
            Console(width=200).print(asyncio.run(snapshot(target, timeout_s)))
        else:
            asyncio.run(watch(target, interval_s, timeout_s))
    except TimeoutError:
        raise ServiceUnreachable(
            f"no rollout service answered at {target} within {timeout_s:g}s (check --target, TLS settings)"
        ) from None
    except grpc.aio.AioRpcError as exc:
        raise ServiceUnreachable(f"{target}: {rpc_reason(exc)}") from None
    except KeyboardInterrupt:
        pass
