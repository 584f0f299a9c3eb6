"""The supervisor restarts a server whose process died, a bounded number of times, and the
managed server reaps its whole process group, also when its leader has died first. Real
processes (``sleep``) stand in for vLLM's."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from pathlib import Path

from rollout_service.config import ManagedServerSettings
from rollout_service.engine.managed import ManagedVLLMServer
from rollout_service.engine.supervisor import ServerSupervisor, wait_for_exit
from tests.support import wait_until


class SleepServer:
    """A 'server' that is one ``sleep`` process; ``restart`` starts a new one."""

    url = "http://sleep"

    def __init__(self) -> None:
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.restart()

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def restart(self) -> None:
        if self.process is not None:
            self.process.wait(timeout=10)  # reap the dead one
        self.process = subprocess.Popen(["sleep", "600"])
        self.starts += 1

    def log_tail(self) -> str:
        return "(sleep has no log)"

    def kill(self) -> None:
        assert self.process is not None
        self.process.kill()


async def test_a_dead_server_is_restarted_until_the_bound_then_left_down() -> None:
    server = SleepServer()
    events: list[str] = []
    restarted = asyncio.Queue[str]()

    async def on_restarted(url: str) -> None:
        events.append("restarted")
        restarted.put_nowait(url)

    supervisor = ServerSupervisor(server, lambda url: events.append("down"), on_restarted, max_restarts=1)
    supervisor.start()
    try:
        server.kill()
        assert await asyncio.wait_for(restarted.get(), 10) == "http://sleep"
        assert events == ["down", "restarted"] and server.starts == 2 and supervisor.restarts == 1
        server.kill()  # a second death is past max_restarts (1): down, and no restart
        assert supervisor._task is not None
        await asyncio.wait_for(supervisor._task, 10)
        assert events == ["down", "restarted", "down"] and server.starts == 2
    finally:
        await supervisor.close()
        if server.process is not None and server.process.poll() is None:
            server.kill()
            server.process.wait(timeout=10)


async def test_wait_for_exit_returns_when_the_process_ends() -> None:
    # A plain Popen child, as the managed server's (asyncio's own would be reaped by its watcher).
    process = subprocess.Popen(["sleep", "600"])  # noqa: ASYNC220
    waiting = asyncio.ensure_future(wait_for_exit(process.pid))
    done, _ = await asyncio.wait({waiting}, timeout=0.2)  # bounded: it must still be waiting
    assert not done
    process.kill()
    await asyncio.wait_for(waiting, 10)
    process.wait(timeout=10)


class ShellServer(ManagedVLLMServer):
    """A managed server whose 'vLLM' is a shell with a child, like the API server's engine
    and worker; healthy as soon as it runs."""

    def command(self) -> list[str]:
        return ["sh", "-c", "sleep 600 & echo $! > child.pid; wait"]

    def _wait_healthy(self) -> None:
        pass


async def test_stop_reaps_the_group_when_its_leader_died_first(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr("tempfile.gettempdir", lambda: str(tmp_path))  # its cwd, where the child's pid goes
    server = ShellServer(ManagedServerSettings(model=tmp_path, cpu_placement="off", log_file=tmp_path / "log"))
    server.start()
    pid_file = tmp_path / "child.pid"
    await wait_until(lambda: pid_file.exists() and pid_file.read_text().strip() != "", 10, "the child's pid")
    child = int(pid_file.read_text())
    assert server.pid is not None
    os.kill(server.pid, signal.SIGKILL)  # the leader dies; its child lives on
    server._process.wait(timeout=10)  # type: ignore[union-attr]
    assert _alive(child)
    server.stop()
    await wait_until(lambda: not _alive(child), 10, "the orphaned child to die")  # SIGKILL lands asynchronously


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")
