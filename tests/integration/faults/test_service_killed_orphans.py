"""``rollout-service serve`` with its own vLLM server is SIGKILLed: the server's whole process
group (guard, API server, engine core) goes down with it and frees the server's port,
instead of living on re-parented to PID 1 beside the server a restarted service would start.

A vLLM server of its own (about a minute's start), not the session's: this service owns it."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollout_common.ports import free_port
from tests.integration.conftest import serving
from tests.support import wait_until

pytestmark = pytest.mark.integration

logger = logging.getLogger(__name__)


def managed_env(tiny_model: Path, tmp_path: Path, vllm_port: int) -> dict[str, str]:
    return dict(
        os.environ,
        ROLLOUT_ENGINE__MODEL="tiny",
        ROLLOUT_ENGINE__MANAGED__MODEL=str(tiny_model),
        ROLLOUT_ENGINE__MANAGED__PORT=str(vllm_port),
        ROLLOUT_ENGINE__MANAGED__DTYPE="float32",
        ROLLOUT_ENGINE__MANAGED__MAX_MODEL_LEN="1024",
        ROLLOUT_ENGINE__MANAGED__KV_CACHE_GIB="1",
        ROLLOUT_ENGINE__MANAGED__CPU_PLACEMENT="off",  # the session's server may hold the pinned cores
        ROLLOUT_ENGINE__MANAGED__LOG_FILE=str(tmp_path / "vllm.log"),
        ROLLOUT_ADAPTERS__DIR=str(tmp_path / "adapters"),
        XDG_RUNTIME_DIR=str(tmp_path),  # the server's pid file: this test's
    )


def start_service(tiny_model: Path, tmp_path: Path, grpc_port: int, vllm_port: int) -> subprocess.Popen[bytes]:
    """``rollout-service serve`` with a managed vLLM server, in a session of its own."""
    command = [sys.executable, "-m", "rollout_service.edge.cli", "serve", "--port", str(grpc_port)]
    command += ["--metrics-port", "0"]
    env = managed_env(tiny_model, tmp_path, vllm_port)
    with open(tmp_path / "service.log", "wb") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def processes() -> list[tuple[int, str, int, int]]:
    """(pid, state, parent, process group) of every process, read from /proc."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            stat = Path(f"/proc/{entry}/stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            found.append((int(entry), fields[0], int(fields[1]), int(fields[2])))
    return found


def group_members(pgid: int) -> list[int]:
    return [pid for pid, state, _, group in processes() if group == pgid and state not in ("Z", "X")]


def vllm_group_of(service_pid: int) -> int | None:
    """The process group of the service's vLLM server: that of its child that runs vLLM."""
    for pid, state, parent, group in processes():
        with contextlib.suppress(OSError):
            if parent == service_pid and state != "Z" and b"vllm" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return group
    return None


def port_taken(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(2)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def tails(tmp_path: Path) -> str:
    return "\n".join(
        f"--- {name}:\n{(tmp_path / name).read_text(errors='replace')[-3000:]}"
        for name in ("service.log", "vllm.log")
        if (tmp_path / name).exists()
    )


@pytest.mark.timeout(600)
async def test_a_sigkilled_service_takes_its_managed_vllm_down_with_it(tiny_model: Path, tmp_path: Path) -> None:
    grpc_port, vllm_port = free_port(), free_port()
    service = start_service(tiny_model, tmp_path, grpc_port, vllm_port)
    pgid = None
    try:
        await wait_until(
            lambda: vllm_group_of(service.pid), 60, lambda: f"the service to start vLLM:\n{tails(tmp_path)}"
        )
        pgid = vllm_group_of(service.pid)
        await wait_until(lambda: serving(f"127.0.0.1:{grpc_port}"), 400, lambda: f"the service:\n{tails(tmp_path)}")
        assert len(group_members(pgid)) >= 3  # guard, API server, engine core
        assert port_taken(vllm_port)

        os.kill(service.pid, signal.SIGKILL)  # the service alone, not its vLLM's group
        service.wait(timeout=30)
        killed = time.monotonic()
        left = lambda: f"vLLM's group {pgid} gone; left: {group_members(pgid)}\n{tails(tmp_path)}"  # noqa: E731
        await wait_until(lambda: not group_members(pgid), 30, left)
        logger.info("vLLM's process group was gone %.1fs after the service's SIGKILL", time.monotonic() - killed)
        assert not port_taken(vllm_port)
        assert f"the service (pid {service.pid}) died" in (tmp_path / "vllm.log").read_text()
    finally:
        if service.poll() is None:
            os.killpg(service.pid, signal.SIGKILL)
            service.wait(timeout=30)
        if pgid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
