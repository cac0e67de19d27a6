# syntax=docker/dockerfile:1
#
# draftlab GPU image: CUDA 13.0 devel on Ubuntu 24.04, a Python 3.12 venv with torch (cu130,
# sm_120 kernels), vLLM, flash-attn compiled for sm_120 (RTX PRO 6000 Blackwell), speculators and
# draftlab at the pins in requirements/. The user's checkout is mounted at /workspace; the default
# command is `dvc repro`. Build and run: docs/container.md. Rules this file must keep (digest pins,
# versions equal to requirements/, sm_120, non-root user, ...) are checked by
# tests/unit/test_dockerfile.py.
#
#   docker build -t draftlab .        # compiles flash-attn: ~20-30 min at MAX_JOBS=8
#
# The base is pinned by digest. To check the digest or pick up a refreshed one:
#   docker buildx imagetools inspect nvidia/cuda:13.0.0-devel-ubuntu24.04

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

# ---- base: OS packages, the venv and torch, shared by the flash-attn build and the final image ----
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

ARG TORCH_VERSION
ARG TORCH_CUDA_ARCH_LIST
ENV TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST}
RUN pip install "torch==${TORCH_VERSION}" \
    && python -c "import torch; assert torch.version.cuda.startswith('13.'), torch.version.cuda"

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

COPY requirements/flash-attn-build.txt /tmp/flash-attn-build.txt
RUN pip install --requirement /tmp/flash-attn-build.txt

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

# ---- final: the locked Python stack, the flash-attn wheel, draftlab, a non-root user ----
FROM base AS final
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

ARG TORCH_VERSION
ARG VLLM_VERSION
ARG USER_UID
ARG USER_GID

# -r common.txt inside gpu.txt makes every shared pin identical to the CPU environment; vLLM's
# other dependencies (torchvision/torchaudio at the builds made for this torch among them) resolve
# freely. A torchvision that does not match torch breaks `import transformers`
# (torchvision::nms), so the imports are checked here, not at run time.
COPY requirements/ /opt/draftlab/requirements/
RUN pip install --requirement /opt/draftlab/requirements/gpu.txt \
    && python -c "from importlib.metadata import version as v; \
assert v('torch').split('+')[0] == '${TORCH_VERSION}', v('torch'); \
assert v('vllm') == '${VLLM_VERSION}', v('vllm')" \
    && python -c "import torch, torchvision, transformers"

COPY --from=flash-attn-build /wheels/ /tmp/wheels/
RUN pip install --no-deps /tmp/wheels/flash_attn-*.whl \
    && rm -rf /tmp/wheels

# draftlab itself, without dependencies (they are the locked set above) and built with the locked
# setuptools rather than whatever an isolated build env would download. At run time
# PYTHONPATH=/workspace/src puts the mounted checkout's code first, so the code that runs is the
# commit draftlab tags its MLflow runs with; this copy serves images run without a checkout.
WORKDIR /opt/draftlab
COPY pyproject.toml README.md ./
COPY src/ ./src/
RUN pip install --no-deps --no-build-isolation . \
    && pip check \
    && python -c "import draftlab"

# The user "draftlab", never root. The ubuntu:24.04 base ships a user "ubuntu" with uid/gid 1000,
# the default here: remove it. USER below is numeric so that runtimes can verify it is not root.
# /cache is world-writable (sticky) so `--user "$(id -u):$(id -g)"` works for any host user.
RUN test "${USER_UID}" -ne 0 \
    && if getent passwd ubuntu > /dev/null; then userdel --remove ubuntu; fi \
    && if ! getent group "${USER_GID}" > /dev/null; then groupadd --gid "${USER_GID}" draftlab; fi \
    && useradd --uid "${USER_UID}" --gid "${USER_GID}" --create-home --shell /bin/bash draftlab \
    && mkdir -p /workspace /cache/huggingface /cache/cuda /mlartifacts \
    && chown "${USER_UID}:${USER_GID}" /workspace /mlartifacts \
    && chmod 1777 /cache /cache/huggingface /cache/cuda \
    && git config --system --add safe.directory /workspace

ENV HF_HOME=/cache/huggingface \
    CUDA_CACHE_PATH=/cache/cuda \
    XDG_CACHE_HOME=/cache \
    TRITON_CACHE_DIR=/cache/triton \
    TORCHINDUCTOR_CACHE_DIR=/cache/torchinductor \
    VLLM_CACHE_ROOT=/cache/vllm \
    PYTHONPATH=/workspace/src

VOLUME ["/cache"]
# MLflow UI / tracking server (`mlflow ui --host 0.0.0.0 --port 5000`, or the compose service).
EXPOSE 5000

USER ${USER_UID}:${USER_GID}
WORKDIR /workspace
CMD ["dvc", "repro"]
