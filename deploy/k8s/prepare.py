"""Two local steps for deploy/k8s: throwaway credentials as Kubernetes Secrets, and the
manifests rewritten for ``podman kube play``.

    python deploy/k8s/prepare.py secrets --dir k8s-credentials > secrets.yaml    # kubectl apply -f
    python deploy/k8s/prepare.py podman --dir k8s-credentials > podman-play.yaml # podman kube play

Needs the project installed (``make setup``; run it with ``.venv/bin/python``).

``secrets`` writes a CA, the service's certificate and tokens (``rollout-service
dev-credentials``) into ``--dir`` once, and prints two Secrets: ``rollout-service-tls``
(certificate, key, tokens file) and ``rollout-trainer-credentials`` (the CA and the trainer's
token). They are for trying the manifests; use your own PKI for anything shared.

``podman`` prints the same workload as podman 4.3's ``kube play`` runs it. It plays Pods,
Deployments and PersistentVolumeClaims only, and has no cluster DNS. So:
- Services, NetworkPolicies and Secrets are left out;
- the trainer Job becomes a Pod (``restartPolicy: Never``);
- each Secret volume becomes a host directory holding the same files;
- the Services' names become pod names (podman names a Deployment's pod ``NAME-pod-0`` and
  its network's DNS resolves pod names): ``vllm:8000`` becomes ``vllm-pod-0:8000``;
- a memory-backed emptyDir (vLLM's ``/dev/shm``) becomes the host's ``/dev/shm``: podman
  makes the volume root's, where vLLM's user cannot create its shared memory;
- init containers run as podman's ``always`` kind: 4.3 fails to remove a finished ``once``
  init container ("cannot remove container ... as it is running").
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
MANIFESTS = ("storage.yaml", "vllm.yaml", "rollout.yaml", "trainer-job.yaml")
SERVICES = {"vllm:8000": "vllm-pod-0:8000", "rollout:50051": "rollout-pod-0:50051"}
"""Service name -> the pod name podman resolves instead."""
INIT_CONTAINER_TYPE = "io.podman.annotations.init.container.type"
SECRETS = {
    "rollout-service-tls": ("server.crt", "server.key", "tokens.yaml", "ca.crt"),
    "rollout-trainer-credentials": ("ca.crt", "trainer.token"),
}
"""Secret name -> the credential files it holds."""
HOSTS = (
    "rollout", "rollout.default.svc", "rollout.default.svc.cluster.local", "rollout-pod-0", "localhost", "127.0.0.1",
)  # fmt: skip
"""Names the service's certificate is valid for: the Service's (in namespace default), the
pod name podman resolves, and loopback for the readiness probe."""


def write_credentials(directory: Path, hosts: list[str]) -> None:
    from rollout_service.edge.dev_credentials import PrincipalSpec, write_dev_credentials

    principals = [PrincipalSpec.parse("trainer:push_base_weights"), PrincipalSpec.parse("admin:admin")]
    write_dev_credentials(directory, hosts, principals)  # kept if it exists


def secret_manifests(directory: Path) -> list[dict[str, Any]]:
    return [
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": name},
            "type": "Opaque",
            "stringData": {file: (directory / file).read_text() for file in files},
        }
        for name, files in SECRETS.items()
    ]


def for_podman(documents: list[dict[str, Any]], secret_dirs: dict[str, Path]) -> list[dict[str, Any]]:
    played = []
    for document in documents:
        kind = document["kind"]
        if kind in ("Service", "NetworkPolicy", "Secret"):
            continue
        if kind == "Job":
            template = document["spec"]["template"]
            document = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": document["metadata"]["name"], **template.get("metadata", {})},
                "spec": template["spec"],
            }
        pod = document["spec"]["template"] if kind == "Deployment" else document
        pod_spec = pod.get("spec", {})
        for volume in pod_spec.get("volumes", []):
            if "secret" in volume:
                name = volume.pop("secret")["secretName"]
                volume["hostPath"] = {"path": str(secret_dirs[name]), "type": "Directory"}
            if volume.get("emptyDir", {}).get("medium") == "Memory":
                del volume["emptyDir"]
                volume["hostPath"] = {"path": "/dev/shm", "type": "Directory"}
        if pod_spec.get("initContainers"):
            pod.setdefault("metadata", {}).setdefault("annotations", {})[INIT_CONTAINER_TYPE] = "always"
        played.append(_renamed(document))
    return played


def _renamed(value: Any) -> Any:
    """``value`` with every Service address in its strings replaced by podman's pod name."""
    if isinstance(value, dict):
        return {key: _renamed(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_renamed(item) for item in value]
    if isinstance(value, str):
        for service, pod in SERVICES.items():
            value = value.replace(service, pod)
    return value


def secret_directories(directory: Path) -> dict[str, Path]:
    """Each Secret's files in a directory of its own, readable by the images' user (uid
    1000), as a Secret volume would be: the credentials themselves are private to root."""
    dirs = {}
    for name, files in SECRETS.items():
        target = directory / "secrets" / name
        target.mkdir(parents=True, exist_ok=True)
        for file in files:
            shutil.copyfile(directory / file, target / file)
            (target / file).chmod(0o644)
        dirs[name] = target
    return dirs


def _block_strings(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    """Multi-line strings (certificates, commands) as YAML blocks, readable as written."""
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style="|" if "\n" in text else None)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("secrets", "podman"))
    parser.add_argument("--dir", type=Path, required=True, help="where the credentials are (written once)")
    parser.add_argument("--host", action="append", help=f"names the certificate covers [default: {', '.join(HOSTS)}]")
    args = parser.parse_args(argv)
    directory = args.dir.resolve()
    write_credentials(directory, args.host or list(HOSTS))
    if args.what == "secrets":
        documents = secret_manifests(directory)
    else:
        documents = [d for name in MANIFESTS for d in yaml.safe_load_all((HERE / name).read_text()) if d]
        documents = for_podman(documents, secret_directories(directory))
    yaml.SafeDumper.add_representer(str, _block_strings)
    yaml.safe_dump_all(documents, sys.stdout, sort_keys=False)


if __name__ == "__main__":
    main()
