"""The gloo push's same-host path (``vllm_gloo_transfer.shared_memory``), between the
trainer's real sender and the real receiving engine of the vLLM plugin, in threads of this
process: the join agrees on shared memory when every worker reaches it and on gloo
otherwise, and either way the worker ends with exactly the tensors the trainer sent. That a
pushed model then serves the trainer's logprobs is shown against a real vLLM server in
``tests/integration/test_weight_transfer.py``, over both paths.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from rollout_common.ports import free_port
from trainer_client.weights.gloo import GlooWeightSender
from trainer_client.weights.sender import update_info_for
from vllm_gloo_transfer.plugin import GlooWeightTransferEngine, GlooWeightTransferInitInfo
from vllm_gloo_transfer.shared_memory import (
    ALIGN_BYTES,
    HEADER_BYTES,
    OutOfReach,
    SharedWeightsFile,
    SharedWeightsMapping,
    layout,
)

NamedTensor = tuple[str, torch.Tensor]
HOST = "127.0.0.1"
TIMEOUT_S = 20.0


def worker_engine(rank: int, dtype: torch.dtype | None = None) -> GlooWeightTransferEngine:
    """The plugin's engine as one vLLM worker holds it; its rank and its model's dtype are read
    from the config."""
    parallel = SimpleNamespace(data_parallel_index=0, world_size=1, rank=rank - 1)
    config = SimpleNamespace(parallel_config=parallel, model_config=dtype and SimpleNamespace(dtype=dtype))
    return GlooWeightTransferEngine(None, config, torch.device("cpu"), torch.nn.Module())  # type: ignore[arg-type]


def in_thread(name: str, target: Callable[[], Any]) -> tuple[threading.Thread, list[BaseException]]:
    """Run ``target`` in a started thread; what it raises lands in the returned list."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            target()
        except BaseException as exc:  # handed to the test, which asserts on it
            errors.append(exc)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread, errors


def together(trainer_side: Callable[[], Any], *worker_sides: tuple[str, Callable[[], Any]]) -> list[BaseException]:
    """The trainer's call in this thread while each worker's runs in its own, as the service
    makes the servers' calls while the trainer sends; every worker error, in order."""
    workers = [in_thread(name, side) for name, side in worker_sides]
    trainer_side()
    errors = []
    for thread, thread_errors in workers:
        thread.join(TIMEOUT_S)
        assert not thread.is_alive(), "a worker is still blocked after the trainer's side returned"
        errors.extend(thread_errors)
    return errors


@contextmanager
def joined(
    workers: int, shared_memory: bool, dtypes: list[torch.dtype | None] | None = None
) -> Iterator[tuple[GlooWeightSender, list[GlooWeightTransferEngine]]]:
    """A sender joined to ``workers`` engines, as the first push of a run joins them;
    ``dtypes``: each worker's model dtype (default: none known)."""
    port = free_port(HOST)
    world_size = workers + 1
    sender = GlooWeightSender(HOST, port, world_size, timeout_s=TIMEOUT_S, shared_memory=shared_memory)
    engines = [worker_engine(rank, (dtypes or [None] * workers)[rank - 1]) for rank in range(1, world_size)]
    info = GlooWeightTransferInitInfo(HOST, port, rank_offset=1, world_size=world_size, timeout_s=TIMEOUT_S, epoch=1)
    try:
        joins = [(f"worker-{i}", lambda e=engine: e.init_transfer_engine(info)) for i, engine in enumerate(engines)]
        errors = together(lambda: sender.connect(1, world_size), *joins)
        assert not errors, errors
        yield sender, engines
    finally:
        for engine in engines:
            engine.shutdown()
        sender.close()


def push(sender: GlooWeightSender, engines: list[GlooWeightTransferEngine], tensors: list[NamedTensor]) -> None:
    """One update: each worker starts it and receives while the trainer sends."""
    for engine in engines:
        engine.start_weight_update()
    info = update_info_for(tensors)
    errors = together(
        lambda: sender.broadcast(tensors),
        *((f"worker-{i}", lambda e=engine: e.update_weights(info)) for i, engine in enumerate(engines)),
    )
    assert not errors, errors


