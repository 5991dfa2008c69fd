# The service image: gateway, scheduler and detokenizer (the operator has its own slim CPU image,
# Dockerfile.operator).
#
#   docker build -t REGISTRY/radixserve:TAG .                                  (x86_64 with internet;
#   docker build -f Dockerfile.operator -t REGISTRY/radixserve-operator:TAG .  no GPU needed to build)
#   docker push REGISTRY/radixserve:TAG && docker push REGISTRY/radixserve-operator:TAG
#
# Pods choose their component with `command` (python -m radixserve.scheduler, ...: the operator
# sets it); run by hand, the entrypoint is the `radixserve` CLI. Configuration comes from
# RADIXSERVE_* environment variables (every flag has one).
#
# Layers, the ones that change least first, so editing the code rebuilds only the last one:
#   1. OS packages, Python, torch (from the CUDA wheel index)
#   2. the dependencies, from pyproject.toml alone (scripts/image_requirements.py reads them)
#   3. flashinfer's ahead-of-time compiled kernels (flashinfer-jit-cache)
#   4. the source, installed with --no-deps: nothing is resolved or downloaded again
#
# flashinfer kernels. flashinfer-python compiles a kernel (nvcc) the first time a process needs it,
# minutes per model shape, and the runtime base has no nvcc. Two measures:
#   * Ahead of time: flashinfer publishes `flashinfer-jit-cache`, its kernels precompiled, a wheel per
#     flashinfer version and CUDA (versioned VERSION+cuXYZ) on its own index
#     https://flashinfer.ai/whl/cuXYZ (cu128, cu129, cu130), not on PyPI (docs.flashinfer.ai,
#     installation.html). Its release workflow builds the cu128 wheel for sm 7.5 8.0 8.9 9.0a 10.0a
#     12.0a (T4 to B200, H100/H200 included); the kernels are tvm-ffi modules, so any torch can load
#     them. flashinfer takes a module from it when there is one (flashinfer/jit/env.py:
#     FLASHINFER_AOT_DIR is that package's jit_cache/ folder) and refuses to import when the versions
#     differ (jit-cache's must start with flashinfer-python's), hence one FLASHINFER_VERSION for both.
#     The build checks that flashinfer imports and finds the kernels. FLASHINFER_JIT_CACHE=0 leaves
#     them out (a smaller image; every kernel then compiles at run time, which needs the devel base).
#   * A cache folder on the pods' volume: what the AOT set lacks is compiled into
#     $FLASHINFER_WORKSPACE_BASE/.cache/flashinfer/ (default base $HOME; flashinfer/jit/env.py; 0.6.0
#     adds <version>/<sm archs>/cached_ops, so releases stay apart). The base is /cache, the pods'
#     writable emptyDir, which outlives the pod's containers: a restarted scheduler reuses its kernels.
#     A persistent volume mounted at /cache/.cache/flashinfer would keep them across pods too.
#   `flashinfer-cubin` (PyPI) is not installed: it holds the downloadable binaries (TensorRT-LLM-gen
#   attention and GEMMs, cuDNN SDPA, DeepGEMM: flashinfer/artifacts.py), which radixserve's FA2 paged
#   attention and sampling do not use, and its version must equal flashinfer-python's exactly while it
#   lags behind (0.6.13 was its newest in 2026-11).
# Compiling kernels the AOT set lacks needs nvcc: for such models build with
#   --build-arg CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-devel-ubuntu24.04
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}

# torch first, from the CUDA wheel index that matches the base image: installed later as a
# plain dependency it would come from PyPI with whatever CUDA that build bundles.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
# The flashinfer release the GPU path is written against (pyproject's gpu extra allows 0.6.x;
# scripts/gpu-check carries this one to the GPU test machine), and its prebuilt kernels for the base
# image's CUDA (cu128).
ARG FLASHINFER_VERSION=0.6.0
ARG FLASHINFER_JIT_CACHE=1
ARG FLASHINFER_JIT_CACHE_INDEX_URL=https://flashinfer.ai/whl/cu128
# pyproject.toml's optional-dependencies groups installed besides the dependencies (comma-separated):
# flashinfer, and the object-store clients of `python -m radixserve.common.model_fetch`, which the
# pods' fetch-model init container runs in this image to download a model from s3:// or gs://.
ARG IMAGE_EXTRAS=gpu,s3,gcs

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    HOME=/cache \
    FLASHINFER_WORKSPACE_BASE=/cache

RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv "$VIRTUAL_ENV" \
    && pip install --upgrade pip \
    && pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

# The dependencies: only pyproject.toml (and the script that reads it) are in the layer. The
# constraints keep the torch above (a dependency asking for another version fails the build instead
# of pulling a PyPI build) and pin flashinfer-python to the jit-cache's version.
WORKDIR /src
COPY pyproject.toml ./
COPY scripts/image_requirements.py ./scripts/
RUN python scripts/image_requirements.py service --extra "${IMAGE_EXTRAS}" > /tmp/requirements.txt \
    && printf 'torch==%s\nflashinfer-python==%s\n' "${TORCH_VERSION}" "${FLASHINFER_VERSION}" \
        > /tmp/constraints.txt \
    && pip install -r /tmp/requirements.txt -c /tmp/constraints.txt \
    && rm /tmp/requirements.txt /tmp/constraints.txt

# flashinfer's AOT kernels (see the top). --no-deps: nothing else comes from that index. The check
# imports flashinfer (its version check runs at import) with a throwaway workspace, so no root-owned
# folder is left under /cache.
RUN if [ "${FLASHINFER_JIT_CACHE}" = 1 ]; then \
        pip install --no-deps --index-url "${FLASHINFER_JIT_CACHE_INDEX_URL}" \
            "flashinfer-jit-cache==${FLASHINFER_VERSION}" \
        && FLASHINFER_WORKSPACE_BASE=/tmp/flashinfer-check python -c "from flashinfer.jit import env; \
            aot = env.FLASHINFER_AOT_DIR; \
            assert aot.is_dir() and any(aot.iterdir()), f'no AOT kernels in {aot}'" \
        && rm -rf /tmp/flashinfer-check; \
    fi

# The source. setup.py generates the gRPC stubs from proto/ at install time (grpcio-tools and
# setuptools came with the dependencies: --no-build-isolation uses them instead of downloading).
COPY setup.py README.md ./
COPY proto ./proto
COPY services ./services
COPY operator ./operator
RUN pip install --no-deps --no-build-isolation . \
    && cd / && rm -rf /src \
    && python -c "import radixserve.cli, radixserve.common.pb.radixserve_pb2_grpc"

# Non-root; the uid matches the pods' securityContext (runAsUser 1000). Writable paths at run
# time are emptyDirs mounted by the pods (/cache, /tmp), so the root filesystem can be read-only.
RUN (userdel --remove ubuntu 2>/dev/null || true) \
    && useradd --uid 1000 --user-group --no-create-home --home-dir /cache radixserve \
    && mkdir -p /cache && chown 1000:1000 /cache
USER 1000:1000
WORKDIR /cache

ENTRYPOINT ["radixserve"]
CMD ["--help"]
