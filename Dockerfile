# Two images from one file:
#   docker build --target operator -t ghcr.io/specula-dev/specula-operator:0.1.0 .
#   docker build --target runtime  -t ghcr.io/specula-dev/specula-runtime:0.1.0 .
# Two build arguments pick the bases: PYTHON_IMAGE (the operator's: any Debian-family
# image with python3 and python3-venv) and RUNTIME_BASE_IMAGE (the runtime's: CUDA by
# default; any Debian or Ubuntu image gives the CPU variant, with the same steps):
#   docker build --target runtime --build-arg RUNTIME_BASE_IMAGE=debian:bookworm \
#     -t ghcr.io/specula-dev/specula-runtime:0.1.0-cpu .
# Each installs Specula with hack/install.sh (the script `make setup` runs) into a
# virtual environment at /opt/specula, with no pip cache.  The operator's is built in a
# stage of its own and copied, so no build tree reaches that image; the runtime's is
# built in place, its dependencies in a layer of their own.

ARG PYTHON_IMAGE=python:3.12.8-slim-bookworm
ARG RUNTIME_BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

# ---- operator: kopf, the Kubernetes client and pydantic; no torch ------------------
FROM ${PYTHON_IMAGE} AS operator-build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY hack/install.sh hack/install.sh
COPY specula specula
RUN PIP_NO_CACHE_DIR=1 bash hack/install.sh /opt/specula .

FROM ${PYTHON_IMAGE} AS operator
RUN groupadd --gid 1000 specula \
 && useradd --uid 1000 --gid 1000 --create-home --shell /usr/sbin/nologin specula
COPY --from=operator-build /opt/specula /opt/specula
ENV PATH=/opt/specula/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
# Numeric, so the kubelet can verify runAsNonRoot without reading /etc/passwd.
USER 1000:1000
WORKDIR /home/specula
ENTRYPOINT ["specula"]
CMD ["operator"]

# ---- runtime: CUDA, PyTorch and the serving stack --------------------------------
# One stage: the runtime needs the compiler at run time anyway (Triton), so a separate
# build stage would only copy the gigabytes of the environment once more.
FROM ${RUNTIME_BASE_IMAGE} AS runtime
ARG DEBIAN_FRONTEND=noninteractive
# gcc, libc6-dev and python3-dev: Triton compiles each kernel's small C launcher at
# first use (against Python.h) and finds no prebuilt one in a fresh container.
# python3 is 3.12 on the CUDA image's Ubuntu 24.04, 3.11 on Debian 12.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev \
    gcc libc6-dev ca-certificates \
 && rm -rf /var/lib/apt/lists/*
# Ubuntu 24.04 ships a user "ubuntu" with uid 1000; the operator runs runtime pods as
# uid 1000 (runAsUser), so that uid becomes "specula" with a home for model caches.
RUN (userdel --remove ubuntu 2>/dev/null || true) \
 && groupadd --gid 1000 specula \
 && useradd --uid 1000 --gid 1000 --create-home --shell /usr/sbin/nologin specula
WORKDIR /opt/specula-build
COPY pyproject.toml ./
COPY hack/install.sh hack/install.sh
# The dependencies (PyTorch: gigabytes) in a layer keyed on pyproject.toml alone, so a
# change of Specula's own code (or of the README the package metadata reads) rebuilds
# only the small layer after it.
RUN PYTHON=python3 PIP_NO_CACHE_DIR=1 bash hack/install.sh --deps-only /opt/specula '.[runtime]'
COPY README.md ./
COPY specula specula
RUN PYTHON=python3 PIP_NO_CACHE_DIR=1 bash hack/install.sh /opt/specula --no-deps '.[runtime]' \
 && rm -rf /opt/specula-build
ENV PATH=/opt/specula/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HOME=/home/specula/.cache/huggingface
USER 1000:1000
WORKDIR /home/specula
# OpenAI-compatible API and Prometheus metrics (specula.api.render RUNTIME_PORT, METRICS_PORT).
EXPOSE 8000 9090
ENTRYPOINT ["specula"]
# The config file the operator mounts from the resource's ConfigMap.
CMD ["serve", "--config", "/etc/specula/runtime.json"]
