"""What a trainer asks of the service, and which model it trains: with ``AsyncGRPOConfig``, the
declaration of every ``rollout-trainer`` option, named as TRL's wherever TRL has the setting.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from rollout_api import rollout_pb2 as pb
from trainer_client.stream.prompt_feeder import fits_inline
from trainer_client.stream.prompts_file import PROMPT_COLUMN, PromptRows

ADMISSION_MODES = {"staleness": pb.ADMISSION_MODE_STALENESS, "paced": pb.ADMISSION_MODE_PACED}
"""``RunOptions.admission`` -> the proto's AdmissionMode."""
SCALE_REWARDS = {
    "group": pb.ADVANTAGE_SCALING_GROUP,
    "batch": pb.ADVANTAGE_SCALING_BATCH,
    "none": pb.ADVANTAGE_SCALING_NONE,
}
"""``AsyncGRPOConfig.scale_rewards`` (TRL's spellings) -> the proto's AdvantageScaling."""


@dataclass
class RunOptions:
    """The service, the run, and what the run generates from when this trainer creates it."""

    target: str | None = field(
        default=None, metadata={"help": "The rollout service, host:port; default: start one here for the run."}
    )
    run_id: str | None = field(default=None, metadata={"help": "Consume this existing run instead of creating one."})
    dataset: str = field(default="letters", metadata={"help": "Built-in dataset of the run, when no --prompts."})
    prompts: str | None = field(
        default=None,
        metadata={
            "aliases": ["--prompts_file", "--prompts-file"],
            "help": "Your prompts in TRL's format: JSONL, Parquet, CSV, a folder of them, or a saved HF dataset "
            "(the prompt column, plus columns passed to rewards as keyword arguments); or reasoning-gym's tasks, "
            "reasoning_gym:NAME[=WEIGHT][,...][?size=N&seed=S] (score them with --reward_funcs reasoning_gym). "
            "Replaces --dataset.",
        },
    )
    prompt_column: str = field(default=PROMPT_COLUMN, metadata={"help": "Column of --prompts holding the prompt."})
    reward_funcs: list[str] = field(
        default_factory=lambda: ["char_fraction"], metadata={"help": "Names of the service's reward functions."}
    )
    reward_weights: list[float] | None = field(
        default=None, metadata={"help": "One weight per reward function (default: 1 each)."}
    )
    admission: Literal["paced", "staleness"] = field(
        default="paced",
        metadata={
            "help": "paced: generate only what trains within max_staleness, no further ahead than keeps this "
            "trainer busy; staleness: as far ahead as max_staleness allows."
        },
    )
    max_mismatch_kl: float = field(
        default=0.0,
        metadata={
            "help": "With paced admission: a bound on the sampler-trainer mismatch (sampling/mismatch_kl); a version "
            "over it cuts the lookahead by one (0: no bound)."
        },
    )
    max_buffered_groups: int = field(
        default=0,
        metadata={"help": "Service-side buffer of the run in groups (0: max_staleness steps' worth, at least one)."},
    )
    max_inflight: int = field(default=0, metadata={"help": "Episodes generating at once (0: the service's slots)."})
    group_deadline_s: float = field(
        default=0.0, metadata={"help": "Seconds a group waits for its slowest members (0: all of them)."}
    )
    min_group_size: int = field(
        default=0, metadata={"help": "With a deadline: score a group from this many finished members (0: drop it)."}
    )
    eval_dataset: str = field(default="letters", metadata={"help": "Built-in dataset --eval_every evaluates."})
    eval_every: int = field(
        default=0, metadata={"help": "Evaluate --eval_dataset at the version just pushed every N pushes (0: never)."}
    )
    trainer_address: str = field(
        default="auto",
        metadata={
            "help": "Address vLLM's workers reach this trainer at, for the weight push; auto: the local address "
            "this host reaches the service from."
        },
    )
    vllm_group_port: int = field(
        default=51216,
        metadata={
            "help": "Port this trainer hosts the weight push's rendezvous on, or the next free one of the 63 above "
            "it (several trainers on one host); 0: any free port. Open it to vLLM's hosts."
        },
    )
    push: bool = field(
        default=True, metadata={"help": "Push weights (--no_push: a follower of a run another trainer pushes for)."}
    )
    shared_memory_push: bool = field(
        default=True, metadata={"help": "Push to vLLM servers on this host through shared memory."}
    )
    wait_for_service: float = field(
        default=600.0, metadata={"help": "Seconds to wait at start for the service to say SERVING (0: do not wait)."}
    )
    torch_threads: int = field(
        default=0, metadata={"help": "Torch threads; 0: the cores a managed vLLM on this host leaves free, else all."}
    )
    save_model: bool = field(
        default=False, metadata={"help": "At the end, save the trained policy and tokenizer to OUTPUT_DIR/model."}
    )
    prompt_rows: PromptRows | list[pb.Prompt] | None = field(default=None, init=False, repr=False)
    """``prompts`` loaded; the Python API may set rows (a ``datasets.Dataset``, dicts) or ``pb.Prompt``s."""

    def __post_init__(self) -> None:
        if self.target is not None and self.target.startswith(("http://", "https://")):
            raise ValueError(f"target is {self.target!r}; give the service's gRPC host:port, without http(s)://")
        if self.wait_for_service < 0:
            raise ValueError(f"wait_for_service is {self.wait_for_service:g}; give seconds >= 0 (0: do not wait)")
        if self.admission not in ADMISSION_MODES:
            raise ValueError(f"admission is {self.admission!r}; choose one of {', '.join(ADMISSION_MODES)}")
        if not (math.isfinite(self.max_mismatch_kl) and self.max_mismatch_kl >= 0):
            raise ValueError(f"max_mismatch_kl is {self.max_mismatch_kl}; give a KL >= 0 (0: no bound)")
        if self.max_mismatch_kl and self.admission != "paced":
            raise ValueError("max_mismatch_kl bounds paced admission's lookahead; use --admission paced")
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_funcs):
            raise ValueError(
                f"reward_weights has {len(self.reward_weights)} entries for {len(self.reward_funcs)} reward_funcs; "
                "give one weight per reward function"
            )
        if self.prompts is not None:
            self.prompt_rows = PromptRows.from_source(self.prompts, self.prompt_column)

    @property
    def rewards(self) -> dict[str, float]:
        weights = self.reward_weights or [1.0] * len(self.reward_funcs)
        return dict(zip(self.reward_funcs, weights, strict=True))

    @property
    def streams_prompts(self) -> bool:
        """Too many prompts for the run's spec: they go through SubmitPrompts instead."""
        rows = self.prompt_rows
        return isinstance(rows, PromptRows) and not fits_inline(rows.count, rows.bytes)


