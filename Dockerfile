# syntax=docker/dockerfile:1
#
# draftlab's two images, one final stage. The GPU image (default): CUDA 13.0 devel on Ubuntu 24.04,
# a Python 3.12 venv with torch (cu130, sm_120 kernels), vLLM, flash-attn compiled for sm_120 (RTX
# PRO 6000 Blackwell), speculators and draftlab, from the hash lock requirements/gpu-lock.txt. The
# CPU image (`--build-arg IMAGE=cpu`): Debian 12's Python 3.11 with requirements/cpu.txt, the CPU
# venv's lock, exactly. Both then get the same final stage (draftlab, the non-root user, the cache
# env, EXPOSE 5000, `dvc repro`). The user's checkout is mounted at /workspace. Build and run:
# docs/container.md. Rules this file must keep (digest pins, versions equal to requirements/,
# sm_120, non-root user, ...) are checked by tests/unit/test_dockerfile.py; scripts/image-check.sh
# builds and proves the CPU image.
#
#   docker build -t draftlab .                                  # ~20-30 min at MAX_JOBS=8 (flash-attn)
#   docker build -t draftlab-cpu --build-arg IMAGE=cpu .        # minutes
#
# The bases are pinned by digest. To check a digest or pick up a refreshed one:
#   docker buildx imagetools inspect nvidia/cuda:13.0.0-devel-ubuntu24.04
#   docker buildx imagetools inspect debian:bookworm-slim

# Which image the final stage builds on: gpu or cpu.
ARG IMAGE=gpu
# The CPU image's base: Debian 12 (its python3 is 3.11, the CPU lock's Python). Any Debian 12 image
# works; scripts/image-check.sh passes one made locally with mmdebstrap that already holds the
# packages the cpu-env stage would otherwise install with apt-get.
ARG CPU_BASE=docker.io/library/debian:bookworm-slim@sha256:4b50eb66f977b4062683ff434ef18ac191da862dbe966961bc11990cf5791a8d
# Versions: TORCH_VERSION and VLLM_VERSION must equal requirements/gpu.txt (a test checks); every
# other Python pin comes from requirements/common.txt, the CPU environment's lock.
ARG TORCH_VERSION=2.14.0
ARG VLLM_VERSION=0.33.0
# flash-attn is source-only on PyPI; its sdist is built below, so its pin lives here, with the sdist's
# sha256 as published on PyPI (for another version: the sha256 beside the .tar.gz on
# pypi.org/project/flash-attn/<version>/#files, or `sha256sum` of the file `pip download` fetches).
ARG FLASH_ATTN_VERSION=2.8.3.post2
ARG FLASH_ATTN_SDIST_SHA256=d0f9f0b08a986cdeadbffcf5ec8b3a8f514366c68ad1853d3ab061bc83cc340b
# sm_120 only: one arch keeps the flash-attn build at ~20-30 min. Other GPUs need e.g.
# FLASH_ATTN_CUDA_ARCHS="90;120" and TORCH_CUDA_ARCH_LIST="9.0;12.0".
ARG FLASH_ATTN_CUDA_ARCHS=120
ARG TORCH_CUDA_ARCH_LIST="12.0"
# Parallel nvcc jobs for flash-attn; each takes several GB of RAM.
ARG MAX_JOBS=8
# The image user's ids; match the host user (`--build-arg USER_UID=$(id -u)`) so files written to
# the mounted checkout belong to them.
ARG USER_UID=1000
ARG USER_GID=1000

# ---- base: OS packages, the venv and torch, shared by the flash-attn build and the GPU image ----
# devel (not runtime) everywhere: flash-attn compiles with nvcc, and at run time FlashInfer (vLLM)
# and torch extensions JIT-compile with nvcc while Triton compiles its launchers with gcc. torch
# brings its own CUDA runtime libraries and cuDNN as wheels, so the base needs no cuDNN.
FROM nvidia/cuda:13.0.0-devel-ubuntu24.04@sha256:1e8ac7a54c184a1af8ef2167f28fa98281892a835c981ebcddb1fad04bdd452d AS base

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

ARG DEBIAN_FRONTEND=noninteractive
ENV LANG=C.UTF-8 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:${PATH}

# Ubuntu 24.04's python3 is 3.12; python3-dev and build-essential serve the flash-attn build and
# run-time JIT compilation; git serves DVC and the git.* tags draftlab logs.
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        build-essential \
        ca-certificates \
        git \
        python3 \
        python3-dev \
        python3-venv \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv "${VIRTUAL_ENV}"

# torch and the flash-attn build tools, hash-locked at the versions of requirements/gpu-lock.txt
# (requirements/gpu-base-lock.txt, made by scripts/lock.sh from gpu-base.in): kept apart from the
# full lock so that a change to the shared pins does not invalidate the ~30-minute flash-attn layer.
ARG TORCH_VERSION
ARG TORCH_CUDA_ARCH_LIST
ENV TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST}
COPY requirements/gpu-base-lock.txt /opt/draftlab/requirements/gpu-base-lock.txt
RUN pip install --require-hashes --no-deps --requirement /opt/draftlab/requirements/gpu-base-lock.txt \
    && python -c "import torch; assert torch.__version__.split('+')[0] == '${TORCH_VERSION}', torch.__version__; \
assert torch.version.cuda.startswith('13.'), torch.version.cuda"

