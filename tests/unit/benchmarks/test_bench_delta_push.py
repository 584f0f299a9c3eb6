"""How ``benchmarks/bench_delta_push.py`` reads its arguments and sets each run beside its full push."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))  # as the benchmark scripts run

from bench_delta_push import Run, parse_args, report


def run(mode: str, bytes_per_push: float, seconds: float) -> Run:
    return Run("small", 1_000_000, 1e-6, "gloo", mode, 10, bytes_per_push, seconds, 1.0, 2.0, 0.004)


def test_each_delta_run_is_set_beside_the_full_run_of_its_learning_rate_and_transport() -> None:
    console = Console(width=200, record=True)
    report([run("full", 4e6, 0.020), run("delta", 1e5, 0.030)], console)
    rows = [line for line in console.export_text().splitlines() if "gloo" in line]
    assert "1.000" in rows[0] and "1.00" in rows[0]
    assert "0.025" in rows[1] and "1.50" in rows[1]  # a fortieth of the bytes, half again the seconds


def test_unknown_transports_and_dtypes_are_refused_with_the_choices(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--transports", "shm,rdma"])
    assert "unknown ['rdma']; use ['gloo', 'shm']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--served-dtype", "bf17"])
    assert "'bf17' is not a torch dtype" in capsys.readouterr().err
    args = parse_args(["--learning-rates", "1e-6, 1e-5", "--transports", "gloo"])
    assert args.learning_rates == [1e-6, 1e-5] and args.transports == ["gloo"]
