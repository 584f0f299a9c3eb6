"""The goodput ledger: each token and engine second in exactly one place, by hand-counted
examples, and through the scheduler with every kind of drop (scripted engine)."""

from __future__ import annotations

import dataclasses

import pytest
from prometheus_client import generate_latest

from rollout_service.delivery.broker import ACK_DROPPED_STALE, ACK_TRAINED
from rollout_service.delivery.ledger import GoodputLedger, LedgerSnapshot
from rollout_service.edge.convert import run_stats_to_pb
from rollout_service.generation.drops import drop_outcome
from tests.support import wait_until
from tests.unit.rollout_service.builders import spec
from tests.unit.rollout_service.delivery.broker_helpers import group
from tests.unit.scripted import ABORT_TOKEN, FAIL_TOKEN, ScriptedEngine, make_service


def assert_balanced(snapshot: LedgerSnapshot) -> None:
    incoming, accounted = snapshot.incoming, snapshot.accounted
    assert accounted.tokens == incoming.tokens, snapshot
    assert accounted.seconds == pytest.approx(incoming.seconds, abs=1e-9), snapshot


def test_members_settle_with_their_group_and_late_ones_follow_it() -> None:
    ledger = GoodputLedger()
    ledger.member_finished("a", tokens=5, seconds=1.0)
    ledger.member_finished("a", tokens=3, seconds=0.5)
    ledger.member_cut("a", seconds=2.0)  # a straggler cut at the deadline
    ledger.member_finished("b", tokens=4, seconds=1.0)
    mid = ledger.snapshot([], [])
    assert (mid.in_flight.tokens, mid.in_flight.seconds, mid.in_flight.groups) == (12, 4.5, 2)
    assert_balanced(mid)

    assert ledger.group_scored("a") == 1.5  # the seconds the scored group carries; the cut 2.0 are filtered
    ledger.group_dropped("b", "stale_inflight")
    ledger.member_cut("b", seconds=0.25)  # ends after its group was dropped: joins the outcome
    ledger.group_dropped("b", "cancelled")  # a no-op once settled
    scored = dataclasses.replace(group("a"), engine_seconds=1.5)
    scored.episodes = [dataclasses.replace(scored.episodes[0], mask=[1] * 4 + [0], completion_ids=[1] * 5)] * 2
    snapshot = ledger.snapshot([scored], [])
    assert snapshot.settled["filtered"].seconds == 2.0 and snapshot.settled["filtered"].tokens == 0
    aborted = snapshot.settled["aborted"]
    assert (aborted.tokens, aborted.seconds, aborted.groups) == (4, 1.25, 1)
    assert (snapshot.buffered.tokens, snapshot.buffered.seconds, snapshot.buffered.groups) == (8, 1.5, 1)
    assert snapshot.in_flight.groups == 0
    assert_balanced(snapshot)

    ledger.acked(scored, ACK_TRAINED)
    done = ledger.snapshot([], [])
    assert done.settled["trained"].tokens == 8 and done.goodput == pytest.approx(8 / 12)
    assert done.goodput_seconds == pytest.approx(1.5 / 4.75)
    assert done.trained_zero_advantage.tokens == 0  # its advantages were -1 and 1
    assert_balanced(done)


def test_zero_advantage_restored_and_cancelled_groups_are_booked() -> None:
    ledger = GoodputLedger()
    flat = dataclasses.replace(group("flat"), advantages=[0.0, 0.0])
    restored = group("restored")
    ledger.restored_groups([flat, restored])
    ledger.acked(flat, ACK_TRAINED)
    ledger.member_finished("open", tokens=7, seconds=3.0)
    ledger.cancel_all([restored])
    snapshot = ledger.snapshot([], [])
    assert snapshot.restored.tokens == 4 and snapshot.trained_zero_advantage.tokens == 2
    cancelled = snapshot.settled["cancelled"]
    assert (cancelled.tokens, cancelled.seconds, cancelled.groups) == (9, 3.0, 2)
    assert_balanced(snapshot)


def test_external_groups_count_their_tokens_as_they_arrive() -> None:
    ledger = GoodputLedger()
    ledger.external_group(6, None)  # buffered
    ledger.external_group(4, "failed")
    snapshot = ledger.snapshot([group("g")] * 3, [])
    assert snapshot.generated.tokens == 10 and snapshot.settled["failed"].tokens == 4
    assert_balanced(snapshot)


