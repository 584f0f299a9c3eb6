"""Which sender a push uses, and what each backend's servers are told at init.

The nccl path itself needs a GPU and vLLM on the trainer; what can be checked here is that
the service's init body is one vLLM's own nccl engine accepts, that the trainer picks the
sender the service reports, and that a failed nccl join moves to a fresh port (vLLM's
rendezvous cannot be re-joined on the same one).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
import types
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rollout_common.ports import free_port
from rollout_service.engine.control import WeightSyncError
from rollout_service.weights.update_messages import init_info, leave_info
from rollout_service.weights.update_pipeline import await_listening
from tests.support import listening_port
from trainer_client.weights.backends import BACKENDS, sender_for
from trainer_client.weights.gloo import GlooWeightSender, rendezvous_uri
from trainer_client.weights.nccl import NcclWeightSender, call_within
from trainer_client.weights.push import WeightPusher
from trainer_client.weights.sender import UpdateAbandoned, WeightSender
from vllm_gloo_transfer.groups import agree_on_served_dtype, arrive, await_every_rank
from vllm_gloo_transfer.packing import broadcast_buckets
from vllm_gloo_transfer.plugin import GlooWeightTransferInitInfo
from vllm_gloo_transfer.shared_memory import accept_shared_memory


def test_nccl_servers_get_exactly_the_fields_vllms_engine_accepts() -> None:
    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo

    info = init_info("nccl", "10.0.0.2", 29500, rank_offset=3, world_size=5, timeout_s=30, epoch=4, join_timeout_s=5)
    parsed = NCCLWeightTransferInitInfo(**info)
    assert (parsed.master_address, parsed.master_port, parsed.rank_offset, parsed.world_size) == (
        "10.0.0.2", 29500, 3, 5,
    )  # fmt: skip
    with pytest.raises(TypeError):  # why the gloo extras must not be sent to nccl servers
        NCCLWeightTransferInitInfo(**init_info("gloo", "h", 1, 1, 2, 30, 4, 5))


def test_gloo_servers_also_get_the_timeouts_and_join_epoch() -> None:
    info = init_info("gloo", "127.0.0.1", 29500, 1, 2, timeout_s=12.5, epoch=7, join_timeout_s=3.5)
    parsed = GlooWeightTransferInitInfo(**info)
    assert (parsed.epoch, parsed.timeout_s, parsed.join_timeout_s) == (7, 12.5, 3.5)


def test_a_leave_only_init_parses_and_joins_nothing() -> None:
    parsed = GlooWeightTransferInitInfo(**leave_info())
    assert parsed.leave and not GlooWeightTransferInitInfo(**init_info("gloo", "h", 1, 1, 2, 30, 4, 5)).leave


def test_the_sender_follows_the_backend_the_service_reports() -> None:
    assert sender_for("gloo") is GlooWeightSender
    assert sender_for("") is GlooWeightSender  # a service that predates the field
    assert sender_for("nccl") is NcclWeightSender
    assert all(issubclass(sender_for(backend), WeightSender) for backend in BACKENDS)  # one surface for the pusher
    with pytest.raises(ValueError, match=r"'mooncake'.*\['gloo', 'nccl'\]"):
        sender_for("mooncake")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown where there is no GPU")
def test_nccl_join_without_a_gpu_says_what_is_missing() -> None:
    with pytest.raises(RuntimeError, match=r"needs vLLM installed.*CUDA device"):
        NcclWeightSender("127.0.0.1", 1, 2).connect()


class ScriptedControl:
    """Stands in for the service's weight-update RPCs: every begin asks for a join over
    ``backend``. The commit never answers (the servers never receive), or, with ``refusal``,
    fails at once as the service's does when it gave the update up (vLLM went down, say)."""

    def __init__(self, backend: str = "nccl", refusal: str | None = None) -> None:
        self.backend = backend
        self.refusal = refusal
        self.begin_ports: list[int] = []
        self.join_asked: list[bool] = []
        self.aborted: list[str] = []

    async def begin_weight_update(self, run_id, address, port, tensors, pause_mode, resend=False, join_group=False):  # type: ignore[no-untyped-def]
        self.begin_ports.append(port)
        self.join_asked.append(join_group)
        return SimpleNamespace(
            update_id=f"u{len(self.begin_ports)}",
            join_group=True,
            group_world_size=2,
            backend=self.backend,
            group_epoch=1,
        )

    async def commit_weight_update(self, update_id: str, timeout_s: float) -> None:
        if self.refusal is not None:
            raise RuntimeError(self.refusal)
        await asyncio.Event().wait()  # only a cancellation ends it

    async def abort_weight_update(self, update_id: str, reason: str) -> None:
        self.aborted.append(reason)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the join must fail for this check")