def mixed_tensors(scale: int, seed: int) -> list[NamedTensor]:
    """Several dtypes, odd sizes (so offsets need their alignment), a non-contiguous view."""
    generator = torch.Generator().manual_seed(seed)
    return [
        ("embed.weight", torch.randn(7 * scale, 5, generator=generator)),
        ("norm.weight", torch.randn(3, generator=generator).to(torch.bfloat16)),
        ("proj.weight", torch.randn(5, 9 * scale, generator=generator).t()),
        ("steps", torch.arange(11 * scale, dtype=torch.int64)),
        ("scalar", torch.tensor(2.5)),
    ]


def assert_received(engine: GlooWeightTransferEngine, sent: list[NamedTensor]) -> None:
    received = engine._pending
    assert [name for name, _ in received] == [name for name, _ in sent]
    for (_, got), (_, want) in zip(received, sent, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("shared_memory", "transport"), [(True, "shared memory"), (False, "gloo")])
def test_each_worker_gets_exactly_what_the_trainer_sent_on_either_path(shared_memory: bool, transport: str) -> None:
    """The second push is larger, so the shared file grows and the workers map it again."""
    with joined(workers=2, shared_memory=shared_memory) as (sender, engines):
        assert sender.transport == transport
        assert all((engine._shared is not None) == shared_memory for engine in engines)
        for scale, seed in ((1, 0), (40, 1)):
            sent = mixed_tensors(scale, seed)
            push(sender, engines, sent)
            for engine in engines:
                assert_received(engine, sent)


@pytest.mark.timeout(60)
def test_one_worker_out_of_reach_sends_the_whole_group_over_gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    """A broadcast reaches every worker alike: one server on another host (here: one worker
    that cannot open the trainer's file) puts the whole group on gloo, and both get the data."""
    reach = SharedWeightsMapping.open

    def open_unless_remote(offer: torch.Tensor) -> SharedWeightsMapping:
        if threading.current_thread().name == "worker-1":
            raise OutOfReach("on another host")
        return reach(offer)

    monkeypatch.setattr(SharedWeightsMapping, "open", staticmethod(open_unless_remote))
    with joined(workers=2, shared_memory=True) as (sender, engines):
        assert sender.transport == "gloo"
        assert [engine._shared for engine in engines] == [None, None]
        sent = mixed_tensors(3, 2)
        push(sender, engines, sent)
        for engine in engines:
            assert_received(engine, sent)


@pytest.mark.timeout(60)
def test_a_second_receive_in_one_update_is_refused_over_shared_memory() -> None:
    """The trainer's next write would replace the first call's tensors under the worker."""
    with joined(workers=1, shared_memory=True) as (sender, [engine]):
        sent = mixed_tensors(1, 0)
        push(sender, [engine], sent)
        info = update_info_for(sent)
        thread, errors = in_thread("worker-0", lambda: engine.update_weights(info))
        thread.join(TIMEOUT_S)
        assert len(errors) == 1 and "a second update_weights in one update" in str(errors[0])
        assert engine._group is None and engine._pending == []  # dropped: the trainer re-joins


def test_a_worker_takes_the_offer_only_when_it_finds_the_trainers_own_file() -> None:
    file = SharedWeightsFile.create()
    assert file is not None
    try:
        offer = file.offer()
        SharedWeightsMapping.open(offer).close()
        forged = offer.clone()
        forged[3] += 1  # the right kind of file, another nonce: another trainer's, in another pid namespace
        with pytest.raises(OutOfReach, match="is not the trainer's file here"):
            SharedWeightsMapping.open(forged)
        gone = offer.clone()
        gone[2] = 10_000  # no such descriptor
        with pytest.raises(OutOfReach, match=r"is out of reach: .*No such file"):
            SharedWeightsMapping.open(gone)
        with open(__file__, "rb") as other:  # some other file of that process: not even opened
            elsewhere = offer.clone()
            elsewhere[2] = other.fileno()
            with pytest.raises(OutOfReach, match="is not the trainer's file here"):
                SharedWeightsMapping.open(elsewhere)
        with pytest.raises(OutOfReach, match="offers no shared memory"):
            SharedWeightsMapping.open(torch.zeros_like(offer))
    finally:
        file.close()


def test_the_layout_aligns_every_tensor_after_the_header() -> None:
    offsets, size = layout([(torch.float32, 3), (torch.bfloat16, 1), (torch.int64, 0), (torch.float32, 16)])
    # 12 bytes and 2 bytes take one aligned block each; an empty tensor takes none.
    assert offsets == [HEADER_BYTES + k * ALIGN_BYTES for k in (0, 1, 2, 2)]
    assert size == HEADER_BYTES + 3 * ALIGN_BYTES
