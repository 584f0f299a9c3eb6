#!/usr/bin/env bash
# Build a minimal Debian bookworm base image locally and import it into podman (or docker).
#
# Use this where no base image can be pulled from a registry: debootstrap fetches Debian's
# own packages, and the resulting root filesystem becomes an image. Idempotent: an existing
# image of the same name is kept unless FORCE=1.
#
#   deploy/build-base-image.sh                    # -> localhost/bookworm-python:latest
#   IMAGE=my-base FORCE=1 deploy/build-base-image.sh
#   ENGINE=docker deploy/build-base-image.sh
#
# Needs root (debootstrap) and the `debootstrap` package (apt-get install -y debootstrap).
# Then build the project images with --build-arg BASE_IMAGE=localhost/bookworm-python:latest
# (that is the Dockerfiles' default when BASE_IMAGE is unset in docker-compose.yml).
set -euo pipefail

IMAGE="${IMAGE:-localhost/bookworm-python:latest}"
ENGINE="${ENGINE:-podman}"
SUITE="${SUITE:-bookworm}"
MIRROR="${MIRROR:-http://deb.debian.org/debian}"
FORCE="${FORCE:-0}"

if [[ "$FORCE" != 1 ]] && "$ENGINE" image inspect "$IMAGE" >/dev/null 2>&1; then
  echo "$IMAGE already exists (FORCE=1 rebuilds it)"
  exit 0
fi

ROOTFS="$(mktemp -d /tmp/rootfs-"$SUITE".XXXXXX)"
trap 'rm -rf "$ROOTFS"' EXIT

debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
  "$SUITE" "$ROOTFS" "$MIRROR"

# Keep the image small: package lists and caches are not needed at run time.
rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/archives/*.deb

tar -C "$ROOTFS" -c . | "$ENGINE" import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["/bin/bash"]' \
  - "$IMAGE"
echo "built $IMAGE"
