#!/usr/bin/env bash
# `make image`: the Debian base (scripts/build-base.sh), then the CPU serving image
# (Dockerfile target cpu) in this project's podman storage (scripts/podman-env.sh), with
# no registry: --pull=never, the local torch wheel folder as a build volume, the host CA
# bundle as a build secret. Reproducible: SOURCE_DATE_EPOCH is the last commit time of
# the image's environment (Dockerfile, .dockerignore, the cpu lock, the build scripts),
# passed to --timestamp (every file and the image) and as a build arg (hash-checked
# .pyc). Not the code's: a code commit then leaves the epoch, and so the cached
# dependency layer (the pip install from the lock, ~5 min), as they were; the image's
# digest still follows every input, since the code layers hold the code.
# Prints the image's digest and ID; benchmarks/results/image_build.json records them
# (deployments/harness/records.py). NO_CACHE=1 rebuilds every layer; SKIP_BASE=1 keeps
# the base image already in storage.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/podman-env.sh
IMAGE=${IMAGE:-localhost/dsv4-serve:cpu}
BASE_IMAGE=${BASE_IMAGE:-localhost/dsv4-serve-base:bookworm}
WHEELS=${WHEELS:-/opt/wheels}        # holds torch-2.13.0+cpu-cp311 (the lock's sha256)
CA_BUNDLE=${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
PY=${PY:-.venv/bin/python}
# Everything the build context gives the cpu target (Dockerfile, .dockerignore).
INPUTS=(Dockerfile .dockerignore pyproject.toml README.md dsv4_patch deployments configs k8s
        scripts/locks/cpu.txt ':(exclude)k8s/params.yaml' ':(exclude)k8s/*.rayservice.yaml')
ENVIRONMENT=(Dockerfile .dockerignore scripts/locks/cpu.txt scripts/build-base.sh scripts/build-image.sh)
SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct -- "${ENVIRONMENT[@]}")}
export SOURCE_DATE_EPOCH
dirty=$(git status --porcelain -- "${INPUTS[@]}" | head -5)
if [ -n "$dirty" ]; then
  echo "build-image: uncommitted changes in the image's inputs; the digest is not a commit's:" >&2
  echo "$dirty" >&2
fi
start=$(date +%s)
[ "${SKIP_BASE:-0}" = 1 ] || BASE_IMAGE=$BASE_IMAGE scripts/build-base.sh
base_done=$(date +%s)
cache=(--layers)
[ "${NO_CACHE:-0}" = 1 ] && cache=(--no-cache)
podman build --pull=never "${cache[@]}" --target cpu \
  --ulimit nofile=16384:16384 --ulimit nproc=32768:32768 \
  --timestamp "$SOURCE_DATE_EPOCH" --build-arg SOURCE_DATE_EPOCH="$SOURCE_DATE_EPOCH" \
  --build-arg CPU_BASE="$BASE_IMAGE" \
  --secret id=ca,src="$CA_BUNDLE" --volume "$WHEELS:/wheels:ro" \
  -t "$IMAGE" -f Dockerfile .
done_at=$(date +%s)
digest=$(podman image inspect --format '{{.Digest}}' "$IMAGE")
image_id=$(podman image inspect --format '{{.Id}}' "$IMAGE")
base_digest=$(podman image inspect --format '{{.Digest}}' "$BASE_IMAGE")
size=$(podman image inspect --format '{{.Size}}' "$IMAGE")
echo "image $IMAGE digest $digest id sha256:$image_id size $size"
echo "base $BASE_IMAGE digest $base_digest; base $((base_done - start)) s, image $((done_at - base_done)) s"
if [ -n "${RECORD:-}" ]; then
  PYTHONPATH=$PWD "$PY" -m deployments.harness.records image-build --image "$IMAGE" \
    --digest "$digest" --image-id "sha256:$image_id" --base-digest "$base_digest" \
    --size "$size" --base-s "$((base_done - start))" --image-s "$((done_at - base_done))" \
    --source-date-epoch "$SOURCE_DATE_EPOCH" --no-cache "${NO_CACHE:-0}" --note "${RECORD}"
fi
