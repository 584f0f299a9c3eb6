"""``rollout-service``: serve, or build the tiny model. Configuration errors print one line
that says what to change and exit with status 2, never a traceback."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.logging import RichHandler

from rollout_common.settings_file import SettingsFileError
from rollout_service.config import ServiceSettings, check_http_url, load_settings

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(message)s",
        datefmt="[%X]",
        handlers=[RichHandler(show_path=False, console=Console(stderr=True))],  # stdout stays for output
    )


def _fail(message: str) -> NoReturn:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


def apply_managed_flags(settings: ServiceSettings, options: dict[str, Any], vllm_args: list[str]) -> None:
    """Apply ``serve``'s managed-server flags (None: not given); a ValueError names the wrong flag."""
    given = {name: value for name, value in options.items() if value is not None}
    if not given and not vllm_args:
        return
    if settings.engine.managed is None:
        flags = ", ".join(f"--{name.replace('_', '-')}" for name in [*given, *(["vllm_arg"] if vllm_args else [])])
        raise ValueError(f"{flags} set the managed vLLM server; they cannot be combined with --vllm-url")
    try:
        managed = type(settings.engine.managed).model_validate({**settings.engine.managed.model_dump(), **given})
    except ValidationError as exc:
        problems = "; ".join(f"--{'-'.join(map(str, e['loc'])).replace('_', '-')}: {e['msg']}" for e in exc.errors())
        raise ValueError(f"managed server: {problems}") from None
    managed.extra_args += vllm_args
    settings.engine.managed = managed
    settings.fit_backend_to_managed_device()


def settings_from_cli(config: Path | None, overrides: dict[str, Any]) -> ServiceSettings:
    try:
        return load_settings(config, **overrides)
    except (FileNotFoundError, SettingsFileError) as exc:
        _fail(str(exc))
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        _fail(f"invalid configuration: {problems}")


async def serve_until_signalled(settings: ServiceSettings) -> None:
    from rollout_service.app import running_service

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        if stop.is_set():
            _exit_now("a second signal")
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    async with running_service(settings):
        await stop.wait()
        logging.getLogger(__name__).info("shutting down (at most %.0fs)", settings.shutdown_timeout_s)
        # A hung reward or tool thread would keep the process alive for ever: a daemon timer ends it.
        deadline = threading.Timer(settings.shutdown_timeout_s, _exit_now, [f"{settings.shutdown_timeout_s:g}s"])
        deadline.daemon = True
        deadline.start()


def _exit_now(why: str) -> None:
    logging.getLogger(__name__).error("shutdown did not finish (%s; hung user code?); exiting now", why)
    logging.shutdown()
    os._exit(1)


@app.command()
def serve(
    config: Annotated[Path | None, typer.Option(help="YAML settings file")] = None,
    host: Annotated[str | None, typer.Option(help="gRPC bind address")] = None,
    port: Annotated[int | None, typer.Option(help="gRPC port")] = None,
    metrics_port: Annotated[int | None, typer.Option(help="Prometheus /metrics port")] = None,
    state_store: Annotated[
        str | None, typer.Option(help="SQLite file keeping runs and unacked groups across restarts (default: memory)")
    ] = None,
    openai_port: Annotated[
        int | None, typer.Option(help="Port of the OpenAI-compatible endpoint of external runs (default: off)")
    ] = None,
    vllm_url: Annotated[
        list[str] | None, typer.Option(help="A running vLLM server (repeat for several); default: managed")
    ] = None,
    model: Annotated[str | None, typer.Option(help="Managed server: a Hub model id or a local folder")] = None,
    max_model_len: Annotated[
        int | None, typer.Option(help="Managed server: context length (prompt + completion tokens)")
    ] = None,
    dtype: Annotated[str | None, typer.Option(help="Managed server: vLLM's --dtype (default: by device)")] = None,
    device: Annotated[str | None, typer.Option(help="Managed server: cpu, gpu or auto")] = None,
    gpu_memory_utilization: Annotated[
        float | None, typer.Option(help="Managed server on a GPU: the share of its memory vLLM may take")
    ] = None,
    kv_cache_gib: Annotated[int | None, typer.Option(help="Managed server on a CPU: KV-cache size in GiB")] = None,
    vllm_arg: Annotated[
        list[str] | None, typer.Option(help="Managed server: a vLLM argument as is (--vllm-arg=--seed --vllm-arg=1)")
    ] = None,
    max_inflight: Annotated[int | None, typer.Option(help="Slots: episodes generating at once")] = None,
    reward_module: Annotated[
        list[str] | None, typer.Option(help="Module with a REWARD_FUNCTIONS dict, or module:function (repeatable)")
    ] = None,
    tool_module: Annotated[list[str] | None, typer.Option(help="Python module with tools (repeatable)")] = None,
    environment_module: Annotated[
        list[str] | None, typer.Option(help="Python module with environments (repeatable)")
    ] = None,
    log_level: Annotated[str | None, typer.Option(help="DEBUG, INFO, WARNING, ...")] = None,
) -> None:
    """Run the rollout service until SIGINT/SIGTERM."""
    overrides: dict[str, Any] = {
        "host": host,
        "port": port,
        "metrics_port": metrics_port,
        "openai_port": openai_port,
        "state_store": state_store,
        "log_level": log_level,
    }
    settings = settings_from_cli(config, overrides)
    if vllm_url:
        for url in vllm_url:
            try:
                check_http_url(url)
            except ValueError as exc:
                _fail(f"--vllm-url: {exc}")
        settings.engine.urls = vllm_url
        settings.engine.managed = None
    managed_options = {
        "model": model,
        "max_model_len": max_model_len,
        "dtype": dtype,
        "device": device,
        "gpu_memory_utilization": gpu_memory_utilization,
        "kv_cache_gib": kv_cache_gib,
    }
    try:
        apply_managed_flags(settings, managed_options, vllm_arg or [])
    except ValueError as exc:
        _fail(str(exc))
    if max_inflight is not None:
        if max_inflight < 1:
            _fail(f"--max-inflight is {max_inflight}; it must be >= 1")
        settings.scheduler.max_inflight = max_inflight
    # Added to the settings' modules, importable from the working directory as with `python -m`.
    if reward_module or tool_module or environment_module:
        sys.path.insert(0, os.getcwd())
    settings.reward_modules += reward_module or []
    settings.tool_modules += tool_module or []
    settings.environment_modules += environment_module or []
    setup_logging(settings.log_level)
    import uvloop

    from rollout_service.errors import StartupError

    try:
        uvloop.run(serve_until_signalled(settings))
    except StartupError as exc:
        _fail(str(exc))


