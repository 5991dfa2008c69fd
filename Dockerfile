# One image for every radixserve component: gateway, scheduler, detokenizer and the operator.
#
#   docker build -t REGISTRY/radixserve:TAG .        (x86_64 with internet; no GPU needed to build)
#   docker push REGISTRY/radixserve:TAG
#
# Pods choose their component with `command` (python -m radixserve.scheduler, ...: the operator
# and the chart set it); run by hand, the entrypoint is the `radixserve` CLI. Configuration comes
# from RADIXSERVE_* environment variables (every flag has one).
#
# flashinfer JIT-compiles kernels its prebuilt set lacks, and that needs nvcc, which the runtime
# base does not have: for such models build with
#   --build-arg CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-devel-ubuntu24.04
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}

# torch first, from the CUDA wheel index that matches the base image: installed later as a
# plain dependency it would come from PyPI with whatever CUDA that build bundles.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    HOME=/cache

RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv "$VIRTUAL_ENV" \
    && pip install --upgrade pip \
    && pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

# setup.py generates the gRPC stubs from proto/ at install time, so it and proto/ come along.
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY proto ./proto
COPY services ./services
COPY operator ./operator
RUN pip install ".[gpu]" && rm -rf /src

# Non-root; the uid matches the pods' securityContext (runAsUser 1000). Writable paths at run
# time are emptyDirs mounted by the pods (/cache, /tmp), so the root filesystem can be read-only.
RUN (userdel --remove ubuntu 2>/dev/null || true) \
    && useradd --uid 1000 --user-group --no-create-home --home-dir /cache radixserve \
    && mkdir -p /cache && chown 1000:1000 /cache
USER 1000:1000
WORKDIR /cache

ENTRYPOINT ["radixserve"]
CMD ["--help"]
