"""Every place that judges staleness follows the one rule in rollout_common: the service's
admission and its in-flight abort (``RunAdmission.outdated``), the trainer's take and its loss
mask (``GroupFeed.is_fresh``, through ``StreamGRPOTrainer._fresh``)."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

from rollout_common.staleness import within_staleness
from rollout_service.delivery.admission import RunAdmission
from rollout_service.metrics import ServiceMetrics
from trainer_client.stream.feed import GroupFeed
from trainer_client.train.trainer import StreamGRPOTrainer

GRID = [(s, t, limit) for s, t, limit in itertools.product(range(4), range(4), range(3)) if s <= t]
"""(sample version, trainer version, max_staleness), samples never newer than the trainer."""


def test_the_rule_is_a_bound_on_the_versions_between_sample_and_trainer() -> None:
    assert within_staleness(3, 3, 0)
    assert not within_staleness(2, 3, 0)
    assert within_staleness(1, 3, 2)
    assert not within_staleness(0, 3, 2)


@pytest.mark.parametrize(("sample", "trainer", "limit"), GRID)
def test_the_service_admits_and_aborts_by_the_rule(sample: int, trainer: int, limit: int) -> None:
    admission = RunAdmission("r", ServiceMetrics(), max_staleness=limit)
    admission.set_trainer_version(trainer)
    assert admission.outdated(sample) is not within_staleness(sample, trainer, limit)


@pytest.mark.parametrize(("sample", "trainer", "limit"), GRID)
def test_the_trainer_takes_and_masks_by_the_rule(sample: int, trainer: int, limit: int) -> None:
    feed = GroupFeed("127.0.0.1:1", "run", "c", max_staleness=limit, credits=1)
    feed._loop.close()  # never opened: the rule needs no stream
    feed.current_version = trainer
    expected = within_staleness(sample, trainer, limit)
    assert feed.is_fresh(sample) is expected
    mask = StreamGRPOTrainer._fresh(SimpleNamespace(feed=feed), {"staleness_versions": [sample]})  # type: ignore[arg-type]
    assert mask == [expected]
