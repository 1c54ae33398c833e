# syntax=docker/dockerfile:1
# The image that the k8s/ manifests run: the Ray head and workers (`ray start`, KubeRay's command),
# the in-tree autoscaler sidecar (KubeRay uses the head's image), and the workers' `fetch-models`
# init container. It installs exactly as the README does: `make install` into /app/.venv.
#
#   docker build -t REGISTRY/specserve:0.1.0 .                                    # CPU (cpu overlay)
#   docker build -t REGISTRY/specserve:0.1.0-cuda \
#       --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130 .      # CUDA (gpu overlay)
#
# Model packs are NOT baked in: they go into the model cache volume (a PersistentVolumeClaim at
# /models, settings `store.cache_dir`), fetched and converted once by the init container and
# then shared by every worker pod and kept across restarts. That keeps the image small (the Qwen
# pair alone is ~4 GB converted, a 70B checkpoint 141 GB), lets one image serve any model, and
# makes changing the model a settings change instead of a rebuild. The cluster needs egress to
# PyPI (packs) or the Hugging Face hub (hub ids) once; without it, fill the volume beforehand.

ARG PYTHON_IMAGE=python:3.11-slim

# ---------------------------------------------------------------------------------- build
FROM ${PYTHON_IMAGE} AS build
# g++: `make install` compiles our q8 kernel (serve_app/native_build.py) for AVX2 hosts.
RUN apt-get update \
    && apt-get install -y --no-install-recommends make g++ \
    && rm -rf /var/lib/apt/lists/*

# torch: the README's route is the pinned CPU wheel from local disk (`make install` passes
# --find-links $(TORCH_WHEELS) and pins torch==2.13.0). Here, on a normal build machine, that wheel
# comes from PyTorch's CPU index (`pip install torch==2.13.0 --index-url
# https://download.pytorch.org/whl/cpu`): downloaded into /opt/wheels, which `make install` then
# uses exactly as it uses the local wheels. For the CUDA image pass a CUDA index instead.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip download --no-deps --dest /opt/wheels --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

# Ray must be the version the RayService declares (spec.rayClusterConfig.rayVersion, from
# RAY_VERSION in deploy/manifest.py; tests/k8s check that both agree).
ARG RAY_VERSION=2.60.0

WORKDIR /app
COPY . /app
RUN echo "ray==${RAY_VERSION}" > /opt/ray-constraint.txt \
    && PIP_CONSTRAINT=/opt/ray-constraint.txt PIP_NO_CACHE_DIR=1 \
       make install PYTHON=python3.11 TORCH_WHEELS=/opt/wheels \
    && .venv/bin/python -c "import ray, torch; \
assert ray.__version__ == '${RAY_VERSION}', ray.__version__; \
assert torch.__version__.startswith('${TORCH_VERSION}'), torch.__version__; \
import serve_app.app, deploy.kuberay"

# ---------------------------------------------------------------------------------- runtime
FROM ${PYTHON_IMAGE} AS runtime
# bash and wget: KubeRay's commands and the pods' probes (see deploy/manifest.py).
RUN apt-get update \
    && apt-get install -y --no-install-recommends wget \
    && rm -rf /var/lib/apt/lists/*
# uid 1000 as in Ray's own images; the pods' fsGroup 1000 makes the cache volume writable.
RUN groupadd --gid 1000 ray && useradd --uid 1000 --gid 1000 --create-home --shell /bin/bash ray
# the venv's paths are absolute: it stays at /app/.venv (an editable install of /app)
COPY --from=build --chown=1000:1000 /app /app
ENV PATH=/app/.venv/bin:$PATH \
    PYTHONUNBUFFERED=1
# KubeRay runs `ray start` through `bash -lc`, and a login shell's /etc/profile resets PATH: put
# the venv back there too.
RUN echo 'export PATH=/app/.venv/bin:$PATH' > /etc/profile.d/specserve-venv.sh
WORKDIR /app
USER 1000
EXPOSE 8000 8265 6379 10001
# KubeRay replaces the command (`ray start ...`). Locally:
#   docker run --shm-size=2g -p 8000:8000 IMAGE specserve serve --host 0.0.0.0
CMD ["specserve", "--help"]
