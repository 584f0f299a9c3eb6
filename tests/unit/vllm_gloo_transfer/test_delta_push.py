"""Delta pushes between the trainer's real encoder and sender and the real receiving engines of
the vLLM plugin, in threads of this process: a chain of deltas leaves every worker with the
trainer's weights bit for bit, a missed delta is caught by the checksum before anything is
applied, and only a full push is trusted after it. That vLLM then serves the trainer's logprobs
is shown against a real server in ``tests/integration/test_delta_push.py``."""

from __future__ import annotations

import pytest
import torch

from rollout_api import rollout_pb2 as pb
from tests.support import miss_one_change
from trainer_client.weights.delta import DeltaEncoder, EncodedPush
from trainer_client.weights.gloo import GlooWeightSender
from vllm_gloo_transfer.delta import checksum, sparse_pays, wire_specs
from vllm_gloo_transfer.plugin import GlooWeightTransferEngine, GlooWeightTransferUpdateInfo

from .test_shared_memory_push import joined, together

NamedTensors = list[tuple[str, torch.Tensor]]
ENCODING_NAMES = {pb.TENSOR_ENCODING_FULL: "full", pb.TENSOR_ENCODING_SPARSE: "sparse"}


def update_info(push: EncodedPush) -> dict:
    """The ``/update_weights`` body the service makes of the push's announcement."""
    return {
        "names": [meta.name for meta in push.meta],
        "dtype_names": [meta.dtype for meta in push.meta],
        "shapes": [list(meta.shape) for meta in push.meta],
        "encodings": [ENCODING_NAMES[meta.encoding] for meta in push.meta],
        "counts": [meta.changed for meta in push.meta],
        "checksums": [meta.checksum for meta in push.meta],
    }


def send(sender: GlooWeightSender, engines: list[GlooWeightTransferEngine], push: EncodedPush) -> list[BaseException]:
    """One update: each worker starts it and receives while the trainer sends; their errors."""
    for engine in engines:
        engine.start_weight_update()
    info = update_info(push)
    return together(
        lambda: sender.broadcast(push.wire),
        *((f"worker-{i}", lambda e=engine: e.update_weights(info)) for i, engine in enumerate(engines)),
    )


def weights(seed: int) -> NamedTensors:
    generator = torch.Generator().manual_seed(seed)
    return [
        ("embed.weight", torch.randn(300, 16, generator=generator)),
        ("norm.weight", torch.randn(16, generator=generator).to(torch.bfloat16)),
        ("proj.weight", torch.randn(16, 40, generator=generator)),
    ]


def step(named: NamedTensors, seed: int, share: float) -> NamedTensors:
    """A training step that changes about ``share`` of each tensor's elements."""
    generator = torch.Generator().manual_seed(seed)
    stepped = []
    for name, tensor in named:
        mask = torch.rand(tensor.shape, generator=generator) < share
        noise = torch.randn(tensor.shape, generator=generator).to(tensor.dtype)
        stepped.append((name, torch.where(mask, tensor + noise, tensor)))
    return stepped


