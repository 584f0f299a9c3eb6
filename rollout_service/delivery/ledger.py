"""The goodput ledger of one run: where its generated tokens, and the engine seconds behind them, went.

Every token is in exactly one place at any time: in flight (its group is still generating or
being scored), buffered or leased by the broker, or settled with an outcome. Tokens come in as
episodes finish here, or with groups restored from the state store, so the books balance:
generated + restored = settled outcomes + in flight + buffered + leased. Engine seconds are slot
seconds: a member's wall time times the slots it held, known even for a member cut off before
vLLM returned its tokens.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from rollout_service.generation.drops import drop_outcome
from rollout_service.types import ScoredGroup

OUTCOMES = ("trained", "dropped_stale", "aborted", "failed", "filtered", "cancelled")
"""trained / dropped_stale: the consumer's ack. aborted: cut in flight (stale, or a weight update's
abort). failed: a request, environment, reward or size failure. filtered: too few members by the
deadline, or a partial group's cut stragglers. cancelled: the run stopped or was deleted."""

CLOSED_KEPT = 4096
"""Settled groups remembered, so that a member ending after its group settles joins its outcome."""


@dataclass
class Cost:
    tokens: int = 0
    seconds: float = 0.0
    groups: int = 0

    def add(self, tokens: int, seconds: float, groups: int = 0) -> None:
        self.tokens += tokens
        self.seconds += seconds
        self.groups += groups

    def add_cost(self, other: Cost) -> None:
        self.add(other.tokens, other.seconds, other.groups)


@dataclass(frozen=True)
class LedgerSnapshot:
    generated: Cost
    restored: Cost
    settled: dict[str, Cost]
    in_flight: Cost
    buffered: Cost
    leased: Cost
    trained_zero_advantage: Cost
    """Trained groups whose advantages were all zero: trained, but with no learning signal."""

    @property
    def flows(self) -> dict[str, Cost]:
        """What came in and what settled, by entry (``trained_zero_advantage`` a part of ``trained``)."""
        return {
            "generated": self.generated,
            "restored": self.restored,
            **self.settled,
            "trained_zero_advantage": self.trained_zero_advantage,
        }

    @property
    def stocks(self) -> dict[str, Cost]:
        """Where the tokens not settled yet are."""
        return {"in_flight": self.in_flight, "buffered": self.buffered, "leased": self.leased}

    @property
    def incoming(self) -> Cost:
        return _total([self.generated, self.restored])

    @property
    def accounted(self) -> Cost:
        """Settled plus held: equal to ``incoming`` in tokens and in seconds (the books balance)."""
        return _total([*self.settled.values(), *self.stocks.values()])

    @property
    def goodput(self) -> float:
        """Trained tokens per token that came in; 0 before any."""
        incoming = self.incoming.tokens
        return self.settled["trained"].tokens / incoming if incoming else 0.0

    @property
    def goodput_seconds(self) -> float:
        incoming = self.incoming.seconds
        return self.settled["trained"].seconds / incoming if incoming else 0.0


def group_tokens(group: ScoredGroup) -> int:
    return sum(episode.policy_tokens for episode in group.episodes)


def group_cost(groups: Iterable[ScoredGroup]) -> Cost:
    cost = Cost()
    for group in groups:
        cost.add(group_tokens(group), group.engine_seconds, 1)
    return cost


@dataclass
class _OpenGroup:
    cost: Cost = field(default_factory=Cost)
    cut_seconds: float = 0.0
    """Seconds of members cancelled before they returned: filtered if the group is scored without them."""


