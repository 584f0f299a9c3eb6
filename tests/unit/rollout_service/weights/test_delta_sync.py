"""The service's part of delta pushes, against scripted control endpoints: which pushes may be
deltas, what vLLM is told, and what is counted (the pushes themselves are proven against real
vLLM in ``tests/integration/test_delta_push.py``)."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from rollout_service.config import WeightSyncSettings
from rollout_service.errors import FailedPrecondition, InvalidArgument
from rollout_service.metrics import ServiceMetrics
from rollout_service.versions import PolicyVersion
from rollout_service.weights.update_messages import TensorSpec, wire_bytes
from rollout_service.weights.weight_sync import DELTA_REFUSED, WeightSyncCoordinator
from tests.support import listening_port
from tests.unit.rollout_service.weights.scripted_control import Clock, ScriptedControl

FULL = [TensorSpec("w", "float32", (4, 8), "full", 0, 11), TensorSpec("b", "bfloat16", (8,), "full", 0, 12)]
DELTA = [TensorSpec("w", "float32", (4, 8), "sparse", 3, 13), TensorSpec("b", "bfloat16", (8,), "full", 0, 14)]
PLAIN = [TensorSpec("w", "float32", (4, 8)), TensorSpec("b", "bfloat16", (8,))]


class Pushes:
    """A coordinator over one scripted server, and a trainer's pushes to it on one port."""

    def __init__(self, **settings: object) -> None:
        self.clock, self.metrics = Clock(), ServiceMetrics()
        self.server = ScriptedControl(self.clock)
        config = WeightSyncSettings(transfer_timeout_s=60, control_timeout_s=60, **settings)  # type: ignore[arg-type]
        self.sync = WeightSyncCoordinator(
            [self.server], config, PolicyVersion(), metrics=self.metrics, clock=self.clock
        )
        self.port = listening_port()

    async def push(self, tensors: list[TensorSpec]) -> bool:
        """One committed push; whether the ticket allows a delta next."""
        ticket = await self.sync.begin("run", "127.0.0.1", self.port, tensors, "none")
        await asyncio.wait_for(self.sync.commit(ticket.update_id), 5)
        return ticket.delta_allowed

    def counted(self, name: str, **labels: str) -> float:
        return self.metrics.registry.get_sample_value(name, labels) or 0.0


async def test_a_delta_goes_to_the_servers_with_its_encodings_and_checksums() -> None:
    pushes = Pushes(delta=True)
    try:
        assert await pushes.push(FULL)  # the first push joins: full, kept as the base
        assert await pushes.push(DELTA)
    finally:
        await pushes.sync.close()
    full, delta = pushes.server.update_infos
    assert full["encodings"] == ["full", "full"] and full["checksums"] == [11, 12]
    assert delta["encodings"] == ["sparse", "full"] and delta["counts"] == [3, 0] and delta["checksums"] == [13, 14]
    assert pushes.counted("rollout_weight_update_bytes_total", push="delta") == 3 * (4 + 4) + 8 * 2
    assert pushes.counted("rollout_weight_update_bytes_total", push="full") == 32 * 4 + 8 * 2


async def test_a_delta_is_refused_when_the_servers_join_a_fresh_group() -> None:
    """The first push, and the first after a server restarted: a joined server holds no base."""
    pushes = Pushes(delta=True)
    try:
        with pytest.raises(FailedPrecondition, match=DELTA_REFUSED + ".*join a fresh transfer group"):
            await pushes.push(DELTA)
        await pushes.push(FULL)
        pushes.sync.server_restarted()
        with pytest.raises(FailedPrecondition, match="join a fresh transfer group"):
            await pushes.push(DELTA)
        assert await pushes.push(FULL)  # the trainer's full push that follows goes through
        assert await pushes.push(DELTA)
    finally:
        await pushes.sync.close()
    assert pushes.counted("rollout_weight_delta_refused_total", reason="join") == 2
    assert [info["encodings"] for info in pushes.server.update_infos] == [
        ["full", "full"],
        ["full", "full"],
        ["sparse", "full"],
    ]


async def test_a_full_push_is_due_after_full_push_every_deltas() -> None:
    pushes = Pushes(delta=True, full_push_every=2)
    try:
        await pushes.push(FULL)
        await pushes.push(DELTA)
        await pushes.push(DELTA)
        with pytest.raises(
            FailedPrecondition, match=r"full push is due after 2 deltas \(weight_sync.full_push_every\)"
        ):
            await pushes.push(DELTA)
        await pushes.push(FULL)
        await pushes.push(DELTA)  # the count starts again
    finally:
        await pushes.sync.close()
    assert pushes.counted("rollout_weight_delta_refused_total", reason="due") == 1


async def test_with_delta_off_encodings_are_dropped_and_deltas_refused() -> None:
    """A trainer that encodes (it once met a service with delta on) still pushes in full here:
    vLLM gets the plain body, so its servers keep no base, and the ticket says so."""
    pushes = Pushes()
    try:
        assert not await pushes.push(FULL)
        with pytest.raises(FailedPrecondition, match=r"weight_sync\.delta is off"):
            await pushes.push(DELTA)
    finally:
        await pushes.sync.close()
    assert pushes.server.update_infos == [
        {"names": ["w", "b"], "dtype_names": ["float32", "bfloat16"], "shapes": [[4, 8], [8]]}
    ]


async def test_a_push_mixing_encoded_and_plain_tensors_is_refused() -> None:
    pushes = Pushes(delta=True)
    try:
        with pytest.raises(InvalidArgument, match="some tensors give an encoding and some do not"):
            await pushes.sync.begin("run", "127.0.0.1", pushes.port, [FULL[0], PLAIN[1]], "none")
        with pytest.raises(InvalidArgument, match="sparse with 33 changed elements, more than its shape"):
            await pushes.sync.begin(
                "run", "127.0.0.1", pushes.port, [TensorSpec("w", "float32", (4, 8), "sparse", 33)], "none"
            )
    finally:
        await pushes.sync.close()


def test_delta_needs_the_gloo_backend() -> None:
    with pytest.raises(ValidationError, match=r"weight_sync\.delta needs the gloo backend"):
        WeightSyncSettings(backend="nccl", delta=True)


def test_wire_bytes_count_a_sparse_tensors_indices_and_values() -> None:
    assert wire_bytes(PLAIN) == 32 * 4 + 8 * 2
    assert wire_bytes([TensorSpec("e", "bfloat16", (2**31,), "sparse", 10)]) == 10 * (8 + 2)  # int64 indices
