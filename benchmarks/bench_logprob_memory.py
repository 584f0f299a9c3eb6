"""Peak memory of chunked vs naive completion log-probs (forward + backward).

Why: ``trainer_client.loss.logprobs.chunked_completion_logprobs`` exists so that the trainer never holds the
[tokens, vocab] logits of a long completion batch. This measures what that buys: the peak memory of computing
per-token log-probs and backpropagating into the hidden states and the lm_head weight, once with the naive
full-logits reference and once chunked (target: chunked / naive <= 0.25 at the default sizes).

Each variant runs in a fresh subprocess so the two peaks cannot contaminate each other:

- CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``; defaults vocab 150k, 8k tokens,
  hidden 1024, chunk 1024 (naive logits alone are 4.9 GB in float32).
- CPU: peak RSS from ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` (a high-water mark, hence the subprocess),
  with glibc's ``MALLOC_MMAP_THRESHOLD_`` pinned so that freed buffers leave RSS; smaller defaults (vocab 32k,
  4k tokens, hidden 256, chunk 512: the same 8 chunks as on CUDA) that run in well under a minute and 3 GB.

"extra" is the peak minus the memory held once the inputs exist and both variants have run once on tiny inputs
(interpreter, torch, lazily imported modules, hidden states, weight), i.e. what the log-prob computation itself
costs, including the weight's gradient; "peak" is the absolute value.

Usage::

    python benchmarks/bench_logprob_memory.py --device cpu
    python benchmarks/bench_logprob_memory.py --device cuda --vocab 151936 --tokens 16384 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from trainer_client.loss.logprobs import chunked_completion_logprobs, naive_completion_logprobs

VARIANTS = ("naive", "chunked")
DEFAULTS = {
    "cuda": {"vocab": 150_000, "tokens": 8192, "hidden": 1024, "chunk_size": 1024},
    "cpu": {"vocab": 32_000, "tokens": 4096, "hidden": 256, "chunk_size": 512},
}
TARGET_RATIO = 0.25
# glibc raises its mmap threshold (up to 32 MiB) after large frees, after which freed chunk-sized buffers stay in
# the heap and RSS overstates live memory by an amount that depends on allocation order. A fixed threshold keeps
# every allocation >= 1 MiB in its own mapping, returned on free, so peak RSS tracks peak live tensor memory.
MALLOC_MMAP_THRESHOLD = 1 << 20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--vocab", type=int, help="vocabulary size V (default: per device)")
    parser.add_argument("--tokens", type=int, help="completion tokens in the batch, B * T (default: per device)")
    parser.add_argument("--hidden", type=int, help="hidden size H (default: per device)")
    parser.add_argument("--chunk-size", type=int, help="positions per chunk (default: per device)")
    parser.add_argument("--batch", type=int, default=1, help="B; tokens are split into B rows of tokens / B")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=2, help="CPU threads per worker")
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    for name, value in DEFAULTS[args.device].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.tokens % args.batch:
        parser.error("--tokens must be divisible by --batch")
    return args


def rss_high_water_bytes() -> int:
    """Peak resident set size of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def warm_up(device: torch.device, dtype: torch.dtype) -> None:
    """Run both variants once on tiny inputs so one-time costs land in the baseline, not in one variant's peak.

    The first ``torch.utils.checkpoint`` call imports ~900 modules (sympy, parts of dynamo): ~180 MB of RSS that a
    long-running trainer pays once, not per step. Thread pools and allocator arenas are likewise initialised here.
    """
    hidden = torch.randn(2, 16, 8, device=device, dtype=dtype, requires_grad=True)
    weight = torch.randn(32, 8, device=device, dtype=dtype, requires_grad=True)
    token_ids = torch.randint(0, 32, (2, 16), device=device)
    naive_completion_logprobs(hidden, weight, token_ids).sum().backward()
    chunked_completion_logprobs(hidden, weight, token_ids, chunk_size=8).sum().backward()


