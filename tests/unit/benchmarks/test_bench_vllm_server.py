"""How ``benchmarks/bench_vllm_server.py`` reads a variant and puts its environment in place for a start."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))  # as the benchmark scripts run

from bench_vllm_server import Variant, environment, parse_variant


def test_a_variants_leading_settings_go_into_the_environment_and_the_rest_are_vllm_flags() -> None:
    # as argv holds it after the shell: aot="VLLM_USE_AOT_COMPILE=1 A='b c' --dtype float32"
    variant = Variant.parse(*parse_variant("aot=VLLM_USE_AOT_COMPILE=1 A='b c' --dtype float32"))
    assert variant == Variant("aot", {"VLLM_USE_AOT_COMPILE": "1", "A": "b c"}, ["--dtype", "float32"])
    assert Variant.parse(*parse_variant("default=")) == Variant("default", {}, [])


def test_a_variant_without_a_name_is_refused_with_the_shape_it_needs() -> None:
    with pytest.raises(argparse.ArgumentTypeError, match='NAME="'):
        parse_variant("--enforce-eager")


def test_a_variants_environment_lasts_for_its_start_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BENCH_KEPT", "before")
    monkeypatch.delenv("BENCH_NEW", raising=False)
    with environment({"BENCH_KEPT": "during", "BENCH_NEW": "1"}):
        assert (os.environ["BENCH_KEPT"], os.environ["BENCH_NEW"]) == ("during", "1")
    assert os.environ["BENCH_KEPT"] == "before" and "BENCH_NEW" not in os.environ
