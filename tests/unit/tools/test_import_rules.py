"""The layering rules of ``tools/import_graph.py`` hold for the tree, and each rule catches
the break it is there for."""

from __future__ import annotations

import pytest

from tools.import_graph import GRPC_EDGE, project_graph, violations


def test_the_tree_keeps_every_layering_rule() -> None:
    graph = project_graph()
    # the files were read
    assert "rollout_service.generation.scheduler" in graph and "trainer_client.train.trainer" in graph
    assert violations(graph) == []


def test_grpc_is_imported_by_the_edge_alone() -> None:
    graph = project_graph()
    speaking = {module for module, imported in graph.items() if any(n.split(".")[0] == "grpc" for n in imported)}
    assert speaking == set(GRPC_EDGE)


@pytest.mark.parametrize(
    ("module", "imported", "rule"),
    [
        ("rollout_service.delivery.broker", "grpc", "only the gRPC edge imports grpc"),
        ("rollout_service.generation.scheduler", "rollout_api.rollout_pb2_grpc", "only the gRPC edge imports grpc"),
        ("trainer_client.train.run", "rollout_service.config", "the trainer does not import the service"),
        ("rollout_service.app", "trainer_client.train.run", "the service does not import the trainer"),
        ("rollout_common.tiny_model", "rollout_service.config", "shared packages import neither side"),
        ("vllm_gloo_transfer.plugin", "trainer_client.weights", "shared packages import neither side"),
        (
            "rollout_service.engine.pool",
            "rollout_service.delivery.broker",
            "the engine imports nothing from scheduling",
        ),
        ("rollout_service.scoring.score", "rollout_service.delivery.broker", "a stage imports earlier stages only"),
        ("rollout_service.generation.scheduler", "rollout_service.weights.partitions", "only the edge and the service"),
        ("rollout_service.weights.pool_membership", "rollout_service.delivery.state_store", "the weights import no"),
        ("rollout_service.config", "rollout_service.engine.control", "config, types, errors, metrics and versions"),
    ],
)
def test_each_rule_catches_its_break(module: str, imported: str, rule: str) -> None:
    (found,) = violations({module: {imported}})
    assert (found.module, found.imported) == (module, imported) and found.rule.startswith(rule)


def test_an_import_cycle_is_named_once_whatever_its_length() -> None:
    graph = {
        "trainer_client.a": {"trainer_client.b", "torch"},
        "trainer_client.b": {"trainer_client.c"},
        "trainer_client.c": {"trainer_client.a"},
        "trainer_client.d": {"trainer_client.a"},  # reaches the cycle, is not in it
    }
    (found,) = violations(graph)
    cycle = "trainer_client.a -> trainer_client.b -> trainer_client.c -> trainer_client.a"
    assert found.rule == f"no import cycles ({cycle})"
    del graph["trainer_client.c"]
    assert violations(graph) == []


def test_allowed_imports_pass() -> None:
    graph = {
        "rollout_service.app": {"rollout_service.weights.partitions", "rollout_service.delivery.broker"},
        "rollout_service.delivery.broker": {"rollout_service.scoring.score", "rollout_service.engine.pool"},
        "rollout_service.weights.weight_sync": {"rollout_service.engine.control", "rollout_service.config"},
        "rollout_service.edge.server": {"grpc", "rollout_api.rollout_pb2_grpc"},
        "rollout_service.engine.managed": {"rollout_service.config", "rollout_common.cpu_budget"},
        "trainer_client.weights": {"vllm_gloo_transfer.packing"},
        "rollout_demo.demo": {"rollout_service.config", "trainer_client.train.run", "trainer_client.local_service"},
    }
    assert violations(graph) == []
