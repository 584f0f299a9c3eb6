"""The CPU thread budget: vLLM's binding and the trainer's threads derive from the core count."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from rollout_common.cpu_budget import VLLM_BIND_ENV, CpuBudget, available_cores, is_local_target, trainer_threads
from rollout_service.config import ManagedServerSettings
from rollout_service.engine.managed import PINNED_NICENESS, ManagedVLLMServer


@pytest.mark.parametrize(
    ("cores", "vllm", "trainer"),
    [
        ((0,), (0,), (0,)),  # one core: shared, one thread each
        ((0, 1), (0,), (1,)),  # the measured fast split on 2 cores
        ((0, 1, 2), (0,), (1, 2)),
        ((0, 1, 2, 3), (0, 1), (2, 3)),
        ((4, 5, 6, 7, 8, 9, 10, 11), (4, 5, 6, 7), (8, 9, 10, 11)),  # a taskset / cgroup slice
    ],
)
def test_split_gives_half_the_cores_to_vllm_and_the_rest_to_the_trainer(cores, vllm, trainer) -> None:
    budget = CpuBudget.split(cores)
    assert budget.vllm_cores == vllm
    assert budget.trainer_cores == trainer
    assert budget.trainer_threads == len(trainer)
    if len(cores) > 1:  # never oversubscribed when there is anything to split
        assert len(budget.vllm_cores) + budget.trainer_threads == len(cores)
        assert not set(budget.vllm_cores) & set(budget.trainer_cores)


def test_vllm_share_can_be_set_but_leaves_the_trainer_a_core() -> None:
    assert CpuBudget.split((0, 1, 2, 3), vllm_cores=3).vllm_cores == (0, 1, 2)
    assert CpuBudget.split((0, 1, 2, 3), vllm_cores=8).trainer_cores == (3,)
    with pytest.raises(ValueError, match="at least 1"):
        CpuBudget.split((0, 1), vllm_cores=0)


def test_managed_cpu_server_is_bound_to_its_share(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(VLLM_BIND_ENV, raising=False)
    server = ManagedVLLMServer(ManagedServerSettings(port=1))
    assert server.environment()[VLLM_BIND_ENV] == CpuBudget.split().vllm_bind()
    unpinned = ManagedVLLMServer(ManagedServerSettings(port=1, cpu_placement="off"))
    assert unpinned.environment()[VLLM_BIND_ENV] == CpuBudget.split().vllm_bind()  # the threads split all the same


def test_a_binding_in_the_environment_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(VLLM_BIND_ENV, "nobind")
    assert ManagedVLLMServer(ManagedServerSettings(port=1)).environment()[VLLM_BIND_ENV] == "nobind"


def test_gpu_server_gets_no_cpu_binding(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(VLLM_BIND_ENV, raising=False)
    assert VLLM_BIND_ENV not in ManagedVLLMServer(ManagedServerSettings(port=1, device="gpu")).environment()


@pytest.mark.parametrize(
    ("target", "local"),
    [("127.0.0.1:50051", True), ("localhost:50051", True), ("[::1]:50051", True), ("10.0.0.7:50051", False)],
)
def test_local_targets_are_recognised(target: str, local: bool) -> None:
    assert is_local_target(target) is local


def test_trainer_threads_follow_the_budget_only_next_to_its_service() -> None:
    assert trainer_threads("127.0.0.1:50051") == CpuBudget.split().trainer_threads
    assert trainer_threads("rollout.example.com:50051") == len(available_cores())
    assert trainer_threads("127.0.0.1:50051", requested=3) == 3
    with pytest.raises(ValueError, match="positive"):
        trainer_threads("127.0.0.1:50051", requested=-1)


def test_managed_cpu_server_pins_every_process_to_its_share(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(VLLM_BIND_ENV, raising=False)
    assert ManagedVLLMServer(ManagedServerSettings(port=1)).pinned_cores() == CpuBudget.split().vllm_cores
    assert ManagedVLLMServer(ManagedServerSettings(port=1, cpu_placement="off")).pinned_cores() is None
    assert ManagedVLLMServer(ManagedServerSettings(port=1, device="gpu")).pinned_cores() is None
    monkeypatch.setenv(VLLM_BIND_ENV, "0-3")  # the user's own binding: do not second-guess it
    assert ManagedVLLMServer(ManagedServerSettings(port=1)).pinned_cores() is None


PIN_AND_REPORT = (
    "import json, os, sys; from rollout_common.cpu_budget import pin_local_trainer; "
    "cores = pin_local_trainer(sys.argv[1]); "
    "print(json.dumps([cores and list(cores), sorted(os.sched_getaffinity(0))]))"
)


@pytest.mark.parametrize("target", ["127.0.0.1:50051", "rollout.example.com:50051"])
def test_a_trainer_pins_itself_to_its_share_only_next_to_its_service(target: str) -> None:
    # In a child process: affinity set here would stay with the test process.
    out = subprocess.run(
        [sys.executable, "-c", PIN_AND_REPORT, target], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    pinned, affinity = json.loads(out)
    if is_local_target(target):
        assert pinned == affinity == list(CpuBudget.split().trainer_cores)
    else:
        assert pinned is None
        assert affinity == list(available_cores())


# A stand-in for vLLM's API server: it starts a child (as vLLM starts its engine core), answers
# /health, and reports both processes' cores when asked. Real processes: the OS sets the affinity.
STAND_IN_SERVER = r"""
import http.server, json, os, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
started_on = sorted(os.sched_getaffinity(0))
def autogroup_nice():
    try:
        return int(open("/proc/self/autogroup").read().split()[-1])
    except OSError:
        return None
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        cores = {"started_on": started_on, "server": sorted(os.sched_getaffinity(0)),
                 "child": sorted(os.sched_getaffinity(child.pid)),
                 "nice": os.getpriority(os.PRIO_PROCESS, 0), "child_nice": os.getpriority(os.PRIO_PROCESS, child.pid),
                 "autogroup_nice": autogroup_nice()}
        body = json.dumps(cores).encode()
        self.send_response(200); self.end_headers(); self.wfile.write(body)
    def log_message(self, *args): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""