def assert_hold(engines: list[GlooWeightTransferEngine], named: NamedTensors) -> None:
    for engine in engines:
        assert [name for name, _ in engine._pending] == [name for name, _ in named]
        for (_, got), (_, want) in zip(engine._pending, named, strict=True):
            assert got.dtype == want.dtype and got.shape == want.shape
            assert torch.equal(got.view(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shared_memory", [True, False])
def test_a_chain_of_deltas_leaves_every_worker_with_the_trainers_weights(shared_memory: bool) -> None:
    encoder = DeltaEncoder()
    current = weights(0)
    with joined(workers=2, shared_memory=shared_memory) as (sender, engines):
        push = encoder.encode(current, full=True)
        assert not push.is_delta and push.wire_bytes == push.full_bytes
        assert not send(sender, engines, push)
        encoder.committed(push)
        for number in range(1, 26):
            current = step(current, number, share=0.02)
            push = encoder.encode(current)
            assert push.is_delta and push.wire_bytes < 0.15 * push.full_bytes, (push.wire_bytes, push.full_bytes)
            assert not send(sender, engines, push)
            encoder.committed(push)
            assert_hold(engines, current)


@pytest.mark.timeout(120)
def test_a_missed_delta_is_caught_by_the_checksum_before_anything_is_applied() -> None:
    encoder = DeltaEncoder()
    current = weights(1)
    with joined(workers=1, shared_memory=True) as (sender, engines):
        push = encoder.encode(current, full=True)
        assert not send(sender, engines, push)
        encoder.committed(push)
        current = step(current, 7, share=0.02)
        missed = encoder.encode(current)
        name = miss_one_change(missed)
        (error,) = send(sender, engines, missed)
        assert f"delta checksum mismatch at {name!r}" in str(error), error
        assert engines[0]._base.tensors == {}, "a base that failed its check is kept"
        assert engines[0]._group is None  # the service aborts the update and re-joins, then pushes in full


@pytest.mark.timeout(120)
def test_after_a_join_a_delta_finds_no_base_and_a_full_push_starts_again() -> None:
    encoder = DeltaEncoder()
    current = weights(2)
    with joined(workers=1, shared_memory=False) as (sender, engines):
        push = encoder.encode(current, full=True)
        assert not send(sender, engines, push)
        encoder.committed(push)
        engines[0]._base.clear()  # as a restarted server holds nothing
        current = step(current, 3, share=0.02)
        (error,) = send(sender, engines, encoder.encode(current))
        assert "holds no base for it" in str(error), error
    with joined(workers=1, shared_memory=False) as (sender, engines):
        encoder.forget()
        push = encoder.encode(current)
        assert not push.is_delta
        assert not send(sender, engines, push)
        assert_hold(engines, current)


def test_a_tensor_that_changes_densely_travels_whole() -> None:
    encoder = DeltaEncoder()
    current = weights(3)
    encoder.committed(encoder.encode(current, full=True))
    current = [(name, tensor + 1 if name == "proj.weight" else tensor) for name, tensor in current]
    push = encoder.encode(current)
    assert [ENCODING_NAMES[meta.encoding] for meta in push.meta] == ["sparse", "sparse", "full"]
    assert [meta.changed for meta in push.meta] == [0, 0, 0]
    assert [name for name, _ in push.wire] == [
        "embed.weight:indices",
        "norm.weight:indices",
        "embed.weight:values",
        "norm.weight:values",
        "proj.weight",
    ]
    specs = wire_specs(
        [t.dtype for _, t in current], [list(t.shape) for _, t in current], ["sparse", "sparse", "full"], [0, 0, 0]
    )
    assert [(spec.dtype, spec.shape) for spec in specs] == [(t.dtype, list(t.shape)) for _, t in push.wire]


def test_only_the_elements_whose_served_value_changed_travel() -> None:
    """float32 master weights pushed to a bf16 server (the pusher casts them): a small step
    leaves most bf16 values as they were."""
    master = torch.randn(1000, generator=torch.Generator().manual_seed(5))
    encoder = DeltaEncoder()
    first = encoder.encode([("w", master.to(torch.bfloat16))])
    assert first.meta[0].dtype == "bfloat16"
    encoder.committed(first)
    stepped = master + 1e-4 * torch.randn(1000, generator=torch.Generator().manual_seed(6))
    push = encoder.encode([("w", stepped.to(torch.bfloat16))])
    changed = int((stepped.to(torch.bfloat16) != master.to(torch.bfloat16)).sum())
    assert 0 < push.meta[0].changed == changed < 100  # about 3% of the elements, where float32 changes all
    assert push.meta[0].checksum == checksum(stepped.to(torch.bfloat16))


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("dtypes", "agreed"),
    [
        ([torch.bfloat16, torch.bfloat16], torch.bfloat16),
        ([torch.float32], torch.float32),
        ([torch.bfloat16, torch.float32], None),  # servers that differ: the trainer's own dtype
        ([torch.bfloat16, None], None),  # a worker that does not say
    ],
)
def test_a_join_tells_the_trainer_the_dtype_every_worker_serves_in(
    dtypes: list[torch.dtype | None], agreed: torch.dtype | None
) -> None:
    with joined(workers=len(dtypes), shared_memory=False, dtypes=dtypes) as (sender, _):
        assert sender.served_dtype == agreed
        sender.leave()
        assert sender.served_dtype is None  # the next join says it again


def test_sparse_pays_below_the_byte_break_even() -> None:
    # int32 index + float32 value = 8 bytes a change, against 4 an element: below half the elements
    assert sparse_pays(1000, 499, torch.float32) and not sparse_pays(1000, 500, torch.float32)
    # int32 index + bf16 value = 6 bytes a change, against 2 an element: below a third
    assert sparse_pays(999, 332, torch.bfloat16) and not sparse_pays(999, 333, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_the_checksum_sees_any_single_changed_element(dtype: torch.dtype) -> None:
    """Across chunk boundaries too (2**18 elements a chunk), and for bits that compare equal as floats."""
    base = torch.zeros(2**18 + 5, dtype=dtype)
    seen = {checksum(base)}
    for position in (0, 1, 2**18 - 1, 2**18, 2**18 + 4):
        changed = base.clone()
        changed[position] = 1
        seen.add(checksum(changed))
    assert len(seen) == 6
    assert checksum(base.clone()) == checksum(base)
    if dtype.is_floating_point:
        negative_zero = base.clone()
        negative_zero[3] = -0.0
        assert checksum(negative_zero) != checksum(base)


def test_an_update_info_with_bad_delta_fields_is_refused() -> None:
    with pytest.raises(ValueError, match="one per name"):
        GlooWeightTransferUpdateInfo(["a"], ["float32"], [[2]], encodings=["full"])
    with pytest.raises(ValueError, match="unknown encodings"):
        GlooWeightTransferUpdateInfo(["a"], ["float32"], [[2]], encodings=["xor"], counts=[0], checksums=[0])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="does not fit a tensor of shape"):
        GlooWeightTransferUpdateInfo(["a"], ["float32"], [[2]], encodings=["sparse"], counts=[3], checksums=[0])
