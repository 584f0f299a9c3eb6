"""The project's checks for a machine with CUDA GPUs: ``python tools/gpu_check.py``.

Each check runs in its own process with a time limit and prints one row: what ran, whether
it passed, how long it took and its last line of output. What the machine cannot do (no
CUDA, one GPU, no vLLM) is skipped with the reason, so the table is complete everywhere;
the exit status is 1 when a check that ran failed.

- the trainer's device choice: ``AsyncGRPOConfig`` takes CUDA, with bf16 where it is native;
- a trainer step (the trainer's log-prob paths, loss and AdamW step) in bf16 on CUDA
  (``benchmarks/bench_trainer_step.py``);
- the chunked log-prob memory benchmark (``benchmarks/bench_logprob_memory.py``);
- single-GPU FSDP2: the tiny model sharded with ``fully_shard`` over NCCL, one training step;
- the NCCL sender against a receiver on two GPUs, and the NCCL weight push through the
  service where ``vllm`` is installed (listed, not built yet).
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]

DEVICE_CHOICE = """
from trainer_client.grpo_config import AsyncGRPOConfig
config = AsyncGRPOConfig(output_dir="/tmp/gpu-check", max_steps=1)
assert config.device.type == "cuda", config.device
print(f"device {config.device}, bf16 {config.bf16}")
"""

FSDP_STEP = """
import tempfile, torch, torch.distributed as dist
from pathlib import Path
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM
from rollout_common.tiny_model import build_tiny_model
dist.init_process_group("nccl")
torch.cuda.set_device(0)
model = AutoModelForCausalLM.from_pretrained(build_tiny_model(Path(tempfile.mkdtemp()) / "tiny"), dtype=torch.float32)
model.cuda()
for layer in model.model.layers:
    fully_shard(layer)
fully_shard(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
ids = torch.randint(0, model.config.vocab_size, (4, 64), device="cuda")
with torch.autocast("cuda", dtype=torch.bfloat16):
    loss = model(input_ids=ids, labels=ids).loss
loss.backward()
optimizer.step()
print(f"one FSDP2 step, loss {loss.item():.3f}")
dist.destroy_process_group()
"""


TRAINER_STEP = ["--shape", "qwen2-0.5b", "--device", "cuda", "--dtype", "bfloat16"]
TRAINER_STEP += ["--prompt-tokens", "1024", "--completion-tokens", "256"]


@dataclass
class Check:
    name: str
    command: list[str]
    needs: str | None
    """Why it cannot run here, or None."""
    timeout_s: float = 600


@dataclass
class Outcome:
    name: str
    status: str
    seconds: float
    detail: str


def checks() -> list[Check]:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    no_cuda = None if gpus else "no CUDA device"
    has_vllm = importlib.util.find_spec("vllm") is not None
    python = sys.executable
    return [
        Check("device choice", [python, "-c", DEVICE_CHOICE], no_cuda, 120),
        Check(
            "trainer step, bf16",
            [python, "benchmarks/bench_trainer_step.py", *TRAINER_STEP],
            no_cuda,
        ),
        Check(
            "chunked log-prob memory",
            [python, "benchmarks/bench_logprob_memory.py", "--device", "cuda", "--dtype", "bfloat16"],
            no_cuda,
        ),
        Check(
            "single-GPU FSDP2 step",
            [python, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--no-python", python, "-c", FSDP_STEP],
            no_cuda,
        ),
        Check(
            "NCCL sender against a receiver",
            [],
            ("needs two CUDA devices" if gpus < 2 else None)
            or ("vllm is not installed (its PyNccl sends)" if not has_vllm else None)
            or "not built yet: no two-GPU sender test",
        ),
        Check(
            "NCCL push through the service",
            [],
            no_cuda
            or ("vllm is not installed (pip install 'rollout-service[gpu]')" if not has_vllm else None)
            or "not built yet: no test pushes into a GPU vLLM server",
        ),
    ]


def run(check: Check) -> Outcome:
    if check.needs is not None:
        return Outcome(check.name, "skipped", 0.0, check.needs)
    started = time.monotonic()
    try:
        done = subprocess.run(check.command, cwd=REPO, capture_output=True, text=True, timeout=check.timeout_s)
    except subprocess.TimeoutExpired:
        return Outcome(check.name, "failed", time.monotonic() - started, f"timed out after {check.timeout_s:g}s")
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    last = lines[-1].strip() if lines else ""
    status = "passed" if done.returncode == 0 else f"failed ({done.returncode})"
    return Outcome(check.name, status, time.monotonic() - started, last[:160])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    names = [torch.cuda.get_device_name(i) for i in range(gpus)]
    print(f"torch {torch.__version__}, {gpus} CUDA device(s){': ' + ', '.join(names) if names else ''}")
    outcomes = [run(check) for check in checks()]
    width = max(len(o.name) for o in outcomes)
    print(f"| {'check':<{width}} | status | s | result |")
    print(f"|{'-' * (width + 2)}|---|---|---|")
    for o in outcomes:
        print(f"| {o.name:<{width}} | {o.status} | {o.seconds:.1f} | {o.detail} |")
    return 1 if any(o.status.startswith("failed") for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
