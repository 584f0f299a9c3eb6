"""How much of a push a delta would save: the share of served-dtype weights that change per
optimizer step, and the bytes of a per-tensor delta against a full push, by learning rate.

Why: a delta push (``weight_sync.delta``) pays only while few served weights change between
pushes. In bf16 a weight moves only when its update crosses half a unit in its last place, so at
a real learning rate most do not (verl and NeMo-RL report 1-3% a step on large models). This
counts that share on the project's models without pushing; ``bench_delta_push.py`` pushes them.

What runs: the model trains with AdamW (transformers' defaults: betas 0.9/0.999, eps 1e-8, no
weight decay), float32 master weights, on a causal-LM loss over random token batches. Adam's
step is lr times a normalised ratio, so the share of weights that move depends on the learning
rate and the weights' magnitudes far more than on the loss. After each step the weights are cast
to the served dtype and compared with the previous step's cast. The delta of a tensor is its
changed elements as int32 indices and served-dtype values, or the tensor whole where that is
smaller. Full: every tensor whole.

Usage::

    python benchmarks/bench_delta_density.py --model-size small --steps 20
    python benchmarks/bench_delta_density.py --model-size medium --learning-rates 1e-6,1e-5,5e-3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_vs_trl's model sizes, run as a script

from rollout_common.tiny_model import TINY_MODEL_TRAINING, TinyModelSpec, build_tiny_model
from vllm_gloo_transfer.delta import index_dtype, sparse_pays

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class Step:
    changed: int
    elements: int
    delta_bytes: int
    full_bytes: int
    tensors_sparse: int
    tensors: int

    @property
    def density(self) -> float:
        return self.changed / self.elements


@dataclass
class Result:
    model: str
    parameters: int
    learning_rate: float
    density_mean: float
    density_max: float
    delta_over_full_mean: float
    delta_over_full_max: float
    sparse_tensor_share: float
    steps: list[Step]


def break_even_density(dtype: torch.dtype) -> float:
    """The share of changed elements above which a tensor is cheaper sent whole (int32 indices)."""
    size = dtype.itemsize
    return size / (index_dtype(1).itemsize + size)


def step_bytes(previous: dict[str, torch.Tensor], served: dict[str, torch.Tensor]) -> Step:
    """What the delta encoder (``trainer_client.weights.delta``) would send, by its own rule."""
    changed = elements = delta = full = sparse = 0
    for name, now in served.items():
        moved = int((now != previous[name]).sum())
        whole = now.numel() * now.element_size()
        changed, elements, full = changed + moved, elements + now.numel(), full + whole
        if sparse_pays(now.numel(), moved, now.dtype):
            delta += moved * (index_dtype(now.numel()).itemsize + now.element_size())
            sparse += 1
        else:
            delta += whole
    return Step(changed, elements, delta, full, sparse, len(served))


def adamw_steps(model: torch.nn.Module, learning_rate: float, args: argparse.Namespace) -> Iterator[None]:
    """Trains ``model`` one AdamW step a ``next``: a causal-LM loss over seeded random tokens
    (``args.batch`` sequences of ``args.tokens``)."""
    torch.manual_seed(args.seed)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.0)
    vocab = model.config.vocab_size  # type: ignore[union-attr]
    while True:
        batch = torch.randint(0, vocab, (args.batch, args.tokens))
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        yield


def measure(model_dir: Path, learning_rate: float, args: argparse.Namespace) -> Result:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    training = adamw_steps(model, learning_rate, args)
    dtype = DTYPES[args.served_dtype]

    def served() -> dict[str, torch.Tensor]:
        return {name: p.detach().to(dtype).clone() for name, p in model.named_parameters()}

    previous, steps = served(), []
    for _ in range(args.steps):
        next(training)
        now = served()
        steps.append(step_bytes(previous, now))
        previous = now
    ratios = [s.delta_bytes / s.full_bytes for s in steps]
    return Result(
        model=model_dir.name,
        parameters=sum(p.numel() for p in model.parameters()),
        learning_rate=learning_rate,
        density_mean=statistics.fmean(s.density for s in steps),
        density_max=max(s.density for s in steps),
        delta_over_full_mean=statistics.fmean(ratios),
        delta_over_full_max=max(ratios),
        sparse_tensor_share=statistics.fmean(s.tensors_sparse / s.tensors for s in steps),
        steps=steps,
    )


def report(results: list[Result], args: argparse.Namespace, console: Console) -> None:
    even = break_even_density(DTYPES[args.served_dtype])
    title = (
        f"Served weights ({args.served_dtype}) changed per AdamW step, {args.steps} steps; a tensor is sent "
        f"as a delta below {even:.0%} changed"
    )
    table = Table(title=title)
    for column in ["model", "parameters", "learning rate", "changed, mean", "changed, max", "delta / full, mean",
                   "delta / full, max", "tensors sent as deltas"]:  # fmt: skip
        table.add_column(column, justify="right")
    for r in results:
        table.add_row(
            r.model, f"{r.parameters / 1e6:.2f}M", f"{r.learning_rate:g}", f"{r.density_mean:.2%}",
            f"{r.density_max:.2%}", f"{r.delta_over_full_mean:.2f}", f"{r.delta_over_full_max:.2f}",
            f"{r.sparse_tensor_share:.0%}",
        )  # fmt: skip
    console.print(table)


def add_training_arguments(parser: argparse.ArgumentParser) -> None:
    """The model and its training, as this benchmark and ``bench_delta_push.py`` take them."""
    from bench_vs_trl import MODEL_SIZES

    parser.add_argument("--model-size", choices=sorted(MODEL_SIZES), default="small", help="built locally if missing")
    parser.add_argument(
        "--learning-rates",
        default=f"1e-6,1e-5,{TINY_MODEL_TRAINING['learning_rate']}",
        help="comma-separated; the default ends with the demo's",
    )
    parser.add_argument("--batch", type=int, default=8, help="sequences a step")
    parser.add_argument("--tokens", type=int, default=64, help="tokens a sequence")
    parser.add_argument("--seed", type=int, default=0)


def read_training_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``args.learning_rates`` as numbers and ``args.model`` as (folder, spec); a bad list exits with a usage error."""
    from bench_vs_trl import MODEL_SIZES

    try:
        args.learning_rates = [float(lr) for lr in args.learning_rates.split(",") if lr.strip()]
    except ValueError:
        parser.error(f"--learning-rates: {args.learning_rates!r} is not a comma-separated list of numbers")
    args.model = MODEL_SIZES[args.model_size]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_training_arguments(parser)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--served-dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--output", type=Path, help="results.json goes here")
    args = parser.parse_args(argv)
    read_training_arguments(parser, args)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    path, spec = args.model
    model_dir = build_tiny_model(Path(path), TinyModelSpec(**spec))
    results = [measure(model_dir, lr, args) for lr in args.learning_rates]
    report(results, args, Console(width=160))
    if args.output:
        args.output.mkdir(parents=True, exist_ok=True)
        payload = {"args": {k: str(v) for k, v in vars(args).items()}, "results": [asdict(r) for r in results]}
        (args.output / "results.json").write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