class StandInServer(ManagedVLLMServer):
    def command(self) -> list[str]:
        return [sys.executable, "-c", STAND_IN_SERVER, str(self.port)]


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this OS")
def test_the_managed_server_starts_on_the_vllm_cores_and_its_api_process_is_then_freed_to_all(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(VLLM_BIND_ENV, raising=False)
    settings = ManagedServerSettings(startup_timeout_s=30, log_file=tmp_path / "server.log")
    with StandInServer(settings) as server, urllib.request.urlopen(server.url + "/health", timeout=10) as resp:
        cores = json.loads(resp.read())
    budget = CpuBudget.split()
    nice = min(19, os.getpriority(os.PRIO_PROCESS, 0) + PINNED_NICENESS)  # relative to the launcher's
    assert cores == {
        "started_on": list(budget.vllm_cores),  # so its children (engine core, worker) inherit them
        "child": list(budget.vllm_cores),
        "server": list(budget.front_end_cores),
        "nice": nice,  # a trainer's thread on a shared core runs first
        "child_nice": nice,
        "autogroup_nice": PINNED_NICENESS if Path("/proc/self/autogroup").exists() else None,
    }
    assert sorted(os.sched_getaffinity(0)) == list(available_cores())  # the launching process keeps all its cores
    assert os.getpriority(os.PRIO_PROCESS, 0) < nice  # and its priority


def test_the_front_end_may_use_every_core_of_the_budget_once() -> None:
    assert CpuBudget.split((0, 1)).front_end_cores == (0, 1)
    assert CpuBudget.split((0, 1, 2, 3), vllm_cores=1).front_end_cores == (0, 1, 2, 3)
    assert CpuBudget.split((5,)).front_end_cores == (5,)  # one core: everything shares it, listed once
    assert ManagedVLLMServer(ManagedServerSettings(port=1, cpu_placement="off")).front_end_cores() is None


def test_only_a_pinned_server_is_niced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(VLLM_BIND_ENV, raising=False)
    if hasattr(os, "sched_setaffinity"):
        assert ManagedVLLMServer(ManagedServerSettings(port=1)).niceness() == PINNED_NICENESS
    assert ManagedVLLMServer(ManagedServerSettings(port=1, cpu_placement="off")).niceness() == 0
    assert ManagedVLLMServer(ManagedServerSettings(port=1, device="gpu")).niceness() == 0
    monkeypatch.setenv(VLLM_BIND_ENV, "0")  # the user placed vLLM: priority is theirs too
    assert ManagedVLLMServer(ManagedServerSettings(port=1)).niceness() == 0


def test_the_service_takes_the_trainers_cores_off_vllms(monkeypatch: pytest.MonkeyPatch) -> None:
    assert CpuBudget.split((0, 1)).service_cores == (1,)
    assert CpuBudget.split((0, 1, 2, 3)).service_cores == (2, 3)
    assert CpuBudget.split((5,)).service_cores is None  # one core: nowhere else to go
    monkeypatch.delenv(VLLM_BIND_ENV, raising=False)
    assert ManagedVLLMServer(ManagedServerSettings(port=1)).service_cores() == CpuBudget.split().service_cores
    assert ManagedVLLMServer(ManagedServerSettings(port=1, cpu_placement="off")).service_cores() is None
    assert ManagedVLLMServer(ManagedServerSettings(port=1, device="gpu")).service_cores() is None


MOVE_AND_RETURN = """
import asyncio, contextlib, json, os, threading
from rollout_service.app import _keep_off_vllm_cores

class Managed:
    def service_cores(self):
        return (max(os.sched_getaffinity(0)),)
    def pinned_cores(self):
        return (min(os.sched_getaffinity(0)),)

def affinities():
    return sorted(sorted(os.sched_getaffinity(int(tid))) for tid in os.listdir("/proc/self/task"))

async def main():
    started, stop = threading.Event(), threading.Event()
    thread = threading.Thread(target=lambda: (started.set(), stop.wait(30)))
    thread.start()
    started.wait(10)
    home = sorted(os.sched_getaffinity(0))
    async with contextlib.AsyncExitStack() as stack:
        _keep_off_vllm_cores(Managed(), stack)
        during = affinities()
    after = affinities()
    stop.set()
    thread.join(10)
    print(json.dumps({"home": home, "during": during, "after": after}))

asyncio.run(main())
"""


@pytest.mark.skipif(len(available_cores()) < 2 or not Path("/proc/self/task").exists(), reason="needs 2 cores")
def test_the_service_process_moves_off_vllms_cores_while_it_runs_and_back_after() -> None:
    """Every thread of the process moves (a thread started before the move too), and the
    service's exit puts them back. In a child process, so pytest keeps its cores."""
    result = subprocess.run([sys.executable, "-c", MOVE_AND_RETURN], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    home = seen["home"]
    assert len(seen["during"]) >= 2  # the main thread and the one started before the move
    assert seen["during"] == [[max(home)]] * len(seen["during"])
    assert seen["after"] == [home] * len(seen["after"])