@pytest.mark.parametrize(
    ("reason", "outcome"),
    [
        ("stale_inflight", "aborted"),
        ("aborted", "aborted"),
        ("deadline", "filtered"),
        ("engine", "failed"),
        ("reward", "failed"),
        ("too_large", "failed"),
        ("environment", "failed"),
        ("cancelled", "cancelled"),
    ],
)
def test_drop_reasons_map_to_outcomes(reason: str, outcome: str) -> None:
    assert drop_outcome(reason) == outcome


async def test_the_books_balance_through_failures_aborts_acks_and_deletion() -> None:
    """Every kind of settlement on one run: failed requests, a failing reward, groups aborted by
    a weight update, groups cut in flight as stale, acks of both kinds, and deletion. The books
    balance at every step; the wire and the Prometheus series show the same numbers."""

    def flaky(prompts, completions, completion_ids, **kw):
        if "5" in str(prompts):
            raise RuntimeError("a broken reward")
        return [float(len(c)) for c in completions]

    engine = ScriptedEngine(hold=True)
    service = make_service(engine, max_inflight=4, rewards={"flaky": flaky})
    prompts = [[1, 2], [FAIL_TOKEN], [ABORT_TOKEN], [5], [1, 4]]
    run = await service.create_run(spec(prompts, group_size=2, max_staleness=1, rewards=(("flaky", 1.0),)))
    ledger = run.broker.goodput
    try:
        for _ in range(6):  # release two groups' requests at a time
            await engine.wait_for(lambda: engine.active == 4)
            assert_balanced(ledger())
            engine.release(count=4)
        await engine.wait_for(lambda: engine.active == 4)
        service.versions.set_trainer(2)  # the trainer moved past version 0: the two groups in flight go stale
        await wait_until(lambda: ledger().settled["aborted"].groups >= 4, 5, "groups cut in flight")
        snapshot = ledger()
        assert snapshot.settled["failed"].groups >= 4  # a failed request and a failing reward, twice each
        assert snapshot.settled["aborted"].groups >= 4  # aborted by the update twice, then the two cut stale
        assert snapshot.buffered.groups >= 2
        assert_balanced(snapshot)

        run.broker.subscribe("t", credits=4)
        first, second = await run.broker.take("t"), await run.broker.take("t")
        assert_balanced(ledger())
        run.broker.ack("t", [first.group_id], ACK_TRAINED, trained_at=2)
        run.broker.ack("t", [second.group_id], ACK_DROPPED_STALE)
        snapshot = ledger()
        assert snapshot.settled["trained"].groups == snapshot.settled["dropped_stale"].groups == 1
        assert snapshot.settled["trained"].tokens == 2 * 4  # G = 2, 4 tokens each
        assert snapshot.settled["trained"].seconds > 0
        assert 0 < snapshot.goodput < 1
        assert_balanced(snapshot)
        wire = run_stats_to_pb(run).ledger
        assert (wire.trained.tokens, wire.generated.tokens) == (8, snapshot.generated.tokens)
        assert wire.goodput == pytest.approx(snapshot.goodput)
        sample = service.metrics.registry.get_sample_value
        assert sample("rollout_ledger_tokens_total", {"run": run.run_id, "entry": "trained"}) == 8
        assert sample("rollout_ledger_held_tokens", {"run": run.run_id, "place": "buffered"}) == (
            snapshot.buffered.tokens
        )
        assert sample("rollout_goodput", {"run": run.run_id}) == pytest.approx(snapshot.goodput)
        exposition = generate_latest(service.metrics.registry).decode()  # as /metrics serves it
        held = f'rollout_ledger_held_engine_seconds{{place="buffered",run="{run.run_id}"}} '
        assert float(exposition.split(held)[1].split()[0]) == pytest.approx(snapshot.buffered.seconds)
    finally:
        await service.delete_run(run.run_id)
    gone = ledger()
    assert gone.settled["cancelled"].groups > 0 and not any(c.tokens or c.groups for c in gone.stocks.values())
    assert_balanced(gone)