# ---- flash-attn: a wheel from the hash-checked, patched sdist, against the torch above ----
FROM base AS flash-attn-build
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

ARG FLASH_ATTN_VERSION
ARG FLASH_ATTN_SDIST_SHA256
ARG FLASH_ATTN_CUDA_ARCHS
ARG MAX_JOBS
# Build from source even where setup.py could fetch a prebuilt wheel: none exists for this torch.
ENV FLASH_ATTENTION_FORCE_BUILD=TRUE \
    FLASH_ATTN_CUDA_ARCHS=${FLASH_ATTN_CUDA_ARCHS} \
    MAX_JOBS=${MAX_JOBS}

WORKDIR /build
# pip checks the hash before running any of the sdist's code (its setup.py imports torch, hence
# --no-build-isolation); sha256sum checks it again, so a wrong or missing hash stops the build.
RUN echo "flash-attn==${FLASH_ATTN_VERSION} --hash=sha256:${FLASH_ATTN_SDIST_SHA256}" > sdist.txt \
    && pip download --no-deps --no-binary :all: --no-build-isolation --require-hashes \
        --requirement sdist.txt --dest /build \
    && echo "${FLASH_ATTN_SDIST_SHA256}  flash_attn-${FLASH_ATTN_VERSION}.tar.gz" | sha256sum --check --strict - \
    && tar -xzf "flash_attn-${FLASH_ATTN_VERSION}.tar.gz"

WORKDIR /build/flash_attn-${FLASH_ATTN_VERSION}
# torch 2.14's headers need C++20 but setup.py hard-codes -std=c++17 (upstream
# Dao-AILab/flash-attention#2863, fix unreleased). Stop if the flag moved and the patch missed.
RUN grep -q -- '-std=c++17' setup.py \
    && sed -i 's/-std=c++17/-std=c++20/g' setup.py \
    && grep -q -- '-std=c++20' setup.py \
    && ! grep -q -- '-std=c++17' setup.py \
    && pip wheel --no-deps --no-build-isolation --wheel-dir /wheels . \
    && ls /wheels/flash_attn-"${FLASH_ATTN_VERSION}"-*.whl

# ---- gpu-env: the GPU image's locked Python set and the flash-attn wheel ----
FROM base AS gpu-env
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

ARG TORCH_VERSION
ARG VLLM_VERSION

# requirements/gpu-lock.txt: every package (common.txt's pins at the CPU environment's versions,
# vLLM's GPU-only dependencies, torchvision/torchaudio at the builds made for this torch) with its
# sha256, resolved once by scripts/lock.sh for Python 3.12 on x86_64 manylinux; two builds of one
# commit hold the same files. A torchvision that does not match torch breaks `import transformers`
# (torchvision::nms), so the imports are checked here, not at run time.
COPY requirements/gpu-lock.txt /opt/draftlab/requirements/gpu-lock.txt
RUN pip install --require-hashes --no-deps --requirement /opt/draftlab/requirements/gpu-lock.txt \
    && python -c "from importlib.metadata import version as v; \
assert v('torch').split('+')[0] == '${TORCH_VERSION}', v('torch'); \
assert v('vllm') == '${VLLM_VERSION}', v('vllm')" \
    && python -c "import torch, torchvision, transformers"

COPY --from=flash-attn-build /wheels/ /tmp/wheels/
RUN pip install --no-deps /tmp/wheels/flash_attn-*.whl \
    && rm -rf /tmp/wheels

# Which image this is; `scripts/gpu-check.sh` inside it runs the image's import check first.
ENV DRAFTLAB_IMAGE=gpu

# ---- cpu-env: Debian 12's Python 3.11 with the CPU lock, requirements/cpu.txt, exactly ----
# hadolint ignore=DL3006
FROM ${CPU_BASE} AS cpu-env
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

ARG DEBIAN_FRONTEND=noninteractive
ENV LANG=C.UTF-8 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:${PATH}

# A base that already holds git, python3-venv and CA certificates (the one scripts/image-check.sh
# makes with mmdebstrap, for a build without network) needs no apt-get.
RUN if ! { command -v git && python3 -c "import ensurepip, venv" && test -s /etc/ssl/certs/ca-certificates.crt; } > /dev/null 2>&1; then \
        apt-get update \
        && apt-get install -y --no-install-recommends ca-certificates git python3 python3-venv \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && python3 -m venv "${VIRTUAL_ENV}"

