"""``rollout-service dev-credentials`` writes what a TLS + token service and its clients need,
and a real gRPC server configured from those files alone accepts its principals."""

from __future__ import annotations

import stat
from pathlib import Path

import grpc
import pytest
from typer.testing import CliRunner

from rollout_api.client import ClientSecurity, RolloutClient
from rollout_service.config import SecuritySettings
from rollout_service.edge.cli import app
from rollout_service.edge.security import load_token_table
from rollout_service.edge.server import start_grpc_server
from tests.unit.grpc_helpers import run_spec, status_of
from tests.unit.scripted import ScriptedEngine, make_service


def write(directory: Path, *flags: str) -> str:
    result = CliRunner().invoke(app, ["dev-credentials", str(directory), *flags])
    assert result.exit_code == 0, result.output
    return result.output


async def test_a_service_configured_from_the_files_accepts_their_principals_over_mutual_tls(tmp_path: Path) -> None:
    write(tmp_path, "--principal", "trainer:push_base_weights", "--principal", "viewer")
    security = SecuritySettings(
        tls_cert_file=tmp_path / "server.crt",
        tls_key_file=tmp_path / "server.key",
        tls_client_ca_file=tmp_path / "ca.crt",
        tokens_file=tmp_path / "tokens.yaml",
    )
    service = make_service(ScriptedEngine())
    server, port, _health = await start_grpc_server(service, "127.0.0.1", 0, security)

    def client(name: str, token_file: Path | None) -> RolloutClient:
        credentials = ClientSecurity(
            ca_file=tmp_path / "ca.crt",
            cert_file=tmp_path / f"{name}.crt",
            key_file=tmp_path / f"{name}.key",
            token=token_file.read_text().strip() if token_file else None,
        )
        return RolloutClient(f"localhost:{port}", timeout_s=5, security=credentials)

    try:
        async with client("trainer", tmp_path / "trainer.token") as trainer, client("viewer", None) as anonymous:
            run = await trainer.create_run(run_spec())
            assert service.runs[run.run_id].owner == "trainer"
            assert await status_of(anonymous.get_run(run.run_id)) == grpc.StatusCode.UNAUTHENTICATED
        async with client("viewer", tmp_path / "viewer.token") as viewer:
            assert await status_of(viewer.get_run(run.run_id)) == grpc.StatusCode.NOT_FOUND
    finally:
        await server.stop(None)
        await service.close()


def test_keys_and_tokens_are_private_and_a_second_call_keeps_them(tmp_path: Path) -> None:
    output = write(tmp_path, "--host", "rollout", "--host", "10.0.0.7")
    assert "ROLLOUT_TOKEN_FILE=" in output
    for name in ("ca.key", "server.key", "trainer.key", "trainer.token", "admin.token", "tokens.yaml"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o600, name
    token = (tmp_path / "trainer.token").read_text()
    assert "kept the credentials" in write(tmp_path)
    assert (tmp_path / "trainer.token").read_text() == token
    table = load_token_table(SecuritySettings(tokens_file=tmp_path / "tokens.yaml"))
    trainer = table.authenticate([("authorization", f"Bearer {token.strip()}")])
    assert trainer is not None and trainer.name == "trainer" and trainer.push_base_weights and not trainer.admin


def test_the_server_certificate_names_the_given_hosts(tmp_path: Path) -> None:
    from cryptography import x509

    write(tmp_path, "--host", "rollout", "--host", "10.0.0.7", "--host", "rollout_service", "--host", "*.rl.svc")
    certificate = x509.load_pem_x509_certificate((tmp_path / "server.crt").read_bytes())
    names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["rollout", "rollout_service", "*.rl.svc"]  # Compose, wildcard
    assert [str(address) for address in names.get_values_for_type(x509.IPAddress)] == ["10.0.0.7"]


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("x:god", "principal 'x': unknown role(s) ['god']; roles are admin, push_base_weights"),
        ("my-trainer", "principal name 'my-trainer': use letters, digits and underscores"),
    ],
)
def test_a_bad_principal_is_refused_with_one_line(tmp_path: Path, flag: str, message: str) -> None:
    assert_refused(tmp_path, ["--principal", flag], message)


@pytest.mark.parametrize(
    ("host", "message"), [("", "--host '' is neither a host name nor an IP address"), ("not a host!", "neither")]
)
def test_a_bad_host_is_refused_before_anything_is_written(tmp_path: Path, host: str, message: str) -> None:
    assert_refused(tmp_path, ["--host", host], message)
    assert not (tmp_path / "out").exists()


def assert_refused(tmp_path: Path, flags: list[str], message: str) -> None:
    result = CliRunner().invoke(app, ["dev-credentials", str(tmp_path / "out"), *flags])
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())
    assert "Traceback" not in result.output
    assert not (tmp_path / "out" / "tokens.yaml").exists()


def test_a_file_given_as_the_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / "out").write_text("")
    result = CliRunner().invoke(app, ["dev-credentials", str(tmp_path / "out")])
    assert result.exit_code == 2 and "out is a file; give a folder for the credentials" in result.output