@app.command("build-tiny-model")
def build_tiny_model_command(
    output_dir: Annotated[Path, typer.Argument(help="Where to write the checkpoint")] = Path("models/tiny-qwen2"),
) -> None:
    """Build the tiny Qwen2 model and tokenizer of the embedded default (no download)."""
    from rollout_common.tiny_model import build_tiny_model

    setup_logging("INFO")
    try:
        typer.echo(build_tiny_model(output_dir))
    except OSError as exc:
        _fail(f"cannot write {output_dir}: {exc.strerror or exc}; give a folder this user can write")


@app.command("dev-credentials")
def dev_credentials_command(
    directory: Annotated[Path, typer.Argument(help="Where to write the files")],
    host: Annotated[
        list[str] | None, typer.Option(help="Host clients connect to (repeatable) [default: localhost, 127.0.0.1]")
    ] = None,
    principal: Annotated[
        list[str] | None,
        typer.Option(
            help="NAME or NAME:ROLE[:ROLE], roles admin and push_base_weights (repeatable) "
            "[default: trainer:push_base_weights, admin:admin]"
        ),
    ] = None,
    days: Annotated[float, typer.Option(min=0.01, help="Validity of the certificates")] = 30,
) -> None:
    """Write a throwaway CA, server certificate, and per principal a token and client certificate (kept if present)."""
    from rollout_service.edge.dev_credentials import PrincipalSpec, write_dev_credentials

    try:
        principals = [PrincipalSpec.parse(text) for text in principal or ["trainer:push_base_weights", "admin:admin"]]
        made = write_dev_credentials(directory, host or ["localhost", "127.0.0.1"], principals, days)
    except (ValueError, OSError) as exc:
        _fail(str(exc))
    if not made.created:
        typer.echo(f"{made.tokens_file} exists: kept the credentials in {directory}")
        return
    server = made.server()
    names = ", ".join(p.name for p in principals)
    typer.echo(
        f"wrote {directory}: CA ca.crt, server certificate server.crt/.key, tokens.yaml, and for {names} a "
        "NAME.token and a client certificate NAME.crt/.key\n"
        f"service: ROLLOUT_SECURITY__TLS_CERT_FILE={server.cert} ROLLOUT_SECURITY__TLS_KEY_FILE={server.key} "
        f"ROLLOUT_SECURITY__TOKENS_FILE={made.tokens_file}\n"
        f"client:  ROLLOUT_TLS_CA={made.ca} ROLLOUT_TOKEN_FILE={made.token_file(principals[0].name)}"
    )


@app.command()
def health(
    target: Annotated[str, typer.Option(help="The service, host:port")] = "127.0.0.1:50051",
    timeout: Annotated[float, typer.Option(min=0.1, help="Seconds to wait for the answer")] = 5.0,
) -> None:
    """Exit 0 if the service answers SERVING to gRPC health, else 2 with the reason (TLS from ROLLOUT_TLS_CA)."""
    from rollout_api.client import HealthCheckFailed, health_status  # the API's client, loaded by this command only

    try:
        status = asyncio.run(health_status(target, timeout))
    except (HealthCheckFailed, OSError, ValueError) as exc:  # OSError, ValueError: unreadable or missing TLS files
        _fail(f"{target}: {exc}")
    if status != "SERVING":
        _fail(f"{target}: {status}")
    typer.echo(f"{target}: SERVING")


@app.command()
def top(
    target: Annotated[str, typer.Option(help="The service, host:port")] = "127.0.0.1:50051",
    interval: Annotated[float, typer.Option(min=0.1, help="Seconds between refreshes")] = 2.0,
    once: Annotated[bool, typer.Option(help="Print one snapshot and exit")] = False,
    timeout: Annotated[float, typer.Option(min=0.1, help="Seconds to wait for the service")] = 10.0,
) -> None:
    """A live view of slots, tokens/s and runs (TLS and token from ROLLOUT_TLS_CA / ROLLOUT_TOKEN_FILE)."""
    from rollout_api.top import ServiceUnreachable, show  # the API's client, loaded by this command only

    try:
        show(target, interval, once, timeout)
    except ServiceUnreachable as exc:
        _fail(str(exc))


if __name__ == "__main__":
    app()