# The packages come from a wheelhouse mounted at /wheelhouse when there is one (scripts/image-check.sh:
# `podman build --network none --volume DIR:/wheelhouse:ro`), else from PyPI, with the CPU build of
# torch, which PyPI does not serve, from TORCH_INDEX_URL. Either way every file must match its hash.
# uv (requirements/uv.txt, hash-pinned, as scripts/lock-install.sh uses it on the host) installs
# them, bytecode compiled on every core, then leaves: the venv holds the lock exactly. pip took
# 98 s of the cold build on the shared 2-core VM (docs/container.md has the figures).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
COPY requirements/uv.txt requirements/cpu.txt /opt/draftlab/requirements/
RUN if [ -d /wheelhouse ]; then set -- --no-index --find-links /wheelhouse; \
    else set -- --extra-index-url "${TORCH_INDEX_URL}"; fi \
    && pip install --require-hashes --no-deps "$@" --target /tmp/uv --requirement /opt/draftlab/requirements/uv.txt \
    && /tmp/uv/bin/uv pip install --no-cache --python "${VIRTUAL_ENV}/bin/python" --require-hashes --no-deps \
        --compile-bytecode --index-strategy unsafe-best-match "$@" --requirement /opt/draftlab/requirements/cpu.txt \
    && rm -rf /tmp/uv \
    && python -c "import torch, transformers; assert torch.__version__ == '2.13.0+cpu', torch.__version__"

ENV DRAFTLAB_IMAGE=cpu

# ---- final: draftlab and the non-root user, on either image's Python set ----
# hadolint ignore=DL3006
FROM ${IMAGE}-env AS final
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

ARG USER_UID
ARG USER_GID

# draftlab itself, without dependencies (they are the locked set above) and built with the locked
# setuptools rather than whatever an isolated build env would download. At run time
# PYTHONPATH=/workspace/src puts the mounted checkout's code first, so the code that runs is the
# commit draftlab tags its MLflow runs with; this copy serves images run without a checkout.
# `pip check` passes but for what the CPU set leaves out by design (requirements/cpu.in:
# speculators declares torchvision and torchaudio; mlflow declares scikit-learn, scipy and skops).
WORKDIR /opt/draftlab
COPY pyproject.toml README.md ./
COPY src/ ./src/
# (PIP_NO_CACHE_DIR=1 comes from either env stage, which hadolint cannot follow through ${IMAGE}.)
# hadolint ignore=DL3042
RUN pip install --no-deps --no-build-isolation . \
    && broken="$(pip check | grep -vE '^No broken requirements found|^speculators [^ ]+ requires torch(vision|audio), which is not installed|^mlflow [^ ]+ requires (scikit-learn|scipy|skops), which is not installed' || true)" \
    && if [ -n "${broken}" ]; then echo "${broken}"; exit 1; fi \
    && python -c "import draftlab"

# The user "draftlab", never root. The ubuntu:24.04 base ships a user "ubuntu" with uid/gid 1000,
# the default here: remove it. USER below is numeric so that runtimes can verify it is not root.
# /cache is world-writable (sticky) so `--user "$(id -u):$(id -g)"` works for any host user.
RUN test "${USER_UID}" -ne 0 \
    && if getent passwd ubuntu > /dev/null; then userdel --remove ubuntu; fi \
    && if ! getent group "${USER_GID}" > /dev/null; then groupadd --gid "${USER_GID}" draftlab; fi \
    && useradd --uid "${USER_UID}" --gid "${USER_GID}" --create-home --shell /bin/bash draftlab \
    && mkdir -p /workspace /cache/huggingface /cache/cuda /cache/config /cache/matplotlib /mlartifacts \
    && chown "${USER_UID}:${USER_GID}" /workspace /mlartifacts \
    && chmod 1777 /cache /cache/huggingface /cache/cuda /cache/config /cache/matplotlib \
    && git config --system --add safe.directory /workspace

# A uid with no passwd entry here (`--user "$(id -u)"`) gets HOME=/workspace, the checkout: what
# tools keep in ~/.config and ~/.cache (DVC's and MLflow's settings, matplotlib's font cache) goes
# to /cache instead.
ENV HF_HOME=/cache/huggingface \
    XDG_CONFIG_HOME=/cache/config \
    MPLCONFIGDIR=/cache/matplotlib \
    CUDA_CACHE_PATH=/cache/cuda \
    XDG_CACHE_HOME=/cache \
    TRITON_CACHE_DIR=/cache/triton \
    TORCHINDUCTOR_CACHE_DIR=/cache/torchinductor \
    VLLM_CACHE_ROOT=/cache/vllm \
    PYTHONPATH=/workspace/src

# `mlflow ui` / `mlflow server` here start without MLflow's job runners (huey consumers for its
# GenAI jobs), which serve nothing draftlab logs: 2 processes instead of 10 (compose.yaml).
ENV MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false

VOLUME ["/cache"]
# MLflow UI / tracking server (`docker run -p 127.0.0.1:5000:5000 … mlflow ui --host 0.0.0.0`: the
# container listens on every interface, the host publishes it on localhost only; or the compose service).
EXPOSE 5000

USER ${USER_UID}:${USER_GID}
WORKDIR /workspace
CMD ["dvc", "repro"]
