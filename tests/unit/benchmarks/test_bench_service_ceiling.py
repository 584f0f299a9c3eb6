"""The figures ``benchmarks/bench_service_ceiling.py`` reads off the service's ``/metrics``."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))  # as the benchmark scripts run

from bench_service_ceiling import Config, histogram_quantile, parse_scrape

from rollout_service.metrics import ServiceMetrics


def test_quantiles_interpolate_within_a_bucket_as_prometheus_does() -> None:
    buckets = [(0.001, 50.0), (0.01, 90.0), (0.1, 100.0), (math.inf, 100.0)]
    assert histogram_quantile(buckets, 0.5) == pytest.approx(0.001)
    assert histogram_quantile(buckets, 0.7) == pytest.approx(0.001 + 0.009 * 20 / 40)
    assert histogram_quantile(buckets, 0.99) == pytest.approx(0.01 + 0.09 * 9 / 10)
    assert math.isnan(histogram_quantile([(0.1, 0.0), (math.inf, 0.0)], 0.5))


def test_a_quantile_past_the_last_finite_bucket_is_that_bound() -> None:
    assert histogram_quantile([(0.1, 10.0), (math.inf, 20.0)], 0.99) == 0.1


def test_the_scrape_reads_the_services_own_lag_histogram_and_busy_slots() -> None:
    metrics = ServiceMetrics()
    for seconds in (0.0005, 0.003, 0.2):
        metrics.event_loop_lag.observe(seconds)
    metrics.slots_busy.set(12)
    scrape = parse_scrape(generate_latest(metrics.registry).decode())
    assert scrape.slots_busy == 12
    assert scrape.lag[0.001] == 1 and scrape.lag[0.005] == 2 and scrape.lag[0.25] == 3 and scrape.lag[math.inf] == 3


def test_other_series_are_not_read_as_lag() -> None:
    registry = CollectorRegistry()
    Histogram("other_seconds", "x", registry=registry).observe(1.0)
    Gauge("rollout_slots_busy", "x", registry=registry).set(3)
    scrape = parse_scrape(generate_latest(registry).decode())
    assert scrape.lag == {} and scrape.slots_busy == 3


def test_configurations_read_as_servers_inflight_consumers() -> None:
    assert Config.parse("16x1024x4") == Config(16, 1024, 4)
    assert str(Config(64, 4096, 16)) == "64x4096x16"
    with pytest.raises(ValueError):
        Config.parse("16x1024")
