"""``rollout-service top``: one screen from GetStats and ListRuns of a real gRPC server."""

from __future__ import annotations

from rich.console import Console
from typer.testing import CliRunner

from rollout_api import rollout_pb2 as pb
from rollout_api.client import RolloutClient, ledger_record
from rollout_api.top import render, snapshot
from rollout_service.config import SecuritySettings
from rollout_service.edge.cli import app
from rollout_service.edge.server import start_grpc_server
from tests.support import wait_until
from tests.unit.grpc_helpers import run_spec
from tests.unit.scripted import ScriptedEngine, make_service


def text_of(renderable: object) -> str:
    console = Console(width=200, record=True)
    console.print(renderable)
    return console.export_text()


async def test_the_screen_shows_each_run_with_its_version_and_where_its_groups_are() -> None:
    service = make_service(ScriptedEngine())
    server, port, _health = await start_grpc_server(service, "127.0.0.1", 0, SecuritySettings())
    target = f"127.0.0.1:{port}"
    try:
        async with RolloutClient(target, timeout_s=5) as client:
            spec = run_spec()
            spec.admission, spec.max_staleness = pb.ADMISSION_MODE_PACED, 2
            run = await client.create_run(spec)
            stream = client.stream(run.run_id, "trainer", credits=1)
            group = await anext(aiter(stream))
            stream.ack([group.group_id])
            await stream.aclose()

            async def acked() -> bool:
                return (await client.stats()).runs[run.run_id].groups_trained == 1

            await wait_until(acked, 5, "the ack to be counted")
            stats = await client.stats()
        lines = text_of(await snapshot(target, timeout_s=5)).splitlines()
    finally:
        await server.stop(None)
        await service.close()
    busy, limit = lines[0].removeprefix("slots ").split()[0].split("/")  # busy moves on: the engine generates
    assert int(limit) == stats.max_inflight and 0 <= int(busy) <= int(limit)
    header = lines[1].split()
    assert header[:3] == ["run", "state", "version"]
    row = next(line.split() for line in lines if line.strip().startswith(run.run_id))
    counters = stats.runs[run.run_id]  # taken a moment before the screen: generation goes on
    assert row[1:3] == ["running", "0"]
    assert int(row[5]) >= counters.groups_started >= 1
    assert int(row[8]) == counters.groups_trained == 1
    assert header[-1] == "lookahead" and row[-1] == "2.00" and counters.lookahead_versions == 2.0  # no push yet
    ledger_header = lines.index(next(line for line in lines if line.split()[:2] == ["run", "goodput"]))
    ledger_row = lines[ledger_header + 1].split()
    assert ledger_row[0] == run.run_id and ledger_row[3] == str(counters.ledger.trained.tokens) != "0"
    assert float(ledger_row[1].rstrip("%")) > 0


def test_no_service_is_one_line_not_a_traceback() -> None:
    result = CliRunner().invoke(app, ["top", "--once", "--target", "127.0.0.1:9", "--timeout", "0.5"])
    assert result.exit_code == 2
    assert "no rollout service answered at 127.0.0.1:9 within 0.5s" in result.output
    assert "Traceback" not in result.output


def test_a_stalled_run_says_which_side_stopped() -> None:
    stats = pb.GetStatsResponse(max_inflight=4)
    stats.runs["run-a"].groups_started = 1
    stats.runs["run-b"].groups_started = 1
    runs = {
        "run-a": pb.Run(run_id="run-a", state=pb.RUN_STATE_RUNNING),
        "run-b": pb.Run(
            run_id="run-b",
            state=pb.RUN_STATE_RUNNING,
            stall=pb.RunStall(kind=pb.STALL_KIND_GENERATION, reason="no vLLM server is answering", seconds=301),
        ),
    }
    lines = text_of(render(stats, runs)).splitlines()
    runs_table = lines[: [line.strip() for line in lines].index("tokens")]  # not the ledger's rows below it
    rows = {line.split()[0]: line for line in runs_table if line.strip().startswith("run-")}
    assert "running" in rows["run-a"] and "stalled" not in rows["run-a"]
    assert "running (stalled: generation)" in rows["run-b"]


def test_a_ledger_flattens_into_a_metrics_record() -> None:
    ledger = pb.GoodputLedger(
        generated=pb.LedgerEntry(tokens=100, engine_seconds=2.0),
        trained=pb.LedgerEntry(tokens=60, engine_seconds=1.25, groups=3),
        goodput=0.6,
        goodput_seconds=0.625,
    )
    record = ledger_record(ledger)
    assert record["goodput"] == 0.6 and record["ledger_tokens/trained"] == 60
    assert record["ledger_engine_seconds/generated"] == 2.0 and record["ledger_tokens/leased"] == 0
    assert not any(key.startswith("control/") for key in record)  # no bound, no controller
    ledger.control.CopyFrom(pb.MismatchControl(max_mismatch_kl=0.05, mismatch_kl=0.07, lookahead_versions=1.0, cuts=2))
    record = ledger_record(ledger)
    assert (record["control/mismatch_kl"], record["control/cuts"], record["control/lookahead_versions"]) == (0.07, 2, 1)