@dataclass
class ModelOptions:
    """The policy this trainer trains (TRL ``ModelConfig``'s names)."""

    model_name_or_path: str | None = field(
        default=None,
        metadata={
            "aliases": ["--model"],
            "help": "A Hub model id or a local folder; default: the model the service's servers serve.",
        },
    )
    model_revision: str = field(default="main", metadata={"help": "Branch, tag or commit of a Hub model."})
    use_peft: bool = field(default=False, metadata={"help": "Train a LoRA adapter instead of the full model."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA scaling numerator."})
    lora_target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"], metadata={"help": "Modules to adapt."}
    )
    lora_serving: Literal["merged", "adapter"] = field(
        default="merged",
        metadata={"help": "merged: push base+adapter weights; adapter: vLLM serves the run's adapter."},
    )

    def __post_init__(self) -> None:
        if self.lora_r <= 0:
            raise ValueError(f"lora_r is {self.lora_r}; give a positive rank")
        if self.lora_serving not in ("merged", "adapter"):
            raise ValueError(f"lora_serving is {self.lora_serving!r}; choose merged or adapter")

    @property
    def serves_adapter(self) -> bool:
        """The run serves this trainer's adapter (pushed as files), not merged weights."""
        return self.use_peft and self.lora_serving == "adapter"