class GoodputLedger:
    def __init__(self) -> None:
        self.generated = Cost()
        self.restored = Cost()
        self.settled = {outcome: Cost() for outcome in OUTCOMES}
        self.trained_zero_advantage = Cost()
        self._open: dict[str, _OpenGroup] = {}
        self._closed: OrderedDict[str, str] = OrderedDict()

    def member_finished(self, group_id: str, tokens: int, seconds: float) -> None:
        """A member returned ``tokens`` policy tokens after ``seconds`` of engine time."""
        self.generated.add(tokens, seconds)
        if (outcome := self._closed.get(group_id)) is not None:
            self.settled[outcome].add(tokens, seconds)
        else:
            self._open.setdefault(group_id, _OpenGroup()).cost.add(tokens, seconds)

    def member_cut(self, group_id: str, seconds: float) -> None:
        """A member was cancelled or failed: vLLM returned no tokens, but its engine time was spent."""
        self.generated.add(0, seconds)
        if (outcome := self._closed.get(group_id)) is not None:
            self.settled[outcome].add(0, seconds)
        else:
            self._open.setdefault(group_id, _OpenGroup()).cut_seconds += seconds

    def group_scored(self, group_id: str) -> float:
        """The group goes to the broker: returns the engine seconds it carries; a partial group's cut
        stragglers (and any member ending later) are filtered."""
        group = self._open.pop(group_id, _OpenGroup())
        self.settled["filtered"].add(0, group.cut_seconds)
        self._remember(group_id, "filtered")
        return group.cost.seconds

    def group_dropped(self, group_id: str, reason: str) -> None:
        """The scheduler dropped an unscored group (``reason``: its drop label); a no-op once it is settled."""
        if group_id in self._closed:
            return
        group = self._open.pop(group_id, _OpenGroup())
        outcome = drop_outcome(reason)
        self.settled[outcome].add(group.cost.tokens, group.cost.seconds + group.cut_seconds, 1)
        self._remember(group_id, outcome)

    def external_group(self, tokens: int, outcome: str | None) -> None:
        """A group whose episodes a client ran arrived with ``tokens``: buffered (``outcome`` None), or
        settled at once. Its engine seconds are the client's, not counted here."""
        self.generated.add(tokens, 0.0)
        if outcome is not None:
            self.settled[outcome].add(tokens, 0.0, 1)

    def restored_groups(self, groups: Iterable[ScoredGroup]) -> None:
        self.restored.add_cost(group_cost(groups))

    def acked(self, group: ScoredGroup, outcome: str) -> None:
        cost = group_cost([group])
        self.settled[outcome].add_cost(cost)
        if outcome == "trained" and not any(group.advantages):
            self.trained_zero_advantage.add_cost(cost)

    def cancel_all(self, held: Iterable[ScoredGroup]) -> None:
        """The run is gone: what is still in flight or held by the broker is cancelled."""
        for group_id in list(self._open):
            self.group_dropped(group_id, "cancelled")
        self.settled["cancelled"].add_cost(group_cost(held))

    def snapshot(self, buffered: Iterable[ScoredGroup], leased: Iterable[ScoredGroup]) -> LedgerSnapshot:
        in_flight = Cost()
        for group in self._open.values():
            in_flight.add(group.cost.tokens, group.cost.seconds + group.cut_seconds, 1)
        return LedgerSnapshot(
            generated=_copy(self.generated),
            restored=_copy(self.restored),
            settled={outcome: _copy(cost) for outcome, cost in self.settled.items()},
            in_flight=in_flight,
            buffered=group_cost(buffered),
            leased=group_cost(leased),
            trained_zero_advantage=_copy(self.trained_zero_advantage),
        )

    def _remember(self, group_id: str, outcome: str) -> None:
        self._closed[group_id] = outcome
        if len(self._closed) > CLOSED_KEPT:
            self._closed.popitem(last=False)


def _copy(cost: Cost) -> Cost:
    return dataclasses.replace(cost)


def _total(costs: Iterable[Cost]) -> Cost:
    total = Cost()
    for cost in costs:
        total.add_cost(cost)
    return total


class LedgerCollector:
    """Exports every live run's ledger at scrape time, so the hot path updates no series."""

    def __init__(self, snapshots: Callable[[], Iterable[tuple[str, LedgerSnapshot]]]) -> None:
        self.snapshots = snapshots

    def collect(self) -> Iterator[Metric]:
        run_entry, run_place = ["run", "entry"], ["run", "place"]
        tokens = CounterMetricFamily(
            "rollout_ledger_tokens", "Tokens each run generated, restored, and settled by outcome", labels=run_entry
        )
        seconds = CounterMetricFamily(
            "rollout_ledger_engine_seconds", "Engine slot seconds behind the ledger's tokens", labels=run_entry
        )
        held_tokens = GaugeMetricFamily(
            "rollout_ledger_held_tokens", "Tokens in flight, buffered or leased now", labels=run_place
        )
        held_seconds = GaugeMetricFamily(
            "rollout_ledger_held_engine_seconds", "Engine seconds in flight, buffered or leased now", labels=run_place
        )
        goodput = GaugeMetricFamily("rollout_goodput", "Trained tokens per generated token", labels=["run"])
        for run_id, snapshot in self.snapshots():
            for entry, cost in snapshot.flows.items():
                tokens.add_metric([run_id, entry], cost.tokens)
                seconds.add_metric([run_id, entry], cost.seconds)
            for place, cost in snapshot.stocks.items():
                held_tokens.add_metric([run_id, place], cost.tokens)
                held_seconds.add_metric([run_id, place], cost.seconds)
            goodput.add_metric([run_id], snapshot.goodput)
        yield from (tokens, seconds, held_tokens, held_seconds, goodput)
