# syntax=docker/dockerfile:1
#
# One image for both pagedserve services; compose.yaml picks the command
# (`python -m executor_service ...` or `python -m scheduler_service ...`).
#
# CPU image (the default; what `docker compose up` builds):
#   docker build -t pagedserve .
#
# NVIDIA GPU image (what compose.gpu.yaml builds for the executor): a CUDA base, a CUDA build of
# torch, Triton (paged-attention kernels) and a C compiler (Triton builds its launcher at run time):
#   docker build -t pagedserve-cuda \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04 \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 \
#     --build-arg EXCLUDE_DEPS= \
#     --build-arg RUNTIME_APT_PACKAGES="gcc libc6-dev" .
#
# BASE_IMAGE may be any Debian/Ubuntu image: one without python3 (the nvidia/cuda ones) gets the
# distribution's python3 (must be >= 3.11, so Ubuntu 24.04 or newer) plus venv and headers.
# Pick the CUDA wheel index (cu126, cu128, ...) and the CUDA base for your driver (`nvidia-smi`).

ARG BASE_IMAGE=python:3.11-slim-bookworm

# ---- python: the base plus a Python >= 3.11 and what the runtime needs from apt --------------------
FROM ${BASE_IMAGE} AS python
ARG RUNTIME_APT_PACKAGES=""
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN set -eux; \
    pkgs="${RUNTIME_APT_PACKAGES}"; \
    if ! command -v python3 >/dev/null 2>&1; then pkgs="$pkgs python3 python3-venv python3-dev"; fi; \
    if [ -n "$(echo $pkgs)" ]; then \
        apt-get update; \
        apt-get install -y --no-install-recommends $pkgs; \
        rm -rf /var/lib/apt/lists/*; \
    fi; \
    python3 -c 'import sys; assert sys.version_info >= (3, 11), f"pagedserve needs Python >= 3.11, base has {sys.version}"'

# ---- build: a virtual environment with torch, the dependencies, pagedserve and the default model ----
FROM python AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# Dependencies left out of the image, space separated. The CPU image leaves out Triton: the executor
# only uses its kernels on CUDA (the CUDA torch wheels bring their own pinned Triton anyway).
ARG EXCLUDE_DEPS="triton"
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first, from the chosen index, so no other resolver step pulls a different (CUDA) build.
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"
# The dependencies alone (cached while pyproject.toml is unchanged), then the project without deps.
COPY pyproject.toml /src/pyproject.toml
RUN python -c 'import os, re, tomllib; \
deps = tomllib.load(open("/src/pyproject.toml", "rb"))["project"]["dependencies"]; \
skip = set(os.environ.get("EXCLUDE_DEPS", "").lower().split()); \
keep = [d for d in deps if re.split(r"[ <>=!~;\[]", d, maxsplit=1)[0].lower() not in skip]; \
open("/tmp/requirements.txt", "w").write("\n".join(keep) + "\n")' \
    && cat /tmp/requirements.txt
RUN pip install -r /tmp/requirements.txt
# A C++ compiler for the executor's CPU kernels (paged attention; the model's linear, RoPE, RMSNorm, SiLU ops), in
# this stage only: the runtime loads the libraries built here and needs no compiler.
ARG BUILD_APT_PACKAGES="g++"
RUN if [ -n "$(echo ${BUILD_APT_PACKAGES})" ]; then \
        apt-get update && apt-get install -y --no-install-recommends ${BUILD_APT_PACKAGES} \
        && rm -rf /var/lib/apt/lists/*; \
    fi
COPY . /src
RUN pip install --no-deps /src
# Built with -march=native for the CPU this image is built on, keyed by its feature flags: an executor on a CPU
# with other flags finds no build of its own, warns and runs the torch fallbacks (2 - 3x slower on the CPU).
ENV PAGEDSERVE_KERNEL_DIR=/opt/pagedserve/kernels
RUN cd / && (python -m executor_service.kernels \
    || echo "WARNING: the C++ CPU kernels did not build; the executor will run its torch fallbacks")
# The trained default model ships inside the package (a few MB of bf16 weights); check that it was installed.
ENV PAGEDSERVE_CACHE_DIR=/opt/pagedserve/cache
RUN cd / && mkdir -p /opt/pagedserve/cache \
    && python -c "from executor_service.default_model.model import ensure_default_model as e; assert (e() / 'model.safetensors').is_file(); print(e())" \
    && chmod -R a+rX /opt/pagedserve \
    && python -m executor_service --help >/dev/null && python -m scheduler_service --help >/dev/null

# ---- runtime: the venv, the default model and a non-root user; nothing else ------------------------
FROM python AS runtime
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PAGEDSERVE_CACHE_DIR=/opt/pagedserve/cache \
    PAGEDSERVE_KERNEL_DIR=/opt/pagedserve/kernels \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    HOME=/home/pagedserve
RUN groupadd --system --gid 10001 pagedserve \
    && useradd --system --uid 10001 --gid pagedserve --home-dir /home/pagedserve --create-home \
       --shell /usr/sbin/nologin pagedserve \
    && install -d -o pagedserve -g pagedserve -m 700 /var/lib/pagedserve/secret
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/pagedserve /opt/pagedserve
# Everything above stays root's (the executor cannot rewrite its code, kernels or model) except the start-up
# cache: the packing choice the first start measured and the converted weights, reused by a restart (compose
# mounts a volume here to keep them across containers; it takes this directory's owner and mode).
RUN install -d -o pagedserve -g pagedserve -m 700 /opt/pagedserve/cache/startup
USER pagedserve
WORKDIR /home/pagedserve
# 50051 scheduler gRPC (public), 8080 scheduler OpenAI-compatible HTTP API (public), 8000 scheduler
# metrics, 50061 executor gRPC (keep it private).
EXPOSE 50051 8080 8000 50061
CMD ["python", "-m", "scheduler_service", "--listen", "0.0.0.0:50051", "--http-listen", "0.0.0.0:8080", \
     "--metrics-host", "0.0.0.0"]
