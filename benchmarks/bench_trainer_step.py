"""A trainer step's time and peak memory on each of the trainer's three log-prob paths.

Why: the trainer computes completion log-probs in one of three ways, and which is fastest
depends on the device and the batch's shape (README, "On a GPU"):

- ``full logits``: the model's own [B, T, V] logits at the completion positions, TRL's way
  (``batches.forward_completion_logprobs``, the trainer's path under FSDP);
- ``chunked``: the final hidden states projected onto the lm_head in ``--chunk-size``
  chunks, each recomputed in the backward when there is more than one
  (``batches.completion_logprobs``, ``share_prompt_forward: false``);
- ``chunked + shared prompts``: as ``chunked``, with each distinct prompt run once and its
  completions on its KV cache (``prompt_sharing``).

It also prints which of the last two the trainer takes by default for this batch on this
device (``prompt_sharing.sharing_pays``).

A step is the trainer's math on one step's samples: ``GroupCollator`` on synthetic groups
(random prompt and completion tokens, ``--prompts`` prompts x ``--group-size`` samples),
log-probs, ``compute_loss`` (dapo), backward and an AdamW step. It prints the median step
time over ``--steps`` steps after ``--warmup``, and on CUDA the peak memory the step adds to
the weights and optimizer state. Only torch and transformers are needed (no gRPC stubs), so
it runs on a GPU box without the rest of the project installed.

Usage::

    python benchmarks/bench_trainer_step.py                                 # the CPU benchmark model
    python benchmarks/bench_trainer_step.py --shape qwen2-0.5b --device cuda --dtype bfloat16 \\
        --prompt-tokens 1024 --completion-tokens 256
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, installed or not

from trainer_client.loss.config import LossConfig
from trainer_client.loss.losses import compute_loss
from trainer_client.stream.batches import (
    GroupCollator,
    completion_logprobs,
    forward_completion_logprobs,
    output_embedding_weight,
)
from trainer_client.stream.prompt_sharing import shared_prompt_logprobs, sharing_pays, skipped_fraction

SHAPES = {
    "small": {  # bench_vs_trl.py's small model (1.64M parameters)
        "hidden_size": 256, "intermediate_size": 640, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 1024,
    },
    "qwen2-0.5b": {  # Qwen2.5-0.5B's shape, randomly initialised (nothing is downloaded)
        "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
        "num_key_value_heads": 2, "vocab_size": 151_936,
    },
    "qwen2-1.5b": {  # Qwen2.5-1.5B's shape
        "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
        "num_key_value_heads": 2, "vocab_size": 151_936,
    },
}  # fmt: skip
PATHS = ("full logits", "chunked", "chunked + shared prompts")


def synthetic_batch(args: argparse.Namespace, vocab: int, generator: torch.Generator) -> dict[str, Any]:
    """One step's samples through the trainer's own collator: whole groups of ``--group-size``
    completions of ``--completion-tokens`` tokens after a ``--prompt-tokens`` prompt each."""
    items = []
    for index in range(args.prompts):
        prompt = torch.randint(3, vocab, (args.prompt_tokens,), generator=generator).tolist()
        group = SimpleNamespace(prompt_token_ids=prompt, policy_version=0, group_id=f"g{index}")
        for _ in range(args.group_size):
            completion = torch.randint(3, vocab, (args.completion_tokens,), generator=generator).tolist()
            sample = SimpleNamespace(
                prompt_token_ids=(),
                completion_token_ids=completion,
                completion_mask=[1] * len(completion),
                completion_logprobs=[-5.0] * len(completion),
                advantage=float(torch.randn((), generator=generator)),
                reward=0.0,
            )
            items.append({"group": group, "sample": sample})
    return GroupCollator(pad_token_id=0)(items)


def log_prob_path(name: str, chunk_size: int) -> Callable[[torch.nn.Module, dict[str, Any]], torch.Tensor]:
    if name == "full logits":
        return lambda model, inputs: forward_completion_logprobs(model, inputs)
    if name == "chunked":
        return lambda model, inputs: completion_logprobs(
            model, inputs, output_embedding_weight(model), chunk_size, share_prompts=False
        )
    return lambda model, inputs: shared_prompt_logprobs(model, inputs, output_embedding_weight(model), chunk_size)


def time_path(args: argparse.Namespace, model: torch.nn.Module, batch: dict[str, Any], name: str) -> dict[str, Any]:
    device = next(model.parameters()).device
    inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    logprobs = log_prob_path(name, args.chunk_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    config = LossConfig(loss_type="dapo")
    mask = inputs["completion_mask"]

    def step() -> None:
        logps = logprobs(model, inputs)
        output = compute_loss(
            logps, None, inputs["behaviour_logps"], inputs["advantages"], mask, config, num_items_in_batch=mask.sum()
        )
        output.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    cuda = device.type == "cuda"
    try:
        step()  # the optimizer's state exists from here on: part of the baseline, not of a step
        if cuda:
            torch.cuda.synchronize()
            baseline = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        times = []
        for index in range(args.warmup + args.steps):
            started = time.perf_counter()
            step()
            if cuda:
                torch.cuda.synchronize()
            if index >= args.warmup:
                times.append(time.perf_counter() - started)
    except torch.OutOfMemoryError:
        return {"path": name, "error": "out of memory"}
    result: dict[str, Any] = {"path": name, "step_ms": 1e3 * statistics.median(times)}
    if cuda:
        result["peak_extra_gib"] = (torch.cuda.max_memory_allocated() - baseline) / 2**30
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--prompts", type=int, default=4, help="distinct prompts per step")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=34)
    parser.add_argument("--completion-tokens", type=int, default=32)
    parser.add_argument("--chunk-size", type=int, default=1024, help="the trainer's logprob_chunk_size")
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    parser.add_argument("--threads", type=int, default=1, help="torch threads on CPU")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--output", type=Path, help="also write the results as JSON here")
    args = parser.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return args


def main(argv: list[str] | None = None) -> None:
    from rich.console import Console
    from rich.table import Table
    from transformers import Qwen2Config, Qwen2ForCausalLM

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = Qwen2Config(**SHAPES[args.shape], tie_word_embeddings=True, max_position_embeddings=8192)
    with torch.device(args.device):  # initialised where it runs: a 1.5B model's init on a CPU takes a minute
        model = Qwen2ForCausalLM(config).to(getattr(torch, args.dtype))
    batch = synthetic_batch(args, config.vocab_size, torch.Generator().manual_seed(0))
    results = []
    for name in args.paths:
        results.append(time_path(args, model, batch, name))
        if args.device == "cuda":  # the path's optimizer state and leftovers are gone: return their memory
            torch.cuda.empty_cache()

    table = Table(
        title=f"trainer step, {args.shape} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M) on {args.device}, "
        f"{args.dtype}: {args.prompts} prompts x {args.group_size}, {args.prompt_tokens} + {args.completion_tokens} "
        f"tokens, chunk {args.chunk_size}"
    )
    for column in ("log-prob path", "step ms (median)", "peak GiB over weights + AdamW"):
        table.add_column(column, justify="right")
    for r in results:
        peak = f"{r['peak_extra_gib']:.1f}" if "peak_extra_gib" in r else "-"
        table.add_row(r["path"], r.get("error") or f"{r['step_ms']:.1f}", peak)
    console = Console()
    console.print(table)
    default = "chunked + shared prompts" if sharing_pays(batch, args.device) else "chunked"
    console.print(f"sharing skips {100 * skipped_fraction(batch):.0f}% of the positions; the trainer takes: {default}")
    if args.output:
        args.output.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results}))


if __name__ == "__main__":
    main()