async def test_a_failed_nccl_join_is_aborted_and_the_next_join_uses_a_fresh_port() -> None:
    control = ScriptedControl()
    pusher = WeightPusher(control, "run")  # type: ignore[arg-type]
    weights = [("w", torch.zeros(2))]
    for _ in range(2):
        with pytest.raises(RuntimeError, match="nccl"):
            await asyncio.wait_for(pusher.push(weights), 10)
    assert len(control.aborted) == 2 and "RuntimeError" in control.aborted[0]
    assert control.begin_ports[0] != control.begin_ports[1]
    assert control.join_asked == [True, True]  # a pusher without a group says so, whatever its port
    pusher.close()


def test_broadcast_buckets_pack_consecutive_tensors_of_one_dtype_up_to_the_limit() -> None:
    f32, bf16 = torch.float32, torch.bfloat16
    specs = [(f32, 10), (f32, 5), (bf16, 4), (f32, 1), (f32, 30), (f32, 2)]
    # 40 bytes + 20 bytes fit in 100; bf16 breaks the run; 30 floats (120 bytes) exceed it alone
    assert broadcast_buckets(specs, limit=100) == [[0, 1], [2], [3], [4], [5]]
    assert broadcast_buckets(specs) == [[0, 1], [2], [3, 4, 5]]
    assert broadcast_buckets([]) == []


def test_an_nccl_join_that_never_completes_times_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's trainer_init takes no timeout: a worker that never joins would block the trainer
    for good. The sender gives up after its timeout, and says which setting that is."""
    release = threading.Event()
    joins: list[dict] = []

    def trainer_init(rendezvous: dict) -> object:
        joins.append(rendezvous)
        release.wait(30)  # a worker that never joins
        return object()

    fake = types.ModuleType("nccl_common")
    fake.trainer_init = trainer_init  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.distributed.weight_transfer.nccl_common", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    sender = NcclWeightSender("127.0.0.1", 29555, 2, timeout_s=0.2)
    try:
        with pytest.raises(TimeoutError, match=r"NCCL join did not finish within 0.2s \(weight_sync"):
            sender.connect()
        assert joins == [{"master_address": "127.0.0.1", "master_port": 29555, "world_size": 2}]
        assert not sender.connected
    finally:
        release.set()


def test_an_nccl_join_the_service_gave_up_stops_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()
    fake = types.ModuleType("nccl_common")
    fake.trainer_init = lambda rendezvous: release.wait(30)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.distributed.weight_transfer.nccl_common", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    abandoned = threading.Event()
    abandoned.set()
    try:
        with pytest.raises(UpdateAbandoned, match="NCCL join was given up"):
            NcclWeightSender("127.0.0.1", 29555, 2, timeout_s=30).connect(0, 2, abandoned)
    finally:
        release.set()


# vLLM's trainer_init is StatelessProcessGroup.create (rank 0 hosts a TCPStore and blocks until
# every worker connects) followed by the NCCL communicator (GPU only). The first half is real
# here: a join given up while it waits in vLLM's own rendezvous, the next join on a fresh port,
# and a process exit with the abandoned thread still blocked in the store (a gloo group left
# so ends the process with std::terminate, hence a child process).
_RENDEZVOUS_ABANDONED_THEN_REJOINED = """
import sys, threading, time, types
import torch
from vllm.distributed.utils import StatelessProcessGroup
from trainer_client.weights.nccl import NcclWeightSender
from trainer_client.weights.sender import UpdateAbandoned
from rollout_common.ports import free_port

