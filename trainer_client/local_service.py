"""A rollout service on this machine for the run, for a trainer given no service address:
``rollout-service serve`` in its own process, which must be installed here with vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from rollout_api.client import HealthCheckFailed, health_status
from rollout_common.ports import free_port

logger = logging.getLogger(__name__)
STARTUP_TIMEOUT_S = 600.0
"""vLLM's start-up, with room to load a real model."""


class LocalServiceError(RuntimeError):
    """The local service cannot start; the message says why and what to do instead."""


def service_command(port: int, model: str | None, reward_funcs: Sequence[str], config: Path | None) -> list[str]:
    """``rollout-service serve`` on ``port`` with this trainer's model and ``module:function`` rewards."""
    command = [sys.executable, "-m", "rollout_service.edge.cli", "serve", "--port", str(port), "--metrics-port", "0"]
    if model is not None:
        command += ["--model", model]
    for name in reward_funcs:
        if ":" in name:
            command += ["--reward-module", name]
    if config is not None:
        command += ["--config", str(config)]
    return command


@contextlib.contextmanager
def local_service(
    log: Path,
    model: str | None = None,
    reward_funcs: Sequence[str] = (),
    config: Path | None = None,
) -> Iterator[str]:
    """Start the service, wait until it serves, yield its address; stop it (and its vLLM) after."""
    missing = [name for name in ("rollout_service", "vllm") if importlib.util.find_spec(name) is None]
    if missing:
        raise LocalServiceError(
            f"no service address was given and this machine cannot start a rollout service ({', '.join(missing)} "
            "not installed): pip install 'rollout-service[cpu]' (or [gpu]), or give --target HOST:PORT"
        )
    port = free_port()
    target = f"127.0.0.1:{port}"
    log.parent.mkdir(parents=True, exist_ok=True)
    logger.info("starting a local rollout service on %s (log: %s)", target, log)
    with open(log, "wb") as out:
        command = service_command(port, model, reward_funcs, config)
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until_serving(target, process, log)
        yield target
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)  # the service stops its managed vLLM itself
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)


def wait_until_serving(target: str, process: subprocess.Popen[bytes], log: Path) -> None:
    """Poll the service's gRPC health check until SERVING; fail at once if the process exits."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise LocalServiceError(f"the local rollout service exited with code {process.returncode}; see {log}")
        with contextlib.suppress(HealthCheckFailed):
            if asyncio.run(health_status(target, timeout_s=2)) == "SERVING":
                return
        time.sleep(1)  # polling another process's health endpoint
    raise LocalServiceError(f"the local rollout service was not serving within {STARTUP_TIMEOUT_S:.0f}s; see {log}")
