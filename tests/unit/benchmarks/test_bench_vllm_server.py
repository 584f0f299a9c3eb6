"""How ``benchmarks/bench_vllm_server.py`` reads a variant and puts its environment in place for a start."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))  # as the benchmark scripts run

from bench_vllm_server import Variant, VariantServer, parse_variant


def test_a_variants_leading_settings_go_into_the_environment_and_the_rest_are_vllm_flags() -> None:
    # as argv holds it after the shell: aot="VLLM_USE_AOT_COMPILE=1 A='b c' --dtype float32"
    variant = Variant.parse(*parse_variant("aot=VLLM_USE_AOT_COMPILE=1 A='b c' --dtype float32"))
    assert variant == Variant("aot", {"VLLM_USE_AOT_COMPILE": "1", "A": "b c"}, ["--dtype", "float32"])
    assert Variant.parse(*parse_variant("default=")) == Variant("default", {}, [])


def test_a_variant_without_a_name_is_refused_with_the_shape_it_needs() -> None:
    with pytest.raises(argparse.ArgumentTypeError, match='NAME="'):
        parse_variant("--enforce-eager")


def test_a_variants_settings_win_over_the_services_and_the_rest_stays(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "0")
    variant = Variant.parse("aot", "VLLM_USE_AOT_COMPILE=1 --enforce-eager")
    server = VariantServer(variant, Path("models/tiny-qwen2"), Path("/tmp"))
    env = server.environment()
    assert env["VLLM_USE_AOT_COMPILE"] == "1" and env["VLLM_SERVER_DEV_MODE"] == "1"
    assert server.command()[-1] == "--enforce-eager"  # after the service's flags: it wins
    assert os.environ["VLLM_USE_AOT_COMPILE"] == "0"  # this process's own is left alone
