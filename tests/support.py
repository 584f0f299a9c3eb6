"""Helpers shared by the test suites."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

POLL_INTERVAL_S = 0.05


async def wait_until(
    condition: Callable[[], Awaitable[bool] | bool], timeout_s: float, what: str | Callable[[], str]
) -> None:
    """Wait for a condition that has no event to wait on (a counter behind an RPC), polling
    it with a deadline; fails with ``what`` in the message when the deadline passes (a
    callable ``what`` is asked then, so the message can say the state the wait ended in)."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = condition()
        if isinstance(result, Awaitable):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            said = what if isinstance(what, str) else what()
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {said}")
        await asyncio.sleep(POLL_INTERVAL_S)  # poll interval, not synchronisation


@functools.cache
def listening_port(who: str = "trainer") -> int:
    """A local port where something accepts connections and hangs up, as a trainer's
    rendezvous answers the service's check before a join; one per ``who``, for the session."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            connection, _ = server.accept()
            connection.close()

    threading.Thread(target=serve, name=f"listening for {who}", daemon=True).start()
    return server.getsockname()[1]


async def run_to_end(command: list[str], timeout_s: float, **options) -> tuple[int, str]:  # type: ignore[no-untyped-def]
    """Run ``command`` (with its children, e.g. a torchrun and its ranks: one process group) to
    its end, or kill the group at the timeout; its exit code and output (stdout and stderr)."""
    process = await asyncio.create_subprocess_exec(
        *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, start_new_session=True, **options
    )
    try:
        output, _ = await asyncio.wait_for(process.communicate(), timeout_s)
    finally:
        if process.returncode is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode is not None
    return process.returncode, output.decode()


@contextlib.contextmanager
def started(command: list[str], **options) -> Iterator[subprocess.Popen[bytes]]:  # type: ignore[no-untyped-def]
    """``command`` in a process group of its own, killed at the end whatever happened."""
    process = subprocess.Popen(command, start_new_session=True, **options)
    try:
        yield process
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)


def save_into_hub_cache(model_dir: Path, repo_id: str, hf_home: Path) -> None:
    """Put a local model into a Hugging Face cache under ``repo_id``, as a download would have
    (``hub/models--ORG--NAME/snapshots/<commit>`` and ``refs/main``), so that with
    ``HF_HOME=hf_home`` and ``HF_HUB_OFFLINE=1`` the id resolves with no network."""
    repo = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    commit = "0" * 40
    shutil.copytree(model_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)


def with_bad_utf8(request: Any, text: str) -> bytes:
    """``request`` serialized, the bytes of ``text`` (a string field's value) made invalid UTF-8."""
    data = request.SerializeToString()
    assert data.count(text.encode()) == 1
    return data.replace(text.encode(), b"\xff\xfe" + text.encode()[2:])


ROOT = Path(__file__).resolve().parents[1]
NOT_SOURCE = shutil.ignore_patterns(
    ".git", ".venv", "node_modules", "models", "outputs", "runs", "build", "dist", "*.egg-info", "__pycache__",
    ".pytest_cache", ".ruff_cache", "rollout_pb2*",
)  # fmt: skip


def run_checked(command: list[str], timeout_s: float, **kwargs: object) -> str:
    """``command``'s stdout; fails with its output unless it exits 0."""
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, **kwargs)  # type: ignore[call-overload]
    assert result.returncode == 0, f"{command}:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    return result.stdout


@functools.cache
def built_wheel() -> Path:
    """The project's wheel, ``python -m build --wheel`` from a copy of the sources (the checkout
    stays clean), once per test session."""
    source = Path(tempfile.mkdtemp(prefix="wheel-")) / "rollout-service"
    shutil.copytree(ROOT, source, ignore=NOT_SOURCE)
    run_checked([sys.executable, "-m", "build", "--wheel", "--outdir", str(source / "dist"), str(source)], 300)
    (wheel,) = (source / "dist").glob("rollout_service-*.whl")
    return wheel


def miss_one_change(push: Any) -> str:
    """Plant a missed delta in an ``EncodedPush``: its first sparse tensor with a change loses that
    change, its checksum staying the trainer's. Returns the tensor's name."""
    from rollout_api import rollout_pb2 as pb

    sparse = [i for i, meta in enumerate(push.meta) if meta.encoding == pb.TENSOR_ENCODING_SPARSE]
    at = next(i for i in sparse if push.meta[i].changed > 0)
    push.meta[at].changed -= 1
    for position in (sparse.index(at), len(sparse) + at):  # its indices, then its values (``wire_specs``)
        name, tensor = push.wire[position]
        push.wire[position] = (name, tensor[1:].clone())
    return str(push.meta[at].name)
