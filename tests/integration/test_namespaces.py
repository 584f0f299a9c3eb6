"""Service, vLLM and trainer in three network namespaces, as on three hosts: the trainer
advertises its own address, the service accepts it as the caller's, vLLM's workers join the
trainer's rendezvous across the bridge, and vLLM then serves exactly the pushed weights."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch
from transformers import Qwen2ForCausalLM

from rollout_common.tiny_model import tiny_model_flags
from rollout_service.config import ManagedServerSettings
from rollout_service.engine.managed import ManagedVLLMServer
from tests.integration.conftest import serving
from tests.integration.netns import Namespaces, namespaces, unavailable
from tests.integration.test_fsdp import FSDP_CONFIG
from tests.integration.test_shared_capacity import start, trainer_command
from tests.integration.test_weight_sync import perturbed, vllm_matches
from tests.support import run_to_end, wait_until
from trainer_client.weights.group_port import GROUP_PORT_SPAN

pytestmark = [pytest.mark.integration, pytest.mark.skipif(bool(unavailable()), reason=unavailable() or "")]

REPO = Path(__file__).resolve().parents[2]
VLLM_PORT, SERVICE_PORT = 8000, 50051
FSDP_STEPS = 2


class NamespacedVLLM(ManagedVLLMServer):
    """The managed server's command, run inside a namespace and bound to its address."""

    def __init__(self, net: Namespaces, host: str, settings: ManagedServerSettings) -> None:
        super().__init__(settings, served_model_name="tiny")
        self.net = net
        self.host = host
        self.port = VLLM_PORT
        self.url = f"http://{net.addresses[host]}:{VLLM_PORT}"

    def command(self) -> list[str]:
        command = super().command()
        command[command.index("--host") + 1] = self.net.addresses[self.host]
        return self.net.prefix(self.host) + command


@contextlib.asynccontextmanager
async def serving_stack(
    net: Namespaces, tiny_model: Path, tmp_path: Path, vllm_host: str = "vllm"
) -> AsyncIterator[tuple[NamespacedVLLM, str]]:
    """vLLM in namespace ``vllm_host`` and ``rollout-service serve`` in ``service``: (vLLM, the service's target)."""
    vllm = NamespacedVLLM(
        net,
        vllm_host,
        ManagedServerSettings(
            model=tiny_model,
            max_model_len=1024,
            dtype="float32",  # held to a float32 reference within 1e-4, as the session's server
            log_file=tmp_path / "vllm.log",
            cpu_placement="off",
        ),
    )
    await asyncio.to_thread(vllm.start)
    service = None
    try:
        target = f"{net.addresses['service']}:{SERVICE_PORT}"
        env = dict(
            os.environ,
            ROLLOUT_HOST=net.addresses["service"],
            ROLLOUT_SECURITY__ALLOW_INSECURE="true",  # a private bridge; TLS is tested elsewhere
            ROLLOUT_ENGINE__TOKENIZER=str(tiny_model),
            ROLLOUT_ENGINE__MODEL="tiny",
            ROLLOUT_ADAPTERS__DIR=str(tmp_path / "adapters"),
        )
        command = [sys.executable, "-m", "rollout_service.edge.cli", "serve", "--vllm-url", vllm.url]
        command += ["--port", str(SERVICE_PORT), "--metrics-port", "0"]
        service = await start([*net.prefix("service"), *command], tmp_path / "service.log", env)
        await wait_until(lambda: serving(target), 90, "the service in its namespace to serve")
        yield vllm, target
    finally:
        if service is not None:
            os.killpg(service.pid, signal.SIGTERM)
            await asyncio.wait_for(service.wait(), 30)
        await asyncio.to_thread(vllm.stop)


@pytest.mark.timeout(420)
async def test_a_push_crosses_three_namespaces(tiny_model: Path, tmp_path: Path) -> None:
    with namespaces("vllm", "service", "trainer") as net:
        async with serving_stack(net, tiny_model, tmp_path) as (vllm, target):
            pusher = [*net.prefix("trainer"), sys.executable, "-m", "tests.integration.netns_pusher"]
            pusher += ["--target", target, "--model", str(tiny_model), "--seed", "5"]
            done = await asyncio.to_thread(
                subprocess.run, pusher, cwd=REPO, capture_output=True, text=True, timeout=240
            )
            assert done.returncode == 0, done.stderr[-3000:]
            result = json.loads(done.stdout.strip().splitlines()[-1])
            # The trainer advertised its own namespace's address, not a loopback one ...
            assert result == {"policy_version": 1, "trainer_address": net.addresses["trainer"]}
            # ... and vLLM, two namespaces away, serves exactly what it pushed.
            base = Qwen2ForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
            assert await vllm_matches(vllm.url, perturbed(base, 5), cache_salt="pushed") <= 1e-4


# The recipe of docs "Across hosts": each host opens its named ports and the range its
# system binds unnamed ones from, which the gloo group's own listeners take.
SERVICE_HOST_DATA_PORTS, TRAINER_HOST_DATA_PORTS = (40000, 40499), (41000, 41499)
GROUP_PORT = 51216


