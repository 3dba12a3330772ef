# ddpq's two images, two targets of this one file (docker-compose.yml builds each):
#   api     `ddpq serve`: a slim Python with only the server part of the lock, no torch
#           (the API never imports it; about a tenth of the worker image's size).
#   worker  `ddpq worker`: the CUDA build of PyTorch that ddpq pins, plus the worker and
#           recipes part of the lock (given the host's NVIDIA GPUs by the container
#           runtime; nccl comes with torch's CUDA wheels).
# Both install from the lock (requirements/*.txt, every file checked against its hash)
# and then ddpq itself without dependencies, so an image holds exactly what the suite
# passed with. `docker build --target api .` or `--target worker`.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG BASE_IMAGE=pytorch/pytorch:2.14.1-cuda13.0-cudnn9-runtime

# ---- the API -----------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS api
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DDPQ_DATA_DIR=/data
WORKDIR /opt/ddpq
# The lock before the source: a code change rebuilds one small layer, not the packages.
COPY requirements/server.txt requirements/
RUN pip install -q --require-hashes -r requirements/server.txt
COPY pyproject.toml README.md ./
COPY ddpq ./ddpq
COPY service ./service
COPY worker ./worker
COPY recipes ./recipes
COPY migrations ./migrations
# The import check proves the API starts without torch; the image must not have it.
RUN pip install -q --no-deps . \
    && python -c "import ddpq.cli, service.app" \
    && if python -c "import torch" 2>/dev/null; then echo "torch in the API image" >&2; exit 1; fi \
    && useradd --create-home --uid 1000 ddpq \
    && mkdir -p /data \
    && chown ddpq:ddpq /data
USER ddpq
EXPOSE 8000
CMD ["ddpq", "serve", "--host", "0.0.0.0", "--port", "8000"]

# ---- the worker --------------------------------------------------------------------------
FROM ${BASE_IMAGE} AS worker
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DDPQ_DATA_DIR=/data
WORKDIR /opt/ddpq
# torch, torchvision and CUDA's libraries are in the base image at the locked versions:
# pip finds them satisfied and downloads only the rest of the worker's part of the lock.
COPY requirements/worker.txt requirements/
RUN pip install -q --require-hashes -r requirements/worker.txt
COPY pyproject.toml README.md ./
COPY ddpq ./ddpq
COPY service ./service
COPY worker ./worker
COPY recipes ./recipes
COPY migrations ./migrations
COPY examples ./examples
# /data/checkpoints and /workspace exist, owned by ddpq, in the image: a fresh named
# volume takes the owner of the image's directory, so the worker (uid 1000) can write
# its checkpoints (Docker would otherwise create them root-owned and every job fail).
# The examples are in the workspace so `--entrypoint examples/ddp_plain.py` runs as is.
RUN pip install -q --no-deps . \
    && python -c "import torch, torchvision, ddpq.cli, worker.executors.agent, recipes" \
    && useradd --create-home --uid 1000 ddpq \
    && mkdir -p /data/checkpoints /workspace \
    && cp -r examples /workspace/examples \
    && chown -R ddpq:ddpq /data /workspace
USER ddpq
WORKDIR /workspace
CMD ["ddpq", "worker", "--workspace", "/workspace", "--data-dir", "/data", "--checkpoint-dir", "/data/checkpoints"]