def trainer_init(rendezvous):
    return StatelessProcessGroup.create(
        host=rendezvous["master_address"], port=rendezvous["master_port"], rank=0,
        world_size=rendezvous["world_size"])

fake = types.ModuleType("nccl_common")
fake.trainer_init = trainer_init
sys.modules["vllm.distributed.weight_transfer.nccl_common"] = fake
torch.cuda.is_available = lambda: True

abandoned = threading.Event()
threading.Timer(0.3, abandoned.set).start()
started = time.monotonic()
try:
    NcclWeightSender("127.0.0.1", free_port(), 2, timeout_s=60).connect(0, 2, abandoned)
except UpdateAbandoned:
    print(f"abandoned after {time.monotonic() - started:.2f}s")
port = free_port()
worker = threading.Thread(
    target=StatelessProcessGroup.create, kwargs=dict(host="127.0.0.1", port=port, rank=1, world_size=2))
worker.start()
sender = NcclWeightSender("127.0.0.1", port, 2, timeout_s=60)
sender.connect(0, 2)
worker.join(60)
print("rejoined", sender.connected)
"""


def test_an_nccl_join_given_up_in_vllms_rendezvous_frees_the_trainer_and_the_next_join_works() -> None:
    repo_root = Path(__file__).resolve().parents[4]
    child = subprocess.run(
        [sys.executable, "-c", _RENDEZVOUS_ABANDONED_THEN_REJOINED],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=repo_root,
    )
    assert child.returncode == 0, child.stderr[-2000:]
    abandoned_line, rejoined_line = child.stdout.split("\n")[:2]
    assert abandoned_line.startswith("abandoned after ")
    assert float(abandoned_line.removeprefix("abandoned after ").rstrip("s")) < 5  # not the 60 s timeout
    assert rejoined_line == "rejoined True"
    assert "terminate" not in child.stderr


def test_call_within_returns_the_value_or_raises_the_error() -> None:
    assert call_within(5, "x", lambda a, b: a + b, 2, 3) == 5
    with pytest.raises(ZeroDivisionError):
        call_within(5, "x", lambda: 1 / 0)


def _gloo_worker(port: int, epoch: int, rank: int, world_size: int, out: dict[int, torch.Tensor]) -> None:
    """A server's worker as vllm_gloo_transfer joins: a client of the trainer's store, under the join's epoch."""
    from torch.distributed import PrefixStore, TCPStore
    from torch.distributed.distributed_c10d import ProcessGroupGloo

    store = TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timedelta(seconds=20))
    prefix = PrefixStore(f"{rendezvous_uri('127.0.0.1', port)}/epoch-{epoch}", store)
    arrive(prefix)
    await_every_rank(prefix, world_size, 20)
    group = ProcessGroupGloo(prefix, rank, world_size, timedelta(seconds=20))
    group._set_sequence_number_for_group()
    shared, _ = accept_shared_memory(group)  # the join's last steps, as the plugin takes them
    agree_on_served_dtype(group, None)
    if shared is not None:
        shared.close()
    received = torch.zeros(3)
    group.broadcast(received, 0).wait()
    out[rank] = received
    group.shutdown()


async def test_a_gloo_join_the_service_gave_up_ends_the_push_with_its_reason() -> None:
    """Before, the trainer waited out its whole transfer timeout (120 s by default) for
    workers that would never join; the commit, asked for alongside the join, ends it."""
    control = ScriptedControl("gloo", refusal="weight update u1 was aborted: joining failed: vLLM is down")
    pusher = WeightPusher(control, "run", transfer_timeout_s=120)  # type: ignore[arg-type]
    try:
        with pytest.raises(RuntimeError, match="aborted: joining failed: vLLM is down"):
            await asyncio.wait_for(pusher.push([("w", torch.zeros(2))]), 10)
        assert len(control.aborted) == 1 and "UpdateAbandoned" in control.aborted[0]
    finally:
        pusher.close()


