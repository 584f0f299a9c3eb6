"""Adapter publishing: validation, all-or-nothing loads, retiring old versions.

These use a scripted stand-in for the servers' control endpoints; the real load through
vLLM's /v1/load_lora_adapter is exercised in tests/integration/test_lora_runs.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rollout_service.errors import FailedPrecondition, InvalidArgument
from rollout_service.weights.adapters import AdapterPublisher, validate_adapter_files
from tests.unit.rollout_service.weights.scripted_control import ADAPTER, ScriptedServer


def written(path: str) -> bool:
    return Path(path, "adapter_config.json").exists()


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({"adapter_model.safetensors": b"x"}, "needs \\['adapter_config.json', 'adapter_model.safetensors'\\]"),
        ({"adapter_config.json": b"{}"}, "needs \\['adapter_config.json'"),
        ({**ADAPTER, "../evil": b"x"}, "adapter file '../evil' is not accepted"),
        # Pickled weights would be unpickled by vLLM: refused whatever else is sent
        ({"adapter_config.json": b'{"r": 8}', "adapter_model.bin": b"x"}, "pickled .bin weights are refused"),
        ({**ADAPTER, "tokenizer.json": b"{}"}, "adapter file 'tokenizer.json' is not accepted"),
        ({**ADAPTER, "adapter_config.json": b"not json"}, "is not JSON"),
        ({**ADAPTER, "adapter_config.json": b'{"r": 0}'}, "no LoRA rank"),
        ({**ADAPTER, "adapter_config.json": b'{"r": 64}'}, "exceeds the servers' --max-lora-rank 16"),
    ],
)
def test_bad_adapters_are_refused_with_what_to_send(files: dict[str, bytes], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        validate_adapter_files(files, max_rank=16)


async def test_each_push_loads_a_new_version_and_retires_the_one_before_the_previous(tmp_path: Path) -> None:
    servers = [ScriptedServer("a"), ScriptedServer("b")]
    publisher = AdapterPublisher(tmp_path, servers, timeout_s=5)  # type: ignore[arg-type]
    assert publisher.current("run") is None  # the base model until the first push
    assert await publisher.publish("run", ADAPTER) == 1
    assert await publisher.publish("run", ADAPTER) == 2
    assert publisher.current("run") == "run@v2"
    assert await publisher.publish("run", ADAPTER) == 3
    for server in servers:
        assert all(written(path) for path in server.loaded.values())
        assert set(server.loaded) == {"run@v2", "run@v3"}  # requests still on v2 may finish
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["v2", "v3"]
    await publisher.forget("run")
    assert all(not s.loaded for s in servers) and not (tmp_path / "run").exists()


async def test_a_load_refused_by_one_server_is_undone_everywhere(tmp_path: Path) -> None:
    servers = [ScriptedServer("a"), ScriptedServer("b", refuse={"run@v2"})]
    publisher = AdapterPublisher(tmp_path, servers, timeout_s=5)  # type: ignore[arg-type]
    await publisher.publish("run", ADAPTER)
    with pytest.raises(FailedPrecondition, match="keeps its previous one"):
        await publisher.publish("run", ADAPTER)
    assert publisher.current("run") == "run@v1"
    assert all(set(s.loaded) == {"run@v1"} for s in servers)
    assert not (tmp_path / "run" / "v2").exists()
    servers[1].refuse.clear()
    assert await publisher.publish("run", ADAPTER) == 2  # the version number is not burnt


async def test_a_restarted_server_gets_each_runs_current_adapter_again(tmp_path: Path) -> None:
    servers = [ScriptedServer("http://a"), ScriptedServer("http://b")]
    publisher = AdapterPublisher(tmp_path, servers, timeout_s=5)  # type: ignore[arg-type]
    await publisher.publish("run", ADAPTER)
    await publisher.publish("run", ADAPTER)
    await publisher.publish("other", ADAPTER)
    servers[1].loaded.clear()  # its process restarted: it holds none
    await publisher.reload("http://b/")
    assert set(servers[1].loaded) == {"run@v2", "other@v1"}  # the current ones; v1 only served requests in flight
    assert all(written(path) for path in servers[1].loaded.values())
    assert set(servers[0].loaded) == {"run@v1", "run@v2", "other@v1"}  # the other server is left alone


async def test_a_restarted_service_serves_each_runs_newest_adapter_on_disk_again(tmp_path: Path) -> None:
    before = AdapterPublisher(tmp_path, [ScriptedServer("http://a")], timeout_s=5)  # type: ignore[arg-type]
    for _ in range(3):
        await before.publish("run", ADAPTER)
    server = ScriptedServer("http://a", refuse={"run@v3"})  # kept it loaded: vLLM refuses the name
    fresh = ScriptedServer("http://b")  # restarted too: holds nothing
    after = AdapterPublisher(tmp_path, [server, fresh], timeout_s=5)  # type: ignore[arg-type]
    assert await after.restore("run") == 3 and after.current("run") == "run@v3"
    assert set(fresh.loaded) == {"run@v3"} and written(fresh.loaded["run@v3"])
    assert await after.restore("never-pushed") == 0 and after.current("never-pushed") is None
    assert await after.publish("run", ADAPTER) == 4  # versions go on