@pytest.mark.timeout(480)
async def test_a_trainer_on_another_host_trains_through_only_the_named_ports(tiny_model: Path, tmp_path: Path) -> None:
    """The service and vLLM on one host, ``rollout-trainer`` on another, and between them a
    firewall open only on the service's gRPC port, the trainer's ``--vllm_group_port`` span
    and each host's local port range: two steps train, each pushed over gloo across it."""
    with namespaces("service", "trainer") as net:
        for host, (first, last) in (("service", SERVICE_HOST_DATA_PORTS), ("trainer", TRAINER_HOST_DATA_PORTS)):
            net.local_ports(host, first, last)
        net.accept_only("service", str(SERVICE_PORT), "-".join(map(str, SERVICE_HOST_DATA_PORTS)))
        net.accept_only(
            "trainer", f"{GROUP_PORT}-{GROUP_PORT + GROUP_PORT_SPAN - 1}", "-".join(map(str, TRAINER_HOST_DATA_PORTS))
        )
        # The wall holds: what a system would pick without the recipe is out of reach, both ways.
        assert not await asyncio.to_thread(net.connects, "service", "trainer", 45000)
        assert not await asyncio.to_thread(net.connects, "trainer", "service", 45000)
        assert await asyncio.to_thread(net.connects, "service", "trainer", TRAINER_HOST_DATA_PORTS[0])
        async with serving_stack(net, tiny_model, tmp_path, vllm_host="service") as (_, target):
            out = tmp_path / "train"
            command = [*net.prefix("trainer"), *trainer_command(target, tiny_model, out, "--max_steps", "2")]
            command += ["--vllm_group_port", str(GROUP_PORT), "--shared_memory_push", "false"]  # another host
            code, output = await run_to_end(command, 300, cwd=REPO)
            assert code == 0, output[-3000:]
            assert f"rendezvous at {net.addresses['trainer']}:{GROUP_PORT} " in output, output[-3000:]
            assert "weights travel over gloo" in output, output[-3000:]
            summary = json.loads((out / "summary.json").read_text())
            assert summary["final_policy_version"] == 2, summary


async def all_exit_cleanly(nodes: dict[str, asyncio.subprocess.Process], logs: Path, timeout_s: float) -> None:
    """Wait for every node's torchrun together, and fail at the first that exits non-zero, with
    its log: waited for one by one, a node whose partner had died waited out the whole timeout."""
    waits = {asyncio.ensure_future(process.wait()): node for node, process in nodes.items()}
    deadline = asyncio.get_running_loop().time() + timeout_s
    pending = set(waits)
    try:
        while pending:
            remaining = deadline - asyncio.get_running_loop().time()
            done, pending = await asyncio.wait(pending, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
            assert done, f"{', '.join(waits[task] for task in pending)} still running after {timeout_s:.0f} s"
            for task in done:
                log = (logs / f"{waits[task]}.log").read_text()[-3000:]
                assert task.result() == 0, f"{waits[task]} exited {task.result()}: {log}"
    finally:
        for task in pending:
            task.cancel()


@pytest.mark.timeout(480)
async def test_an_fsdp_trainer_on_two_nodes_pushes_the_gathered_weights(tiny_model: Path, tmp_path: Path) -> None:
    """``torchrun --nnodes 2 --nproc-per-node 1``, one node per namespace, FSDP2 on gloo: the
    ranks meet across the bridge (each binds gloo to its own interface, GLOO_SOCKET_IFNAME),
    rank 0 gathers the shards and pushes, and vLLM, in a third namespace, serves exactly the
    gathered weights."""
    with namespaces("vllm", "service", "node0", "node1") as net:
        async with serving_stack(net, tiny_model, tmp_path) as (vllm, target):
            config = tmp_path / "fsdp.yaml"
            config.write_text(FSDP_CONFIG)
            out = tmp_path / "train"
            nodes = []
            try:
                for rank, node in enumerate(("node0", "node1")):
                    command = [*net.prefix(node), sys.executable, "-m", "torch.distributed.run", "--nnodes", "2"]
                    command += ["--nproc-per-node", "1", "--node-rank", str(rank), "--master-addr"]
                    command += [net.addresses["node0"], "--master-port", "29511", "-m", "trainer_client.cli"]
                    command += ["--config", str(config), "--target", target, "--model", str(tiny_model)]
                    command += tiny_model_flags(
                        max_steps=FSDP_STEPS, num_generations=4, per_device_train_batch_size=4, max_completion_length=16
                    )
                    command += ["--output-dir", str(out), "--save-model"]
                    env = dict(os.environ, GLOO_SOCKET_IFNAME=net.interfaces[node], OMP_NUM_THREADS="1")
                    nodes.append(await start(command, tmp_path / f"{node}.log", env))
                await all_exit_cleanly(dict(zip(("node0", "node1"), nodes, strict=True)), tmp_path, 300)
            finally:
                for process in nodes:
                    if process.returncode is None:
                        os.killpg(process.pid, signal.SIGKILL)
            ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
            assert [rank["sharded"] for rank in ranks] == [True, True]
            ids = [rank["trained_group_ids"] for rank in ranks]
            assert [len(i) for i in ids] == [FSDP_STEPS, FSDP_STEPS] and not set(ids[0]) & set(ids[1])
            trained = Qwen2ForCausalLM.from_pretrained(out / "model", dtype=torch.float32).eval()
            base = Qwen2ForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
            assert await vllm_matches(vllm.url, trained) <= 1e-4
            assert await vllm_matches(vllm.url, base) > 1e-3