def test_a_gloo_join_gives_up_when_abandoned_or_when_the_workers_never_come() -> None:
    port = free_port("127.0.0.1")
    sender = GlooWeightSender("127.0.0.1", port, world_size=3, timeout_s=0.3)
    try:
        abandoned = threading.Event()
        abandoned.set()
        with pytest.raises(UpdateAbandoned):
            sender.connect(1, 3, abandoned)
        with pytest.raises(TimeoutError, match=r"0 of 2 vLLM workers joined .* within 0.3s \(weight_sync"):
            sender.connect(2, 3)
        assert not sender.connected
    finally:
        sender.close()


def test_a_gloo_join_with_more_servers_goes_through_the_same_store() -> None:
    """A pool that grew: the next join has a larger world. The store the workers connect to
    stays up across it (a restarted one drops workers that connected early). The joins also
    pin the store keys the sender waits for (``GlooWeightSender._await_workers``), a torch internal."""
    port = free_port("127.0.0.1")
    sender = GlooWeightSender("127.0.0.1", port, world_size=2, timeout_s=20)
    for epoch, world_size in ((1, 2), (2, 3)):
        out: dict[int, torch.Tensor] = {}
        workers = [
            threading.Thread(target=_gloo_worker, args=(port, epoch, rank, world_size, out))
            for rank in range(1, world_size)
        ]
        for worker in workers:
            worker.start()
        store = sender._store
        sender.connect(epoch, world_size)
        assert store is None or sender._store is store  # hosted once
        sender._group.broadcast(torch.full((3,), float(epoch)), 0).wait()  # type: ignore[union-attr]
        for worker in workers:
            worker.join(30)
        assert sorted(out) == list(range(1, world_size))
        assert all(torch.equal(tensor, torch.full((3,), float(epoch))) for tensor in out.values())
        sender.leave()
    sender.close()
    with pytest.raises(ValueError, match="world size 2, not 3"):
        NcclWeightSender("127.0.0.1", port, 2).connect(0, 3)


def _waiting_worker(port: int, epoch: int, world_size: int, timeout_s: float, outcome: list[str]) -> None:
    """A server's worker at the join's rendezvous, as the plugin waits there for every rank."""
    from torch.distributed import PrefixStore, TCPStore

    store = TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timedelta(seconds=20))
    prefix = PrefixStore(f"{rendezvous_uri('127.0.0.1', port)}/epoch-{epoch}", store)
    arrive(prefix)
    try:
        await_every_rank(prefix, world_size, timeout_s)
        outcome.append("all arrived")
    except (RuntimeError, TimeoutError) as exc:
        outcome.append(str(exc))


def test_a_worker_waiting_for_a_join_leaves_as_soon_as_the_trainer_gives_it_up() -> None:
    """Before, it waited inside gloo's rendezvous for its whole join timeout, and vLLM's engine
    generated nothing meanwhile."""
    port = free_port("127.0.0.1")
    sender = GlooWeightSender("127.0.0.1", port, world_size=2, timeout_s=20)
    sender.host()
    outcome: list[str] = []
    worker = threading.Thread(target=_waiting_worker, args=(port, 3, 2, 20, outcome))
    try:
        worker.start()
        started = time.monotonic()
        sender.abandon(3, "the weight update was aborted")
        worker.join(10)
        assert outcome == ["the trainer gave this join up: the weight update was aborted"]
        assert time.monotonic() - started < 5  # not the 20 s join timeout
        # A later join, under its own epoch, does not see the abandoned one.
        waiting = threading.Thread(target=_waiting_worker, args=(port, 4, 2, 0.3, outcome))
        waiting.start()
        waiting.join(10)
        assert outcome[1] == (
            "1 of 2 ranks (the trainer and every server's workers) reached the weight-transfer "
            "rendezvous within 0.3s (weight_sync.join_timeout_s)"
        )
    finally:
        sender.close()


async def test_a_join_is_asked_only_once_the_trainers_rendezvous_accepts_connections() -> None:
    await asyncio.wait_for(await_listening("127.0.0.1", listening_port(), 5), 5)
    nobody = free_port("127.0.0.1")
    started = time.monotonic()
    with pytest.raises(WeightSyncError, match=rf"127.0.0.1:{nobody} join: nothing accepted connections .* within 0.3s"):
        await asyncio.wait_for(await_listening("127.0.0.1", nobody, 0.3), 5)
    assert time.monotonic() - started < 2
