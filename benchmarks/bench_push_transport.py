"""CPU of a push's transfer over shared memory against gloo, both sides in one process.

Why: on a CPU server the worker's receive runs on the core that generates, and the trainer's
send on the core that trains, so a transfer's cost is its CPU, not its wall time. Here the
trainer's real sender (``trainer_client.weights.GlooWeightSender``) pushes to the vLLM
plugin's real receiving engine (``vllm_gloo_transfer.plugin``, without a model: the apply is
not timed) in a thread of the same process, so one process's CPU clock counts both sides and
gloo's own threads. The two paths alternate push by push, on the same tensors.

Usage::

    python benchmarks/bench_push_transport.py                    # the small model's tensors
    python benchmarks/bench_push_transport.py --model-size tiny --pushes 100
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
from bench_vs_trl import MODEL_SIZES  # the same models as the benchmark against TRL
from rich.console import Console
from rich.table import Table
from transformers import AutoModelForCausalLM

from rollout_common.ports import free_port
from rollout_common.tiny_model import TinyModelSpec, build_tiny_model
from trainer_client.weights.gloo import GlooWeightSender
from trainer_client.weights.sender import update_info_for
from vllm_gloo_transfer.plugin import GlooWeightTransferEngine, GlooWeightTransferInitInfo

HOST = "127.0.0.1"
TIMEOUT_S = 60.0
PATHS = {"shared memory": True, "gloo": False}


@dataclass
class Readings:
    """Per push, in milliseconds."""

    process_cpu: list[float] = field(default_factory=list)
    worker_thread_cpu: list[float] = field(default_factory=list)
    wall: list[float] = field(default_factory=list)


def worker_engine() -> GlooWeightTransferEngine:
    """The plugin's engine as a vLLM worker of rank 1 holds it; only its rank is read from the config."""
    parallel = SimpleNamespace(data_parallel_index=0, world_size=1, rank=0)
    config = SimpleNamespace(parallel_config=parallel, model_config=None)
    return GlooWeightTransferEngine(None, config, torch.device("cpu"), torch.nn.Module())  # type: ignore[arg-type]


def joined(shared_memory: bool, stack: ExitStack) -> tuple[GlooWeightSender, GlooWeightTransferEngine]:
    port = free_port(HOST)
    sender = GlooWeightSender(HOST, port, 2, timeout_s=TIMEOUT_S, shared_memory=shared_memory)
    engine = worker_engine()
    stack.callback(sender.close)
    stack.callback(engine.shutdown)
    info = GlooWeightTransferInitInfo(HOST, port, rank_offset=1, world_size=2, timeout_s=TIMEOUT_S, epoch=1)
    worker = threading.Thread(target=engine.init_transfer_engine, args=(info,))
    worker.start()
    sender.connect(1, 2)
    worker.join(TIMEOUT_S)
    if sender.transport != ("shared memory" if shared_memory else "gloo"):
        raise SystemExit(f"asked for shared memory: {shared_memory}, but the join went over {sender.transport}")
    return sender, engine


def push(
    sender: GlooWeightSender,
    engine: GlooWeightTransferEngine,
    tensors: list[tuple[str, torch.Tensor]],
    info: dict[str, list],
    readings: Readings,
) -> None:
    """One update's transfer: the worker receives in a thread while this thread sends."""
    engine.start_weight_update()
    worker_cpu: list[float] = []

    def receive() -> None:
        started = time.thread_time()
        engine.update_weights(info)
        worker_cpu.append(time.thread_time() - started)

    cpu, wall = time.process_time(), time.perf_counter()
    worker = threading.Thread(target=receive)
    worker.start()
    sender.broadcast(tensors)
    worker.join(TIMEOUT_S)
    readings.wall.append(1e3 * (time.perf_counter() - wall))
    readings.process_cpu.append(1e3 * (time.process_time() - cpu))
    readings.worker_thread_cpu.append(1e3 * worker_cpu[0])
    if len(engine._pending) != len(tensors):
        raise SystemExit(f"the worker holds {len(engine._pending)} tensors where {len(tensors)} were sent")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-size", choices=sorted(MODEL_SIZES), default="small", help="built locally if missing")
    parser.add_argument("--model-dir", type=Path, help="a checkpoint to push instead of --model-size's")
    parser.add_argument("--pushes", type=int, default=60, help="pushes per path (the first 5 of each are left out)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a trainer beside vLLM on 2 cores has 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.model_dir is None:
        path, spec = MODEL_SIZES[args.model_size]
        args.model_dir = build_tiny_model(Path(path), TinyModelSpec(**spec))
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    tensors = [(name, param.detach()) for name, param in model.named_parameters()]
    info = update_info_for(tensors)
    megabytes = sum(t.numel() * t.element_size() for _, t in tensors) / 2**20
    readings = {name: Readings() for name in PATHS}
    with ExitStack() as stack:
        pairs = {name: joined(shared, stack) for name, shared in PATHS.items()}
        for _ in range(args.pushes):
            for name, (sender, engine) in pairs.items():  # alternated: drift hits both alike
                push(sender, engine, tensors, info, readings[name])
    table = Table(title=f"a push of {len(tensors)} tensors ({megabytes:.1f} MiB), medians of {args.pushes - 5} pushes")
    for column in ("path", "CPU, both sides (ms)", "worker thread CPU (ms)", "wall (ms)"):
        table.add_column(column, justify="right")
    for name, read in readings.items():
        table.add_row(
            name,
            *(
                f"{statistics.median(values[5:]):.2f}"
                for values in (read.process_cpu, read.worker_thread_cpu, read.wall)
            ),
        )
    Console().print(table)


if __name__ == "__main__":
    main()
