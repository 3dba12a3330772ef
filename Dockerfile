# ddpq's API and worker image: the CUDA build of PyTorch that ddpq pins, plus ddpq.
# The same image runs `ddpq serve` (no GPU needed) and `ddpq worker` (given the
# host's NVIDIA GPUs by the container runtime; nccl comes with torch's CUDA wheels).
ARG BASE_IMAGE=pytorch/pytorch:2.14.1-cuda13.0-cudnn9-runtime
FROM ${BASE_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    DDPQ_DATA_DIR=/data

WORKDIR /opt/ddpq
COPY pyproject.toml README.md ./
COPY ddpq ./ddpq
COPY service ./service
COPY worker ./worker
COPY recipes ./recipes
COPY migrations ./migrations
COPY examples ./examples
# torch and torchvision are already in the base image at the pinned versions (ddpq[all]
# asks for torch>=2.2, which they satisfy; a plain `.` would now lack the server and worker).
# /data/checkpoints and /workspace exist, owned by ddpq, in the image: a fresh named
# volume takes the owner of the image's directory, so the worker (uid 1000) can write
# its checkpoints (Docker would otherwise create them root-owned and every job fail).
# The examples are in the workspace so `--entrypoint examples/ddp_plain.py` runs as is.
RUN pip install --no-cache-dir '.[all]' \
    && python -c "import torch, torchvision, ddpq, service, worker, recipes" \
    && useradd --create-home --uid 1000 ddpq \
    && mkdir -p /data/checkpoints /workspace \
    && cp -r examples /workspace/examples \
    && chown -R ddpq:ddpq /data /workspace

USER ddpq
WORKDIR /workspace
EXPOSE 8000
CMD ["ddpq", "serve", "--host", "0.0.0.0", "--port", "8000"]
