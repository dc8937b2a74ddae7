#!/usr/bin/env bash
# Builds a Debian bookworm base image with python3 (3.11), python3-venv and python3-pip from a Debian
# mirror with debootstrap and `docker import`, for machines that reach no container registry.
# Usage (as root): bash docker/make-debian-base.sh [TAG]      (default exspec-base:bookworm)
# Does nothing when TAG already exists. Needs debootstrap (apt-get install debootstrap).
set -euo pipefail
TAG=${1:-exspec-base:bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
if docker image inspect "$TAG" >/dev/null 2>&1; then
  echo "base image $TAG exists"
  exit 0
fi
rootfs=$(mktemp -d /tmp/exspec-rootfs.XXXXXX)
trap 'rm -rf "$rootfs" "$rootfs.log"' EXIT
echo "debootstrap bookworm from $MIRROR into $rootfs"
debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
  bookworm "$rootfs" "$MIRROR" >"$rootfs.log" 2>&1 || { tail -20 "$rootfs.log"; exit 1; }

rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/cache/apt/archives/*.deb
tar -C "$rootfs" -c . | docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'CMD ["python3"]' - "$TAG" >/dev/null
echo "imported $TAG ($(docker run --rm "$TAG" python3 --version))"
