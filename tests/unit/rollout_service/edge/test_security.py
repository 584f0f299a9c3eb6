"""TLS, bearer tokens and per-run authorization at the gRPC edge: real gRPC over real TLS
on localhost (certificates made in the test); the engine behind it is scripted, and
``tests/integration/test_security.py`` trains through the same checks on vLLM."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from typer.testing import CliRunner, Result

from rollout_api import rollout_pb2 as pb
from rollout_api.client import ClientSecurity, RolloutClient, ServiceNotServing, wait_until_serving
from rollout_service.config import SecuritySettings
from rollout_service.edge.cli import app as cli_app
from rollout_service.edge.dev_credentials import CertificateAuthority
from rollout_service.edge.security import TokenTable, check_bind, load_token_table
from rollout_service.edge.server import set_serving, start_grpc_server
from rollout_service.errors import StartupError
from tests.tls_certs import LOCAL_HOSTS
from tests.unit.grpc_helpers import run_spec, status_of
from tests.unit.scripted import ScriptedEngine, make_service

ALICE, BOB, ADMIN = "alice-token-0123456789", "bob-token-0123456789ab", "admin-token-0123456789"
PRINCIPALS = {
    "alice": {"token": ALICE, "push_base_weights": True},
    "bob": {"token": BOB},
    "ops": {"token": ADMIN, "admin": True},
}


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    directory = tmp_path_factory.mktemp("pki")
    ca, other = CertificateAuthority(directory, "test-ca", days=1), CertificateAuthority(directory, "other-ca", days=1)
    return {
        "ca": ca.pem,
        "server": ca.issue_server("server", LOCAL_HOSTS),
        "client": ca.issue_client("client"),
        "other_ca": other.pem,
    }


@contextlib.asynccontextmanager
async def served(security: SecuritySettings) -> AsyncIterator[tuple[Any, str]]:
    service = make_service(ScriptedEngine())
    server, port, _health = await start_grpc_server(service, "127.0.0.1", 0, security)
    try:
        yield service, f"localhost:{port}"
    finally:
        await server.stop(None)
        await service.close()


def tls_settings(pki: dict[str, Any], mutual: bool = False) -> SecuritySettings:
    return SecuritySettings(
        tls_cert_file=pki["server"].cert,
        tls_key_file=pki["server"].key,
        tls_client_ca_file=pki["ca"].cert if mutual else None,
        principals=PRINCIPALS,  # type: ignore[arg-type]
    )


def client(
    target: str, pki: dict[str, Any], token: str | None, timeout_s: float = 5, **overrides: Any
) -> RolloutClient:
    security = ClientSecurity(ca_file=overrides.pop("ca", pki["ca"].cert), token=token, **overrides)
    return RolloutClient(target, timeout_s=timeout_s, security=security)


async def test_the_right_ca_and_token_work_end_to_end_and_the_run_belongs_to_its_creator(pki) -> None:
    async with served(tls_settings(pki)) as (service, target), client(target, pki, ALICE) as alice:
        run = await alice.create_run(run_spec())
        assert service.runs[run.run_id].owner == "alice"
        stream = alice.stream(run.run_id, "trainer", credits=1)
        group = await anext(aiter(stream))
        assert len(group.samples) == 2
        stream.ack([group.group_id])
        await stream.aclose()
        assert list((await alice.stats()).runs) == [run.run_id]


async def test_a_server_certificate_from_another_ca_fails_the_handshake(pki) -> None:
    async with served(tls_settings(pki)) as (_service, target):
        with pytest.raises(TimeoutError):  # the channel never becomes ready
            async with client(target, pki, ALICE, timeout_s=1.5, ca=pki["other_ca"].cert):
                pass


async def test_a_call_without_a_valid_token_is_unauthenticated_but_health_stays_open(pki) -> None:
    async with served(tls_settings(pki)) as (_service, target):
        for token in (None, "not-a-token-of-anyone"):
            async with client(target, pki, token) as anonymous:
                assert await status_of(anonymous.create_run(run_spec())) == grpc.StatusCode.UNAUTHENTICATED
                assert await status_of(anonymous.server_info()) == grpc.StatusCode.UNAUTHENTICATED
                for streaming in PER_RUN_CALLS["StreamSamples"], PER_RUN_CALLS["PushAdapter"]:
                    assert await status_of(streaming(anonymous, "r-1")) == grpc.StatusCode.UNAUTHENTICATED
        credentials = grpc.ssl_channel_credentials(pki["ca"].cert.read_bytes())
        async with grpc.aio.secure_channel(target, credentials) as channel:
            answer = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING


PER_RUN_CALLS: dict[str, Callable[[RolloutClient, str], Awaitable[Any]]] = {
    "GetRun": lambda c, run_id: c.get_run(run_id),
    "DeleteRun": lambda c, run_id: c.delete_run(run_id),
    "SubmitPrompts": lambda c, run_id: c.submit_prompts(run_id, [pb.Prompt(text="x")]),
    "StreamSamples": lambda c, run_id: anext(aiter(c.stream(run_id, "intruder", credits=1))),
    "PushAdapter": lambda c, run_id: c.push_adapter(run_id, {"adapter_config.json": b"{}"}, timeout_s=5),
    "BeginWeightUpdate": lambda c, run_id: c.begin_weight_update(
        run_id, "127.0.0.1", 29500, [pb.TensorMeta(name="w", dtype="float32", shape=[1])]
    ),
}


@pytest.mark.parametrize("rpc", sorted(PER_RUN_CALLS))
async def test_another_principal_gets_not_found_for_every_per_run_rpc(pki, rpc: str) -> None:
    async with (
        served(tls_settings(pki)) as (service, target),
        client(target, pki, ALICE) as alice,
        client(target, pki, BOB) as bob,
    ):
        run = await alice.create_run(run_spec())
        code = await status_of(PER_RUN_CALLS[rpc](bob, run.run_id))
        assert code == grpc.StatusCode.NOT_FOUND, rpc
        assert run.run_id in service.runs and service.runs[run.run_id].state == "running"  # untouched
        assert [r.run_id for r in await bob.list_runs()] == []
        assert list((await bob.stats()).runs) == []


async def test_an_admin_sees_every_run_and_the_engine_urls(pki) -> None:
    async with (
        served(tls_settings(pki)) as (service, target),
        client(target, pki, ALICE) as alice,
        client(target, pki, ADMIN) as ops,
    ):
        run = await alice.create_run(run_spec())
        service.info = type(service.info)(model="m", engine_urls=["http://vllm:8000"], max_inflight=4)
        assert [r.run_id for r in await ops.list_runs()] == [run.run_id]
        assert list((await ops.server_info()).engine_urls) == ["http://vllm:8000"]
        assert list((await alice.server_info()).engine_urls) == []
        assert (await ops.get_run(run.run_id)).run_id == run.run_id


async def test_pushes_need_the_base_weights_role_and_the_callers_own_address(pki) -> None:
    tensors = [pb.TensorMeta(name="w", dtype="float32", shape=[1])]
    async with (
        served(tls_settings(pki)) as (_service, target),
        client(target, pki, ALICE) as alice,
        client(target, pki, BOB) as bob,
    ):
        mine = await bob.create_run(run_spec())
        denied = await status_of(bob.begin_weight_update(mine.run_id, "127.0.0.1", 29500, tensors))
        assert denied == grpc.StatusCode.PERMISSION_DENIED  # bob may not change everyone's base weights
        run = await alice.create_run(run_spec())
        foreign = await status_of(alice.begin_weight_update(run.run_id, "203.0.113.7", 29500, tensors))
        assert foreign == grpc.StatusCode.PERMISSION_DENIED  # vLLM would load weights from there
        # Its own address passes the checks and reaches weight sync (none in this scripted service).
        own = await status_of(alice.begin_weight_update(run.run_id, "127.0.0.1", 29500, tensors))
        assert own == grpc.StatusCode.FAILED_PRECONDITION


async def test_only_admins_change_the_pool_and_see_its_servers(pki) -> None:
    async with (
        served(tls_settings(pki)) as (_service, target),
        client(target, pki, ALICE) as alice,
        client(target, pki, ADMIN) as ops,
    ):
        for call in (alice.add_engine("http://10.0.0.7:8000"), alice.remove_engine("http://10.0.0.7:8000", 1)):
            assert await status_of(call) == grpc.StatusCode.PERMISSION_DENIED
        # An admin reaches the pool (none that can change in this scripted service).
        assert await status_of(ops.add_engine("http://10.0.0.7:8000")) == grpc.StatusCode.FAILED_PRECONDITION
        assert await status_of(ops.add_engine("")) == grpc.StatusCode.INVALID_ARGUMENT


async def test_mutual_tls_needs_a_client_certificate_from_the_ca(pki) -> None:
    async with served(tls_settings(pki, mutual=True)) as (_service, target):
        pem = pki["client"]
        async with client(target, pki, ALICE, cert_file=pem.cert, key_file=pem.key) as alice:
            assert (await alice.create_run(run_spec())).run_id
        with pytest.raises(TimeoutError):  # no client certificate: the handshake fails
            async with client(target, pki, ALICE, timeout_s=1.5):
                pass


def test_plain_text_is_refused_off_loopback_unless_allowed() -> None:
    check_bind("127.0.0.1", SecuritySettings())
    check_bind("::1", SecuritySettings())
    with pytest.raises(StartupError, match="allow_insecure"):
        check_bind("0.0.0.0", SecuritySettings())
    check_bind("0.0.0.0", SecuritySettings(allow_insecure=True))


def test_tokens_come_from_a_file_and_are_matched_whole(tmp_path: Path) -> None:
    tokens_file = tmp_path / "tokens.yaml"
    tokens_file.write_text(f"alice: {{token: {ALICE}}}\nops: {{token: {ADMIN}, admin: true}}\n")
    table = load_token_table(SecuritySettings(tokens_file=tokens_file))
    assert table.enabled
    assert table.authenticate([("authorization", f"Bearer {ADMIN}")]).admin  # type: ignore[union-attr]
    assert table.authenticate([("authorization", f"Bearer {ALICE}")]).name == "alice"  # type: ignore[union-attr]
    for metadata in ([], [("authorization", f"Bearer {ALICE[:-1]}")], [("authorization", ALICE)]):
        assert table.authenticate(metadata) is None
    assert TokenTable({}).authenticate([]) is not None  # no principals: authentication is off
    with pytest.raises(StartupError, match="share a token"):
        load_token_table(SecuritySettings(tokens_file=tokens_file, principals={"eve": {"token": ALICE}}))  # type: ignore[dict-item]


async def test_the_health_command_answers_over_tls_without_a_token_and_says_why_not(pki) -> None:
    """``rollout-service health``: the readiness probe of deploy/k8s (Kubernetes' own gRPC
    probe cannot do TLS). Exit 0 on SERVING; 2 with a one-line reason otherwise."""

    def health(target: str, **env: str) -> Result:
        return CliRunner().invoke(cli_app, ["health", "--target", target, "--timeout", "2"], env=env)

    async with served(tls_settings(pki)) as (_service, target):
        ok = await asyncio.to_thread(health, target, ROLLOUT_TLS_CA=str(pki["ca"].cert))
        assert ok.exit_code == 0 and f"{target}: SERVING" in ok.output
        # TLS with the wrong CA: refused, and said so in one line.
        wrong = await asyncio.to_thread(health, target, ROLLOUT_TLS_CA=str(pki["other_ca"].cert))
        assert wrong.exit_code == 2 and "UNAVAILABLE" in wrong.output and "Traceback" not in wrong.output
    gone = await asyncio.to_thread(health, target, ROLLOUT_TLS_CA=str(pki["ca"].cert))
    assert gone.exit_code == 2 and f"error: {target}: UNAVAILABLE" in gone.output


async def test_a_trainer_waits_for_serving_and_says_why_when_it_never_comes(pki) -> None:
    """``rollout-trainer --wait-for-service``: a service whose vLLM servers do not answer
    yet says NOT_SERVING; the trainer waits for SERVING instead of failing its first push,
    and gives up after the wait with the last answer."""
    service = make_service(ScriptedEngine())
    server, port, health = await start_grpc_server(service, "127.0.0.1", 0, tls_settings(pki))
    target = f"localhost:{port}"
    security = {"ROLLOUT_TLS_CA": str(pki["ca"].cert)}
    try:
        await set_serving(health, False)  # as while no vLLM server answers
        with pytest.MonkeyPatch.context() as env:
            for name, value in security.items():
                env.setenv(name, value)
            waiting = asyncio.ensure_future(wait_until_serving(target, 30, poll_s=0.05))
            done, _ = await asyncio.wait({waiting}, timeout=0.3)  # several NOT_SERVING answers go by
            assert not done  # still waiting
            await set_serving(health, True)  # a server answers
            await asyncio.wait_for(waiting, 10)
            await set_serving(health, False)
            with pytest.raises(ServiceNotServing, match=r"did not say SERVING within 0\.2s \(last: NOT_SERVING\)"):
                await wait_until_serving(target, 0.2, poll_s=0.05)
        with pytest.raises(ServiceNotServing, match="UNAVAILABLE"):  # without the CA: TLS fails, said so
            await wait_until_serving(target, 0.2, poll_s=0.05)
    finally:
        await server.stop(None)
        await service.close()
