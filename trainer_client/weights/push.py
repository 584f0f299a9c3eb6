"""Pushes the trainer's weights into the service's vLLM servers (the main rank only).

The service coordinates; the tensors go straight to the vLLM workers over the transfer group.
On any failure the group is left, freeing workers blocked in a receive, and the update is
aborted, so generation resumes on the old weights and the next push re-joins.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Sequence

import torch

from rollout_api import rollout_pb2 as pb
from rollout_api.client import RolloutClient
from trainer_client.step_timing import PhaseClock
from trainer_client.weights.backends import sender_for
from trainer_client.weights.delta import DeltaEncoder, EncodedPush, nbytes
from trainer_client.weights.group_port import GroupPortClaim
from trainer_client.weights.policy_weights import adapter_files, policy_weights
from trainer_client.weights.sender import UpdateAbandoned, WeightSender, dtype_name

logger = logging.getLogger(__name__)


def tensor_meta(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> list[pb.TensorMeta]:
    return [
        pb.TensorMeta(name=name, dtype=dtype_name(tensor.dtype), shape=list(tensor.shape))
        for name, tensor in named_tensors
    ]


class WeightPusher:
    """Holds the transfer group across pushes (vLLM joins it once) and re-joins after a failure."""

    def __init__(
        self,
        client: RolloutClient,
        run_id: str,
        trainer_address: str = "127.0.0.1",
        transfer_timeout_s: float = 120.0,
        pause_mode: pb.PauseMode.ValueType = pb.PAUSE_MODE_UNSPECIFIED,
        clock: PhaseClock | None = None,
        shared_memory: bool = True,
        group_port: int = 0,
    ) -> None:
        """``shared_memory``: reach servers on this host through shared memory (gloo);
        ``group_port``: the first port to host the rendezvous on (0: any free port)."""
        self.client = client
        self.clock = clock or PhaseClock()
        """Gets each push's push_begin, push_transfer and push_commit seconds."""
        self.run_id = run_id
        self.address = trainer_address
        self.timeout_s = transfer_timeout_s
        self.pause_mode = pause_mode
        self.shared_memory = shared_memory
        self._sender: WeightSender | None = None
        self._delta: DeltaEncoder | None = None
        """Set once the service keeps pushes as delta bases (``weight_sync.delta``)."""
        self.delta_repairs = 0
        """Delta pushes refused or failed, each then pushed in full at once."""
        self.bytes_pushed = 0
        """Bytes of the committed pushes' tensors, as they travelled (a delta's indices and values)."""
        self._port_claim = GroupPortClaim(trainer_address, group_port)
        logger.info("weight push rendezvous at %s:%d (vLLM's workers connect to it)", trainer_address, self.port)

    @property
    def served_dtype(self) -> torch.dtype | None:
        """The servers' dtype, as their workers told it at the last join: floating-point weights
        travel in it from then on. None (unknown, or they differ): the trainer's own."""
        return None if self._sender is None else self._sender.served_dtype

    @property
    def port(self) -> int:
        """The rendezvous port this trainer hosts (nccl: a fresh one after each failed join)."""
        return self._port_claim.port

    async def push_policy(self, model: torch.nn.Module, resend: bool = False) -> int:
        """Push what vLLM must serve for ``model`` (merged, for a PEFT model); the new version."""
        return await self.push(policy_weights(model), resend)

    async def push(self, named_tensors: Sequence[tuple[str, torch.Tensor]], resend: bool = False) -> int:
        """Send the tensors (HF names, broadcast order) and return the new policy version.
        ``resend``: the current version's weights again, as the service asked; the version stays.
        Where the service keeps delta bases, only what changed since the last push travels; a
        delta refused or failed (a server missed one) is pushed again in full at once."""
        encoder = self._delta
        # The encoder keeps them as the servers' weights, so it gets copies, never the parameters.
        tensors = [
            (name, served(tensor.detach(), self.served_dtype, copy=encoder is not None))
            for name, tensor in named_tensors
        ]
        encoded = None if encoder is None else encoder.encode(tensors, full=not encoder.has_base)
        try:
            return await self._push(tensors, encoded, resend)
        except Exception as exc:
            if encoder is not None:
                encoder.forget()  # the servers may hold either version now
            if encoded is None or not encoded.is_delta:
                raise
            self.delta_repairs += 1
            logger.warning("a delta push failed; pushing in full: %s", exc)
            assert encoder is not None
            return await self._push(tensors, encoder.encode(tensors, full=True), resend)

    async def _push(self, tensors: list[tuple[str, torch.Tensor]], encoded: EncodedPush | None, resend: bool) -> int:
        """One attempt: begin, broadcast and commit ``tensors`` (``encoded``: as a delta encoder sends them)."""
        meta = tensor_meta(tensors) if encoded is None else encoded.meta
        wire = tensors if encoded is None else encoded.wire
        with self.clock.measure("push_begin"):
            # A trainer restarted on its fixed port has the last group's address and port,
            # but no group: it says so, or the servers would not join it.
            holds_group = self._sender is not None and self._sender.connected
            ticket = await self.client.begin_weight_update(
                self.run_id,
                self.address,
                self.port,
                meta,
                self.pause_mode,
                resend=resend,
                join_group=not holds_group,
            )
        # Commit now, not after the transfer: the service also answers it at once when it aborts
        # the update, which ends a join waiting for workers that will never come.
        commit = asyncio.create_task(self.client.commit_weight_update(ticket.update_id, 2 * self.timeout_s + 60))
        abandoned = threading.Event()
        commit.add_done_callback(lambda _: abandoned.set())
        try:
            with self.clock.measure("push_transfer"):
                await self._send(ticket, wire, abandoned, commit)
            with self.clock.measure("push_commit"):
                committed = await commit
        except BaseException as exc:
            commit.cancel()
            refused = commit.exception() if commit.done() and not commit.cancelled() else None
            if self._sender is not None:
                self._sender.leave()  # frees workers blocked in a receive; the gloo store stays
                if self._sender.REJOIN_NEEDS_NEW_PORT:
                    self._port_claim.renew()
            with contextlib.suppress(Exception):
                await self.client.abort_weight_update(ticket.update_id, f"trainer: {type(exc).__name__}: {exc}")
            if isinstance(exc, UpdateAbandoned) and refused is not None:
                raise refused from None  # the service's reason, not "given up"
            raise
        self._committed(ticket, encoded)
        sent = nbytes(tensor for _, tensor in wire)
        self.bytes_pushed += sent
        share = "" if encoded is None else f" ({sent / max(1, encoded.full_bytes):.1%} of their bytes)"
        logger.info(
            "pushed %d tensors%s: policy version %d (%.2fs)",
            len(tensors),
            share,
            committed.policy_version,
            committed.seconds,
        )
        return committed.policy_version

    def _committed(self, ticket: pb.BeginWeightUpdateResponse, encoded: EncodedPush | None) -> None:
        """After a commit: hold what the servers now serve if they keep delta bases, else stop encoding."""
        if not ticket.delta_allowed:
            self._delta = None
            return
        if self._delta is None:
            self._delta = DeltaEncoder()  # the next push is full, and kept as the base
        elif encoded is not None:
            self._delta.committed(encoded)

    async def _send(
        self,
        ticket: pb.BeginWeightUpdateResponse,
        tensors: list[tuple[str, torch.Tensor]],
        abandoned: threading.Event,
        commit: asyncio.Task[pb.CommitWeightUpdateResponse],
    ) -> None:
        """Broadcast the tensors, joining the transfer group first when asked; give up as soon
        as ``commit`` fails (the service aborted the update)."""
        if ticket.join_group:
            # First push, or the servers dropped the group; the world size may have changed.
            sender_class = sender_for(ticket.backend)
            world_size = ticket.group_world_size
            if (
                not isinstance(self._sender, sender_class)
                or self._sender.master_port != self.port
                or (self._sender.world_size != world_size and not self._sender.RESIZES_IN_PLACE)
            ):
                self._close_sender()
                self._sender = sender_class(self.address, self.port, world_size, self.timeout_s, self.shared_memory)
            self._sender.leave()
            await asyncio.to_thread(self._sender.connect, ticket.group_epoch, world_size, abandoned)
            logger.info("joined %d vLLM workers; weights travel over %s", world_size - 1, self._sender.transport)
        assert self._sender is not None and self._sender.connected, "no group is open, but no join was asked"
        if abandoned.is_set():  # aborted during the join: no server will receive this broadcast
            raise UpdateAbandoned("the update was given up before the broadcast")
        broadcast = asyncio.ensure_future(asyncio.to_thread(self._sender.broadcast, tensors))
        await asyncio.wait({broadcast, commit}, return_when=asyncio.FIRST_COMPLETED)
        if not broadcast.done() and (commit.cancelled() or commit.exception() is not None):
            # Aborted mid-broadcast: gloo cannot cancel a send, so its thread is left to end at
            # the group's timeout (on the group left below) while the trainer goes on.
            broadcast.add_done_callback(_outcome_dropped)
            raise UpdateAbandoned("the update was given up during the broadcast")
        await broadcast

    def close(self) -> None:
        """Leave the group, stop hosting its store and free its port."""
        self._close_sender()
        self._port_claim.release()

    def _close_sender(self) -> None:
        if self._sender is not None:
            self._sender.close()
            self._sender = None


