#!/usr/bin/env bash
# Build the two images of docker-compose.yml from this checkout's committed files, from any
# directory (the paths are the script's own, not the caller's).
#
#   deploy/build-images.sh                          # podman; base image built here if missing
#   ENGINE=docker BASE_IMAGE=python:3.11-slim deploy/build-images.sh
#   TORCH_FIND_LINKS=/opt/wheels PIP_CERT=/etc/ssl/certs/ca-certificates.crt deploy/build-images.sh
#
# REF: the git ref to build (HEAD). BASE_IMAGE: localhost/bookworm-python:latest by default,
# made by deploy/build-base-image.sh where no registry can be reached. TORCH_FIND_LINKS: a
# folder of torch wheels instead of PyTorch's index; PIP_CERT: a CA bundle for pip. With
# podman both are mounted into the build (docker build cannot mount: put them in the context).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ENGINE="${ENGINE:-podman}"
BASE_IMAGE="${BASE_IMAGE:-localhost/bookworm-python:latest}"
REF="${REF:-HEAD}"

if [[ "$BASE_IMAGE" == localhost/bookworm-python:latest ]]; then
  IMAGE="$BASE_IMAGE" ENGINE="$ENGINE" "$ROOT/deploy/build-base-image.sh"  # keeps an existing one
fi

CONTEXT="$(mktemp -d /tmp/rollout-build.XXXXXX)"
trap 'rm -rf "$CONTEXT"' EXIT
git -C "$ROOT" archive "$REF" | tar -x -C "$CONTEXT"  # the tracked files only: no venv, no models

ARGS=(--build-arg "BASE_IMAGE=$BASE_IMAGE")
if [[ -n "${TORCH_FIND_LINKS:-}" ]]; then
  ARGS+=(--build-arg TORCH_INDEX_URL= --build-arg "TORCH_FIND_LINKS=$TORCH_FIND_LINKS")
  [[ "$ENGINE" == podman ]] && ARGS+=(-v "$TORCH_FIND_LINKS:$TORCH_FIND_LINKS:ro")
fi
if [[ -n "${PIP_CERT:-}" ]]; then
  ARGS+=(--build-arg "PIP_CERT=$PIP_CERT")
  [[ "$ENGINE" == podman ]] && ARGS+=(-v "$(dirname "$PIP_CERT"):$(dirname "$PIP_CERT"):ro")
fi

"$ENGINE" build "${ARGS[@]}" -f "$CONTEXT/deploy/Dockerfile" -t localhost/rollout-service:latest "$CONTEXT"
"$ENGINE" build "${ARGS[@]}" -f "$CONTEXT/deploy/Dockerfile.vllm-cpu" -t localhost/rollout-vllm-cpu:latest "$CONTEXT"
echo "built localhost/rollout-service:latest and localhost/rollout-vllm-cpu:latest from $REF"
