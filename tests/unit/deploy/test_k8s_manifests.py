"""deploy/k8s: the manifests name real settings, images, Secrets and files, and
``prepare.py podman`` turns them into what podman 4.3's ``kube play`` runs (it was run so:
deploy/k8s/README.md)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from rollout_service.config import ServiceSettings

K8S = Path(__file__).resolve().parents[3] / "deploy" / "k8s"
IMAGES = {"localhost/rollout-service:latest", "localhost/rollout-vllm-cpu:latest"}  # deploy/build-images.sh
CLIENT_ENV = {"ROLLOUT_TLS_CA", "ROLLOUT_TOKEN_FILE"}
"""Read by the clients (trainer, ``rollout-service health``), not service settings."""


def load_prepare() -> Any:
    spec = importlib.util.spec_from_file_location("k8s_prepare", K8S / "prepare.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


prepare = load_prepare()


def manifests() -> list[dict[str, Any]]:
    return [d for name in sorted(K8S.glob("*.yaml")) for d in yaml.safe_load_all(name.read_text()) if d]


def pod_specs(documents: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    specs = {}
    for d in documents:
        if d["kind"] in ("Deployment", "Job"):
            specs[d["metadata"]["name"]] = d["spec"]["template"]["spec"]
        elif d["kind"] == "Pod":
            specs[d["metadata"]["name"]] = d["spec"]
    return specs


def containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return spec.get("initContainers", []) + spec["containers"]


def is_setting(env_name: str) -> bool:
    """Whether ``ROLLOUT_A__B`` names a field ``a.b`` of the service's settings."""
    model: type[BaseModel] = ServiceSettings
    parts = env_name.removeprefix("ROLLOUT_").lower().split("__")
    for i, part in enumerate(parts):
        field = model.model_fields.get(part)
        if field is None:
            return False
        annotation = field.annotation
        nested = [a for a in getattr(annotation, "__args__", (annotation,)) if isinstance(a, type)]
        model = next((a for a in nested if issubclass(a, BaseModel)), None)  # type: ignore[assignment]
        if model is None:
            return i == len(parts) - 1
    return True


def test_every_deployed_setting_exists_and_every_image_is_built_here() -> None:
    documents = manifests()
    kinds = {d["kind"] for d in documents}
    assert {"Deployment", "Service", "Job", "PersistentVolumeClaim", "NetworkPolicy"} <= kinds
    for name, spec in pod_specs(documents).items():
        for container in containers(spec):
            assert container["image"] in IMAGES, (name, container["image"])
            for env in container.get("env", []):
                if env["name"].startswith("ROLLOUT_") and env["name"] not in CLIENT_ENV:
                    assert is_setting(env["name"]), f"{name}: {env['name']} is not a service setting"
    assert is_setting("ROLLOUT_ENGINE__DISCOVER") and not is_setting("ROLLOUT_ENGINE__DISCOVERY")


def test_the_secrets_hold_every_file_the_pods_read_from_them(tmp_path: Path) -> None:
    prepare.write_credentials(tmp_path, list(prepare.HOSTS))
    secrets = {s["metadata"]["name"]: s["stringData"] for s in prepare.secret_manifests(tmp_path)}
    assert "BEGIN CERTIFICATE" in secrets["rollout-service-tls"]["server.crt"]
    for name, spec in pod_specs(manifests()).items():
        mounts = {v["name"]: v["secret"]["secretName"] for v in spec.get("volumes", []) if "secret" in v}
        for container in containers(spec):
            for mount in container.get("volumeMounts", []):
                if mount["name"] not in mounts:
                    continue
                files = secrets[mounts[mount["name"]]]
                for env in container.get("env", []):
                    value = env.get("value", "")
                    if value.startswith(mount["mountPath"] + "/"):
                        assert value.removeprefix(mount["mountPath"] + "/") in files, (name, env)


def test_podman_gets_pods_deployments_and_claims_with_pod_names_and_host_directories(tmp_path: Path) -> None:
    prepare.write_credentials(tmp_path, list(prepare.HOSTS))
    played = prepare.for_podman(manifests(), prepare.secret_directories(tmp_path))
    assert {d["kind"] for d in played} == {"PersistentVolumeClaim", "Deployment", "Pod"}
    text = yaml.safe_dump_all(played)
    assert "vllm:8000" not in text and "vllm-pod-0:8000" in text
    assert "rollout:50051" not in text and "rollout-pod-0:50051" in text
    trainer = pod_specs(played)["trainer"]
    assert trainer["restartPolicy"] == "Never"
    directories = [v["hostPath"]["path"] for v in trainer["volumes"] if "hostPath" in v]
    assert directories == [str(tmp_path / "secrets" / "rollout-trainer-credentials")]
    assert sorted(p.name for p in Path(directories[0]).iterdir()) == ["ca.crt", "trainer.token"]
    assert all(not any("secret" in v for v in spec.get("volumes", [])) for spec in pod_specs(played).values())


@pytest.mark.parametrize("host", ["rollout", "rollout-pod-0", "127.0.0.1"])
def test_the_certificate_covers_the_names_the_pods_use(tmp_path: Path, host: str) -> None:
    from cryptography import x509

    prepare.write_credentials(tmp_path, list(prepare.HOSTS))
    certificate = x509.load_pem_x509_certificate((tmp_path / "server.crt").read_bytes())
    names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    covered = [str(n.value) for n in names]
    assert host in covered


def test_the_trainer_job_trains_the_tiny_model_with_its_settings_on_the_demo_task() -> None:
    from rollout_common.tiny_model import TINY_MODEL_TRAINING
    from trainer_client.cli import TrainerArgumentParser

    command = pod_specs(manifests())["trainer"]["containers"][0]["command"]
    assert command[0] == "rollout-trainer"
    run, config, model = TrainerArgumentParser().parse(command[1:])  # every flag a real option
    # The trainer's defaults are TRL's, for real models: the job spells out the tiny model's.
    assert {key: getattr(config, key) for key in TINY_MODEL_TRAINING} == TINY_MODEL_TRAINING
    assert (run.target, run.dataset, run.save_model) == ("rollout:50051", "repeat_a", True)
    assert (config.max_steps, config.output_dir, model.model_name_or_path) == (10, "/outputs", "/models/tiny-qwen2")