def _outcome_dropped(broadcast: asyncio.Future[None]) -> None:
    """A broadcast given up: its failure at the group's timeout is expected, not news."""
    if not broadcast.cancelled() and broadcast.exception() is not None:
        logger.debug("an abandoned broadcast ended: %s", broadcast.exception())


class AdapterPusher:
    """Pushes a PEFT model's adapter to a serve_adapter run; the shared base weights stay untouched."""

    def __init__(self, client: RolloutClient, run_id: str) -> None:
        self.client = client
        self.run_id = run_id
        self.timeout_s = 120.0

    async def push_policy(self, model: torch.nn.Module, resend: bool = False) -> int:
        """Publish the adapter; the new version. ``resend`` is unused: the service reloads adapters itself."""
        files = await asyncio.to_thread(adapter_files, model)
        pushed = await self.client.push_adapter(self.run_id, files, self.timeout_s)
        logger.info(
            "pushed adapter %s (%d bytes): policy version %d (%.2fs)",
            pushed.adapter_name,
            sum(len(data) for data in files.values()),
            pushed.policy_version,
            pushed.seconds,
        )
        return pushed.policy_version

    def close(self) -> None:
        """Nothing to release: adapters travel over the gRPC channel."""


def served(tensor: torch.Tensor, dtype: torch.dtype | None, copy: bool) -> torch.Tensor:
    """``tensor`` as it travels: floating point in the servers' ``dtype`` (None: its own), as
    vLLM's loaders would cast it; ``copy``: never a view of ``tensor`` (one cast copy at most)."""
    if dtype is not None and tensor.is_floating_point():
        return tensor.to(dtype, copy=copy)
    return tensor.clone() if copy else tensor