def run_worker(args: argparse.Namespace) -> dict[str, float | int | str]:
    """Build inputs, run one variant forward + backward, report its memory high-water mark and checksums."""
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(args.threads)
    warm_up(device, dtype)
    gen = torch.Generator(device="cpu").manual_seed(0)
    length = args.tokens // args.batch
    # In-place scaling: no temporary copy of the weight inflates the baseline high-water mark.
    hidden = torch.randn(args.batch, length, args.hidden, generator=gen).to(device, dtype).requires_grad_(True)
    weight = torch.randn(args.vocab, args.hidden, generator=gen).mul_(args.hidden**-0.5)
    weight = weight.to(device, dtype).requires_grad_(True)
    token_ids = torch.randint(0, args.vocab, (args.batch, length), generator=gen).to(device)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        baseline = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        baseline = rss_high_water_bytes()

    start = time.perf_counter()
    if args.worker == "naive":
        logps = naive_completion_logprobs(hidden, weight, token_ids, temperature=args.temperature)
    else:
        logps = chunked_completion_logprobs(
            hidden, weight, token_ids, chunk_size=args.chunk_size, temperature=args.temperature
        )
    logps.mean().backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = rss_high_water_bytes()
    seconds = time.perf_counter() - start
    return {
        "variant": args.worker,
        "baseline": baseline,
        "peak": peak,
        "extra": peak - baseline,
        "seconds": seconds,
        "logps_sum": float(logps.detach().double().sum()),
        "hidden_grad_norm": float(hidden.grad.double().norm()),
        "weight_grad_norm": float(weight.grad.double().norm()),
    }


def spawn(args: argparse.Namespace, variant: str) -> dict[str, float | int | str]:
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        variant,
        "--device",
        args.device,
        "--vocab",
        str(args.vocab),
        "--tokens",
        str(args.tokens),
        "--hidden",
        str(args.hidden),
        "--chunk-size",
        str(args.chunk_size),
        "--batch",
        str(args.batch),
        "--dtype",
        args.dtype,
        "--temperature",
        str(args.temperature),
        "--threads",
        str(args.threads),
    ]
    env = dict(os.environ)
    if args.device == "cpu":
        env.setdefault("MALLOC_MMAP_THRESHOLD_", str(MALLOC_MMAP_THRESHOLD))
    completed = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
    if completed.returncode != 0:
        raise SystemExit(f"{variant} worker failed ({completed.returncode}):\n{completed.stderr}")
    return json.loads(completed.stdout.strip().splitlines()[-1])


def gib(value: float) -> str:
    return f"{value / 2**30:.3f}"


def report(args: argparse.Namespace, results: dict[str, dict[str, float | int | str]], console: Console) -> bool:
    meter = "torch.cuda.max_memory_allocated" if args.device == "cuda" else "peak RSS (ru_maxrss), fresh process"
    logits_bytes = args.tokens * args.vocab * 4
    table = Table(
        title=f"Completion log-probs, forward + backward, on {args.device}",
        caption=(
            f"V={args.vocab:,} tokens={args.tokens:,} H={args.hidden} chunk={args.chunk_size} {args.dtype}; "
            f"memory: {meter}; fp32 tokens x V logits = {gib(logits_bytes)} GiB"
        ),
    )
    for column in ("variant", "baseline GiB", "peak GiB", "extra GiB", "seconds"):
        table.add_column(column, justify="left" if column == "variant" else "right")
    for variant in VARIANTS:
        r = results[variant]
        table.add_row(variant, gib(r["baseline"]), gib(r["peak"]), gib(r["extra"]), f"{r['seconds']:.2f}")
    naive, chunked = results["naive"], results["chunked"]
    extra_ratio = chunked["extra"] / max(naive["extra"], 1)
    peak_ratio = chunked["peak"] / max(naive["peak"], 1)
    table.add_row("chunked/naive", "", f"{peak_ratio:.3f}", f"{extra_ratio:.3f}", "")
    console.print(table)
    agree = all(
        abs(chunked[key] - naive[key]) <= 1e-3 * max(abs(naive[key]), 1.0)
        for key in ("logps_sum", "hidden_grad_norm", "weight_grad_norm")
    )
    verdict = "[green]meets[/green]" if extra_ratio <= TARGET_RATIO else "[red]misses[/red]"
    console.print(f"extra-memory ratio chunked/naive = {extra_ratio:.3f}: {verdict} the target <= {TARGET_RATIO}")
    console.print(f"results agree (log-prob sum, grad norms): {'yes' if agree else '[red]NO[/red]'}")
    return agree


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(run_worker(args)))
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("CUDA is not available; use --device cpu")
    console = Console()
    results = {}
    for variant in VARIANTS:
        with console.status(f"running {variant} in a fresh process"):
            results[variant] = spawn(args, variant)
    if not report(args, results, console):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
