"""The CPU thread budget: vLLM's binding and the trainer's threads derive from the core count."""

from __future__ import annotations

import pytest

from rollout_service.config import ManagedServerSettings
from rollout_service.cpu_budget import VLLM_BIND_ENV, CpuBudget, available_cores, is_local_target, trainer_threads
from rollout_service.engine.managed import ManagedVLLMServer


@pytest.mark.parametrize(
    ("cores", "vllm", "trainer"),
    [
        ((0,), (0,), (0,)),  # one core: shared, one thread each
        ((0, 1), (0,), (1,)),  # the measured fast split on 2 cores
        ((0, 1, 2), (0,), (1, 2)),
        ((0, 1, 2, 3), (0, 1), (2, 3)),
        ((4, 5, 6, 7, 8, 9, 10, 11), (4, 5, 6, 7), (8, 9, 10, 11)),  # a taskset / cgroup slice
    ],
)
def test_split_gives_half_the_cores_to_vllm_and_the_rest_to_the_trainer(cores, vllm, trainer) -> None:
    budget = CpuBudget.split(cores)
    assert budget.vllm_cores == vllm
    assert budget.trainer_cores == trainer
    assert budget.trainer_threads == len(trainer)
    if len(cores) > 1:  # never oversubscribed when there is anything to split
        assert len(budget.vllm_cores) + budget.trainer_threads == len(cores)
        assert not set(budget.vllm_cores) & set(budget.trainer_cores)


def test_vllm_share_can_be_set_but_leaves_the_trainer_a_core() -> None:
    assert CpuBudget.split((0, 1, 2, 3), vllm_cores=3).vllm_cores == (0, 1, 2)
    assert CpuBudget.split((0, 1, 2, 3), vllm_cores=8).trainer_cores == (3,)
    with pytest.raises(ValueError, match="at least 1"):
        CpuBudget.split((0, 1), vllm_cores=0)


def test_managed_cpu_server_is_bound_to_its_share(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(VLLM_BIND_ENV, raising=False)
    server = ManagedVLLMServer(ManagedServerSettings(port=1))
    assert server.environment()[VLLM_BIND_ENV] == CpuBudget.split().vllm_bind()
    one_core = ManagedVLLMServer(ManagedServerSettings(port=1, cpu_cores=1))
    assert one_core.environment()[VLLM_BIND_ENV] == str(available_cores()[0])


def test_a_binding_in_the_environment_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(VLLM_BIND_ENV, "nobind")
    assert ManagedVLLMServer(ManagedServerSettings(port=1)).environment()[VLLM_BIND_ENV] == "nobind"


def test_gpu_server_gets_no_cpu_binding(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(VLLM_BIND_ENV, raising=False)
    assert VLLM_BIND_ENV not in ManagedVLLMServer(ManagedServerSettings(port=1, device="gpu")).environment()


@pytest.mark.parametrize(
    ("target", "local"),
    [("127.0.0.1:50051", True), ("localhost:50051", True), ("[::1]:50051", True), ("10.0.0.7:50051", False)],
)
def test_local_targets_are_recognised(target: str, local: bool) -> None:
    assert is_local_target(target) is local


def test_trainer_threads_follow_the_budget_only_next_to_its_service() -> None:
    assert trainer_threads("127.0.0.1:50051") == CpuBudget.split().trainer_threads
    assert trainer_threads("rollout.example.com:50051") == len(available_cores())
    assert trainer_threads("127.0.0.1:50051", requested=3) == 3
    with pytest.raises(ValueError, match="positive"):
        trainer_threads("127.0.0.1:50051", requested=-1)
