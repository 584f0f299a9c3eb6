"""A managed server that starts where a dead service's server still runs stops that one first,
and only that one; a port held by anything else fails the start, naming the port; and the
server's temporary log folder goes with a clean stop. Real processes stand in for vLLM."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from rollout_common.ports import free_port
from rollout_service.config import ManagedServerSettings
from rollout_service.engine import vllm_guard
from rollout_service.engine.managed import ManagedServerError, ManagedVLLMServer, pid_file
from tests.support import started, wait_until

# A vLLM API server, as far as its port goes: listens on argv[1] until killed.
LISTENER = """
import socket, sys
sock = socket.socket()
sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
sock.bind(("127.0.0.1", int(sys.argv[1])))
sock.listen()
while True:
    sock.accept()[0].close()
"""


class SleepServer(ManagedVLLMServer):
    """A managed server whose 'vLLM' is ``sleep``; healthy as soon as it runs."""

    def command(self) -> list[str]:
        return ["sleep", "600"]

    def _wait_healthy(self) -> None:
        pass


@pytest.fixture(autouse=True)
def runtime_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))  # this test's pid files only
    return tmp_path


def settings(tmp_path: Path, port: int, **overrides) -> ManagedServerSettings:  # type: ignore[no-untyped-def]
    return ManagedServerSettings(model=tmp_path, cpu_placement="off", port=port, **overrides)


def record_as_left_by_a_dead_service(port: int, pgid: int) -> None:
    """The pid file a service that has died wrote for its server's group ``pgid``."""
    dead = subprocess.Popen(["true"])
    dead.wait(timeout=10)
    record = {"pgid": pgid, "started": vllm_guard.start_time(pgid), "service": dead.pid, "service_started": 1}
    pid_file(port).parent.mkdir(parents=True, exist_ok=True)
    pid_file(port).write_text(json.dumps(record))


def port_taken(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.timeout(60)
async def test_an_orphaned_server_holding_the_port_is_stopped_before_the_start_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    port = free_port()
    # The orphan's guard watches this process, which lives: only the pid file says its service died.
    orphan_command = vllm_guard.launcher(os.getpid(), None, 0, [sys.executable, "-c", LISTENER, str(port)])
    with started(orphan_command) as orphan:
        await wait_until(lambda: port_taken(port), 10, "the orphan to listen")
        record_as_left_by_a_dead_service(port, orphan.pid)
        server = SleepServer(settings(tmp_path, port, log_file=tmp_path / "server.log"))
        with caplog.at_level(logging.WARNING), server:
            assert not vllm_guard.group_members(orphan.pid)  # gone before the start went on
            assert orphan.poll() == 128 + signal.SIGTERM  # its listener took the SIGTERM
            assert f"process group {orphan.pid}, left on port {port}" in caplog.text
            assert json.loads(pid_file(port).read_text())["pgid"] == server.pid  # the new server's group
        assert not pid_file(port).exists()  # a clean stop leaves no record


@pytest.mark.timeout(60)
def test_a_stale_pid_file_naming_an_unrelated_process_kills_nothing(tmp_path: Path) -> None:
    port = free_port()
    with started(["sleep", "600"]) as unrelated:
        record_as_left_by_a_dead_service(port, unrelated.pid)
        with SleepServer(settings(tmp_path, port, log_file=tmp_path / "server.log")):
            assert unrelated.poll() is None and vllm_guard.group_members(unrelated.pid) == [unrelated.pid]


@pytest.mark.timeout(60)
async def test_the_server_of_a_live_service_is_left_alone_and_its_port_fails_the_start(tmp_path: Path) -> None:
    """Two services told the same port: the second fails, naming it, and stops nothing."""
    port = free_port()
    with SleepServer(settings(tmp_path, port, log_file=tmp_path / "first.log")) as first:
        # The first server's 'vLLM' takes no port; a listener of its own stands in for it.
        with started([sys.executable, "-c", LISTENER, str(port)]):
            await wait_until(lambda: port_taken(port), 10, "the port to be taken")
            second = SleepServer(settings(tmp_path, port, log_file=tmp_path / "second.log"))
            with pytest.raises(ManagedServerError, match=f"port {port} of the managed vLLM server is taken"):
                second.start()
            assert second.pid is None
        assert first.pid is not None and len(vllm_guard.group_members(first.pid)) == 2  # guard and 'vLLM'


@pytest.mark.timeout(60)
def test_the_temporary_log_folder_goes_with_a_clean_stop_and_stays_after_a_failed_start(tmp_path: Path) -> None:
    server = SleepServer(settings(tmp_path, free_port()))
    with server:
        folder = server.log_path.parent
        assert folder.is_dir()  # while it runs
    assert not folder.exists()

    class FailingServer(ManagedVLLMServer):
        def command(self) -> list[str]:
            return [sys.executable, "-c", "raise SystemExit('no model here')"]

    failing = FailingServer(settings(tmp_path, free_port(), startup_timeout_s=30))
    with pytest.raises(ManagedServerError, match="exited with code 1"):
        failing.start()
    failing.stop()  # as the service's exit stack does after a failed start
    assert "no model here" in failing.log_path.read_text()  # the log the error names is still there
    shutil.rmtree(failing.log_path.parent)


@pytest.mark.timeout(60)
def test_a_configured_log_file_stays(tmp_path: Path) -> None:
    with SleepServer(settings(tmp_path, free_port(), log_file=tmp_path / "server.log")) as server:
        assert server.log_path == tmp_path / "server.log"
    assert (tmp_path / "server.log").exists()
